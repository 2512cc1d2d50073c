"""What rank 0 does with the clients of a client rank it lost, checked in one process.

Rank 0's links are stood in for by :class:`_Links`: a transfer with a live rank arrives
(a received tensor holds the sending rank's number), one with a lost rank fails, as
:meth:`Links.exchange` reports it. With 6 clients on 3 processes rank 1 hosts clients
0-2 and rank 2 clients 3-5 (:func:`host_ranks`).

Checked: the lost rank's clients leave the cohort (the others' weights renormalised as
the clock renormalises, not under bernoulli), are not on time in the round they were
lost in and are counted as dropped, rank 0 runs no server step for them, their rows of an
upload keep rank 0's own values, and the wire counts only the bytes that crossed; and
the status of a run that ends with every client rank lost.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import digits_config
from splitfed.engine.participation import Cohort
from splitfed.experiment import build_environment
from splitfed.runtime.placement import RankPlacement, host_ranks
from splitfed.runtime.session import _clients_status, adapt
from splitfed.transport.distributed import Links

pytestmark = pytest.mark.usefixtures("links_without_threads")

HOSTS = host_ranks(6, 3)            # [1, 1, 1, 2, 2, 2]


class _Links(Links):
    """Rank 0's links without processes: ranks in ``lost`` were lost before, ranks in
    ``failing`` fail in the next transfer (and are lost then); the others answer, each
    received tensor filled with the sending rank's number. ``sent``: (peer, tensor) of
    every tensor that went out."""

    def __init__(self, world_size: int = 3, lost=(), failing=()):
        super().__init__(0, world_size, timeout_s=1.0)
        self.lost.update({int(r): "gone before" for r in lost})
        self.failing = set(failing)
        self.sent: list[tuple[int, torch.Tensor]] = []

    def exchange(self, sends=(), recvs=(), *, tag: int = 0) -> set[int]:
        failed = set()
        for pairs, receive in ((sends, False), (recvs, True)):
            for peer, t in pairs:
                if not self.alive(peer) or peer in self.failing:
                    failed.add(peer)
                elif receive:
                    t.fill_(peer)
                else:
                    self.sent.append((peer, t.clone()))
        for peer in failed:
            self.lose(peer, "failed now")
        return failed


def _env(**over):
    return build_environment(digits_config(partition__num_clients=6, **over))


def test_a_lost_ranks_clients_leave_the_cohort_and_the_others_are_renormalised():
    """Cohort [0, 4, 1, 2] with weights [.1, .2, .3, .4], rank 2 (clients 3-5) lost:
    clients 0, 1 and 2 remain, with .1, .3 and .4 over their sum .8 (uniform
    participation), or as they were (bernoulli: its weights are not renormalised); the
    one client left out is counted."""
    cohort = Cohort(np.array([0, 4, 1, 2]), np.array([0.1, 0.2, 0.3, 0.4]))
    for over, want in [({"participation": {"mode": "uniform", "clients_per_round": 4}},
                        [0.125, 0.375, 0.5]),
                       ({"participation": {"mode": "bernoulli", "q": 0.5}},
                        [0.1, 0.3, 0.4])]:
        env = _env(**over)
        control = adapt(env, _Links(lost=[2]), None)
        kept, left_out = control._without_lost(cohort)
        assert kept.ids.tolist() == [0, 1, 2] and left_out == 1
        np.testing.assert_allclose(kept.weights, want, rtol=1e-15)
        same, none = control._without_lost(Cohort(np.array([0, 2]), np.array([0.5, 0.5])))
        assert same.ids.tolist() == [0, 2] and same.weights.tolist() == [0.5, 0.5]
        assert none == 0


def test_a_round_tells_the_live_ranks_a_cohort_without_the_lost_ranks_clients():
    """Full participation of 6 clients with rank 2 lost: the cohort sampled, and sent to
    rank 1 (the only live rank), is clients 0-2 with weights 1/3 each, and the next round
    counts rank 2's 3 clients as dropped."""
    env = _env(participation={"mode": "full"})
    links = _Links(lost=[2])
    control = adapt(env, links, None)
    cohort = control.sample(np.random.default_rng(0))
    assert cohort.ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(cohort.weights, [1 / 3] * 3, rtol=1e-15)
    assert {peer for peer, _ in links.sent} == {1}
    clock = env.clock
    assert clock.lost_in_cohort == 3
    clock.begin_round(cohort)
    assert clock.end_round()["dropped"] == 3
    assert clock.clients_trained == 3


