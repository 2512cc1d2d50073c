"""Shared test helpers: small configs on scikit-learn's digits (real data, no files)."""

from splitfed.config import build_config


def digits_config(**over):
    """A tiny digits run; ``section__field=value`` sets one field, ``section=...`` a whole
    section."""
    raw = {"name": "t", "rounds": 2, "progress": False, "seed": 3,
           "algorithm": {"name": "fedavg"},
           "data": {"name": "digits"},
           "partition": {"scheme": "iid", "num_clients": 3},
           "model": {"name": "mlp", "hidden": [32]},
           "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.1},
           "participation": {"mode": "full"}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[section] = value
    return build_config(raw)
