"""Rank 0's round records (``metrics.jsonl``) add the payload bytes that crossed the
wire in the round and the control overhead as a running total over the whole run; a
resumed run goes on from the records before the resume, without processes here."""

from __future__ import annotations

import pytest

from splitfed.runtime.placement import host_ranks
from splitfed.runtime.session import _WireLogger
from splitfed.transport.distributed import DistributedTransport, Links
from splitfed.transport.ledger import Ledger

pytestmark = pytest.mark.usefixtures("links_without_threads")


def _round(t: int, up: int, down: int, overhead: int) -> dict:
    return {"round": t, "train_loss": 1.0, "wire_up": up, "wire_down": down,
            "wire_up/model": up, "wire_down/model": down, "overhead_bytes": overhead}


def test_a_resumed_runs_records_go_on_from_the_overhead_and_wire_bytes_before_it(tmp_path):
    """Rounds 1 and 2 were recorded before the resume (overhead 500, then 900 in all);
    the resumed process sent 250 bytes of control messages and, in round 3, 40 + 12
    bytes up and 30 down: round 3's record has its own wire bytes, the overhead 900 +
    250, and the lost ranks; the run's totals add the earlier rounds' wire bytes."""
    links = Links(0, 3, timeout_s=5.0)
    transport = DistributedTransport(Ledger(6), links, host_ranks(6, 3))
    before = [{"round": 0, "test_acc": 0.1}, _round(1, 40, 30, 500), _round(2, 40, 30, 900)]
    logger = _WireLogger(tmp_path, transport, before)
    try:
        transport.wire[(3, "model", "up")] += 40
        transport.wire[(3, "activations", "up")] += 12
        transport.wire[(3, "model", "down")] += 30
        links.overhead_bytes = 250
        links.lost[2] = "gone"
        logger.log({"round": 3, "train_loss": 0.5})
    finally:
        logger.close()
    got = logger.records[-1]
    assert {k: v for k, v in got.items() if k.startswith("wire_")} == {
        "wire_up": 52, "wire_down": 30, "wire_up/model": 40, "wire_up/activations": 12,
        "wire_down/model": 30}
    assert got["overhead_bytes"] == 900 + 250
    assert got["lost_ranks"] == [2]
    assert logger.wire_totals() == {"wire_up": 40 + 40 + 52, "wire_down": 3 * 30,
                                    "wire_up/model": 3 * 40, "wire_down/model": 3 * 30,
                                    "wire_up/activations": 12}


def test_a_fresh_runs_records_count_from_zero(tmp_path):
    """No records before: round 1's overhead is this process's, and the initial
    evaluation (round 0) has no wire fields."""
    links = Links(0, 2, timeout_s=5.0)
    transport = DistributedTransport(Ledger(2), links, host_ranks(2, 2))
    logger = _WireLogger(tmp_path, transport, [])
    try:
        logger.log({"round": 0, "test_acc": 0.1})
        transport.wire[(1, "model", "down")] += 8
        links.overhead_bytes = 70
        logger.log({"round": 1, "train_loss": 0.5})
    finally:
        logger.close()
    assert logger.records[0] == {"round": 0, "test_acc": 0.1}
    assert logger.records[1]["overhead_bytes"] == 70
    assert logger.records[1]["wire_down"] == 8 and logger.records[1]["wire_up"] == 0
    assert logger.wire_totals() == {"wire_up": 0, "wire_down": 8, "wire_down/model": 8}