@pytest.mark.parametrize("check", ["on_time", "can_start"])
def test_the_clients_of_a_rank_lost_mid_round_are_not_aggregated_and_count_as_dropped(
        check):
    """Cohort [0, 1, 3, 4] begun with both ranks live; rank 2 is then lost: its clients
    3 and 4 are neither on time (left out of the aggregation) nor may they start a turn,
    the round counts them as dropped, and 2 clients trained in it."""
    env = _env(participation={"mode": "uniform", "clients_per_round": 4})
    links = _Links()
    adapt(env, links, None)
    clock = env.clock
    ids = np.array([0, 1, 3, 4])
    clock.begin_round(Cohort(ids, np.full(4, 0.25)))
    assert getattr(clock, check)(ids).tolist() == [True, True, True, True]
    links.lose(2, "connection closed")
    assert getattr(clock, check)(ids).tolist() == [True, True, False, False]
    assert clock.end_round()["dropped"] == 2
    assert clock.clients_trained == 2


def test_rank_0_runs_no_server_step_for_a_lost_ranks_client():
    links = _Links(lost=[2])
    place = RankPlacement(links, HOSTS)
    assert [place.serves(c) for c in range(6)] == [True] * 3 + [False] * 3
    client_side = RankPlacement(_Links(), HOSTS)
    client_side.rank = 1                   # a client rank runs no server step at all
    assert not any(client_side.serves(c) for c in range(6))


def test_an_upload_from_a_rank_that_fails_keeps_rank_0s_rows_and_counts_no_bytes():
    """Rows of clients [0, 3, 1, 4] (float32, 2 values each) gathered while rank 2
    fails: the rows of rank 1's clients 0 and 1 hold what arrived, those of rank 2's
    clients keep rank 0's own values, and only rank 1's 2 rows of 8 bytes crossed."""
    links = _Links(failing=[2])
    mine = torch.full((4, 2), -7.0)
    (out,), nbytes = links.gather_rows(HOSTS[[0, 3, 1, 4]], [mine])
    assert out[:, 0].tolist() == [1.0, -7.0, 1.0, -7.0]
    assert nbytes == 2 * 2 * 4
    assert mine.eq(-7.0).all()                             # the payload is not changed
    assert links.lost.keys() == {2}


def test_a_download_and_a_broadcast_count_only_the_bytes_to_live_ranks():
    """Per-client rows [0, 3, 1, 4] (4 float64 each) sent while rank 2 fails: 2 rows of
    32 bytes reached rank 1; then a broadcast of 3 float32 to clients [0, 1, 2, 3] with
    rank 2 lost: one 12-byte copy to each of rank 1's 3 clients."""
    links = _Links(failing=[2])
    rows = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    _, nbytes = links.scatter_rows(HOSTS[[0, 3, 1, 4]], [rows])
    assert nbytes == 2 * 4 * 8
    _, nbytes = links.broadcast(HOSTS[[0, 1, 2, 3]], [torch.zeros(3)])
    assert nbytes == 3 * 3 * 4
    # rank 1 got one message of its 2 rows, then one copy per client it hosts
    assert [tuple(t.shape) for peer, t in links.sent if peer == 1] == [(2, 4)] + [(3,)] * 3


def test_training_losses_gathered_from_the_client_ranks_are_overhead_not_payload():
    """The losses rank 0 gathers (``collect``: metrics) count in the overhead bytes: 4
    float32 values from live ranks, 16 bytes; none from the lost rank's 2 clients."""
    links = _Links(lost=[2])
    place = RankPlacement(links, HOSTS)
    before = links.overhead_bytes
    out = place.collect(np.array([0, 1, 2, 3, 4, 0]), torch.zeros(6))
    assert out.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert links.overhead_bytes - before == 4 * 4


class _Clock:
    def __init__(self, clients_trained: int):
        self.clients_trained = clients_trained


@pytest.mark.parametrize("status, lost, trained, resumed, want", [
    ("completed", [2], 0, [], "completed"),               # a client rank is still live
    ("completed", [1, 2], 5, [], "clients_lost"),
    ("completed", [1, 2], 0, [], "no_client_trained"),
    # no client trained since the resume, but the rounds before it trained some
    ("completed", [1, 2], 0, [3], "clients_lost"),
    ("diverged", [1, 2], 0, [], "diverged"),
])
def test_the_status_of_a_run_that_lost_its_client_ranks(status, lost, trained, resumed,
                                                        want):
    assert _clients_status(status, _Links(lost=lost), _Clock(trained), resumed) == want


