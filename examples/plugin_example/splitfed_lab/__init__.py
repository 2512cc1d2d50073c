"""A splitfed plugin: importing it registers a model, a data set, a partitioner, a clock
profile and a FedAvg variant (docs/extending.md)."""

from splitfed_lab import algorithms, clock, data, models, partition  # noqa: F401
