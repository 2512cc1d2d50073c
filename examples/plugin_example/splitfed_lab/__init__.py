"""A splitfed plugin: importing it registers a model with cut points, a data set read
from CSV files, a partitioner, a clock profile, a gradient transform (per-client gradient
norm clipping), a server step (coordinate-wise trimmed mean) and a split algorithm
(parallel split learning); docs/extending.md."""

from splitfed_lab import clock, data, models, partition, psl, robust, transforms  # noqa: F401