class _Work:
    """A posted gloo operation whose wait ends at once, or raises ``error``."""

    def __init__(self, error=None):
        self.error = error

    def wait(self, timeout=None):
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture
def gloo(monkeypatch):
    """Point-to-point operations without a process group: every post is recorded as
    (op, peer); a receive gets the frame of ``gloo.incoming[peer]``; a peer in
    ``gloo.broken`` fails with a connection error gloo's way (its wait raises)."""
    from splitfed.transport import distributed as D

    class Gloo:
        posts: list = []
        incoming: dict = {}
        broken: set = set()

    def post(op):
        def run(frame, peer, tag=0):
            Gloo.posts.append((op, peer))
            if peer in Gloo.broken:
                return _Work(RuntimeError(
                    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection "
                    f"closed by peer [127.0.0.1]:{5000 + peer}"))
            if op == "recv":
                frame.copy_(D._frame(Gloo.incoming[peer]))
            return _Work()
        return run

    monkeypatch.setattr(D.dist, "isend", post("send"))
    monkeypatch.setattr(D.dist, "irecv", post("recv"))
    return Gloo


def test_rank_0_never_posts_a_transfer_to_a_lost_rank(gloo):
    """Rank 2 was lost: a transfer with it fails at once, without posting anything
    (no wait for a rank that will not answer), while rank 1's arrives."""
    links = Links(0, 3, timeout_s=5.0)
    links.lost[2] = "gone before"
    gloo.incoming[1] = torch.tensor([1.5, 2.5])
    got, other = torch.zeros(2), torch.full((2,), 9.0)
    failed = links.exchange(sends=[(1, torch.ones(3)), (2, torch.ones(3))],
                            recvs=[(1, got), (2, other)])
    assert failed == {2}
    assert sorted(gloo.posts) == [("recv", 1), ("send", 1)]
    assert got.tolist() == [1.5, 2.5] and other.tolist() == [9.0, 9.0]


def test_a_send_whose_connection_closes_loses_the_rank_with_glooss_reason(gloo):
    """A send to rank 2 fails while its wait runs (the peer's connection closed): rank 2
    is reported failed and lost, with gloo's error as the reason, and is skipped in
    later transfers; rank 1's send went through."""
    links = Links(0, 3, timeout_s=5.0)
    gloo.broken.add(2)
    assert links.exchange(sends=[(1, torch.ones(3)), (2, torch.ones(3))]) == {2}
    assert links.lost == {2: "Connection closed by peer [127.0.0.1]:5002"}
    gloo.posts.clear()
    assert links.exchange(sends=[(1, torch.ones(3)), (2, torch.ones(3))]) == {2}
    assert gloo.posts == [("send", 1)]


def test_a_client_rank_takes_the_lost_ranks_and_the_clock_from_rank_0s_round_message():
    """Rank 1 of 3 with 6 clients under full participation: rank 0's message says rank
    2 is lost; rank 1 draws the same cohort without rank 2's clients (clients 0-2, 1/3
    each), learns that rank 2 is lost, counts its 3 clients as left out, and takes rank
    0's clock."""
    env = _env(participation={"mode": "full"})
    links = Links(1, 3, timeout_s=5.0)
    control = adapt(env, links, None)
    links._taken.append({"round": env.ledger.round, "ids": [0, 1, 2],
                         "lost": {2: "gone"}, "now": 12.5})
    cohort = control.sample(np.random.default_rng(0))
    assert cohort.ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(cohort.weights, [1 / 3] * 3, rtol=1e-15)
    assert links.lost == {2: "gone"} and links.live_clients() == [1]
    assert env.clock.lost_in_cohort == 3 and env.clock.now == 12.5


def test_a_control_messages_bytes_count_as_overhead(gloo):
    """A control message to each of 2 client ranks goes as its length (8 bytes) and its
    body (the message and its 32-byte HMAC): each counts 8 + body bytes of overhead, none
    of it payload; a message to a lost rank counts nothing."""
    from splitfed import safeio

    links = Links(0, 4, timeout_s=5.0, secret="s3cr3t-0123456789-abcdefghij-KLMNOPQRST")
    links.lost[3] = "gone before"
    msg = {"round": 1, "ids": [0, 1], "lost": {3: "gone before"}, "now": 0.5}
    body = len(safeio.dumps(msg)) + 32
    assert links.send_all(msg) == set()
    assert links.overhead_bytes == 2 * (8 + body)
    assert sorted(gloo.posts) == [("send", 1)] * 2 + [("send", 2)] * 2
