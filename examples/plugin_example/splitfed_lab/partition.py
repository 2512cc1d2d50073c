"""``label_blocks``: sort the samples by label and give each client a contiguous block."""

from __future__ import annotations

import numpy as np

from splitfed import register_partitioner


@register_partitioner("label_blocks")
def label_blocks(labels, num_clients, rng, shuffle=True):
    """Strongly non-IID: each client holds a contiguous block of the label-sorted
    samples, so only the classes that block spans (one or two when a class is larger
    than a block). ``shuffle`` (an option, ``partition.shuffle``) shuffles within each
    label first."""
    order = rng.permutation(len(labels)) if shuffle else np.arange(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, num_clients)]
