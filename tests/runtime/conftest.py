"""Fixtures of the runtime tests."""

import threading

import pytest

from splitfed.runtime import launch


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank fails the test."""
    def start(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "spawn", start)
    monkeypatch.setattr(launch, "torchrun", start)


class _WaitInPlace:
    """A stand-in for rank 0's pool of waiting threads, for tests whose gloo transfers
    are stand-ins that finish at once: each wait runs in the caller, as a pool thread
    would run it. A real pool's threads live as long as the process, and one pool per
    test would leave hundreds in the test process."""

    def __init__(self, threads: int):
        pass

    def submit(self, work, timeout=None):
        done, box = threading.Event(), []
        try:
            work.wait() if timeout is None else work.wait(timeout)
        except Exception as e:  # noqa: BLE001 - reported to the waiting caller
            box.append(e)
        done.set()
        return done, box


@pytest.fixture
def links_without_threads(monkeypatch):
    """Links made in the test start no waiting threads."""
    from splitfed.transport import distributed
    monkeypatch.setattr(distributed, "_Waiter", _WaitInPlace)
