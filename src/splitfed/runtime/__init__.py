"""The multi-process runtime: the same algorithms as real processes on torch.distributed.

Rank 0 hosts the fed server and the main server, the other ranks host blocks of clients;
see docs/distributed.md. ``splitfed launch CONFIG --nproc N`` starts a run on one
machine; :mod:`splitfed.runtime.worker` is the process every rank runs.
"""
