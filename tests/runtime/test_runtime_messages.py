"""What a client rank sends rank 0, and rank 0's control messages, are checked before
they are used: a tensor message of another length than expected is a failed transfer
(gloo fills a posted buffer from a shorter message without a word), and a control
message whose fields are not what splitfed sends is one error, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from splitfed.errors import FormatError
from splitfed.runtime.placement import ROUND_FIELDS, StopRun, control_message
from splitfed.transport.distributed import (_TAG, _TRAILER, MAX_MESSAGE, Links, _frame,
                                           _nbytes, _unframe)

LIMIT_S = 240


def _received(sent: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The buffer a receiver of ``expected`` holds once ``sent``'s frame arrived, as
    gloo fills it: the message's bytes at its start, the rest as posted (zeros)."""
    frame = _frame(sent)
    buf = torch.zeros(_nbytes(expected) + _TRAILER, dtype=torch.uint8)
    n = min(frame.numel(), buf.numel())
    buf[:n] = frame[:n]
    return buf


@pytest.mark.parametrize("tensor", [torch.randn(3, 4), torch.randn(2, 3).bfloat16(),
                                    torch.tensor([True, False, True]), torch.arange(5),
                                    torch.tensor(2.5, dtype=torch.float64)])
def test_a_tensor_arrives_whole(tensor):
    out = torch.empty_like(tensor)
    assert _unframe(_received(tensor, out), out) is None
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("sent", [torch.ones(6), torch.ones(2, 4, dtype=torch.float16),
                                  torch.ones(1)])
def test_a_shorter_message_is_refused_and_leaves_the_tensor(sent):
    out = torch.full((2, 4), 7.0)
    assert _unframe(_received(sent, out), out) == (
        "it sent a message of another size than the 32 bytes expected")
    assert torch.equal(out, torch.full((2, 4), 7.0))


def test_a_message_of_the_right_length_with_a_wrong_count_is_refused():
    out = torch.zeros(4)
    buf = _received(torch.ones(4), out)
    buf[-_TRAILER:] = 0
    assert _unframe(buf, out) is not None


GOOD = {"round": 3, "ids": [1, 4], "lost": {2: "gone"}, "now": 1.5}


@pytest.mark.parametrize("msg, what", [
    ([1, 2], "not a mapping"), ({}, "'round' is not a whole number"),
    ({**GOOD, "round": "3"}, "'round' is not a whole number"),
    ({**GOOD, "ids": [1, "x"]}, "'ids' is not a list of client ids"),
    ({**GOOD, "lost": [2]}, "'lost' is not a mapping of ranks to reasons"),
    ({**GOOD, "lost": {2: 5}}, "'lost' is not a mapping of ranks to reasons"),
    ({**GOOD, "now": float("nan")}, "'now' is not a finite number"),
    ({**GOOD, "now": "1"}, "'now' is not a finite number"),
    ({"stop": {"a": 1}}, "a stop message without a reason"),
])
def test_a_control_message_of_other_fields_is_one_error(msg, what):
    with pytest.raises(FormatError, match=what):
        control_message(msg, ROUND_FIELDS)


def test_a_control_message_that_fits_or_stops():
    assert control_message(GOOD, ROUND_FIELDS) is GOOD
    with pytest.raises(StopRun, match="^diverged$"):
        control_message({"stop": "diverged"}, ROUND_FIELDS)


SHORT = '''"""Rank 1 sends every tensor cut to half its length."""
import os
import torch
from splitfed.transport import distributed as D

if os.environ.get("RANK") == "1":
    exchange = D.Links.exchange

    def short(self, sends=(), recvs=(), **kw):
        if kw.get("tag", 0) == 0:                       # tensors, not control messages
            sends = [(p, t.reshape(-1)[: max(1, t.numel() // 2)].clone()) for p, t in sends]
        return exchange(self, sends, recvs, **kw)

    D.Links.exchange = short
'''


def test_a_rank_that_sends_short_tensors_is_dropped_naming_it(tmp_path):
    (tmp_path / "short_plugin.py").write_text(SHORT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "splitfed", "launch", "quick_digits", "--nproc", "3",
         "rounds=2", "progress=false", "--launcher", "spawn", "--plugin", "short_plugin",
         "--timeout", "30", "--client-timeout", "60", "--run-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "splitfed: rank 1 lost (it sent a message of another size than the " in proc.stderr
    assert "Traceback" not in proc.stderr
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"status": "completed"' in summary and '"1":' in summary    # rank 1 lost


@pytest.mark.parametrize("raw, shown", [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
     "[127.0.0.1]:23436: Connection reset by peer",
     "Read error [127.0.0.1]:23436: Connection reset by peer"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting\n"
     "1000ms for recv operation to complete",
     "Timed out waiting 1000ms for recv operation to complete"),
    ("Connection closed by peer [127.0.0.1]:5000", "Connection closed by peer [127.0.0.1]:5000")])
def test_a_lost_links_reason_is_gloos_text_without_its_source_place(raw, shown):
    """What a lost rank's line and the summary's lost_ranks say of a failed transfer: the
    error, not the place in gloo's sources it was raised at."""
    from splitfed.transport.distributed import link_error

    assert link_error(RuntimeError(raw)) == shown


@pytest.mark.parametrize("announced", [MAX_MESSAGE + 1, 1 << 40, 0, -5, _TAG])
def test_a_control_message_of_an_impossible_length_is_refused_before_it_is_read(announced):
    """A client rank reads a control message's length first; a length above the limit
    (or none, or too short to hold the HMAC) is refused before a buffer is made or a byte
    of the body is waited for."""
    links = Links(1, 2, 5.0, secret="s3cr3t-0123456789-abcdefghij-KLMNOPQRST")
    arrived = threading.Event()
    arrived.set()
    head = _frame(torch.tensor([announced], dtype=torch.int64))
    links._head = (0, head, arrived, [])         # the length message has come in
    with pytest.raises(FormatError, match=f"announces {announced} bytes; refused"):
        links._receive_control(0)
