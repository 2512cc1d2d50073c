"""Server steps that read each client's upload (``needs_uploads``; docs/extending.md):
the accumulator keeps a copy of every aggregated upload, with the weights the aggregate
gave it, so that a robust rule (the example plugin's coordinate-wise trimmed mean) can
replace the weighted average on every algorithm that runs server steps."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from splitfed import register_transform
from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.transforms import ServerStep
from splitfed.experiment import run_experiment
from tests.helpers import digits_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin_example"


def rebuilt(uploads, reference):
    """reference + sum_i w_i (x_i - reference), in float64."""
    return {k: ref.to(torch.float64) + torch.tensordot(
        uploads.weights, uploads.values[k].to(torch.float64) - ref.to(torch.float64), dims=1)
        for k, ref in reference.items() if ref.is_floating_point()}


@pytest.mark.parametrize("renormalise", [False, True])
def test_kept_uploads_rebuild_the_aggregate(renormalise):
    """Two chunks, one client of each dropped: the kept uploads, their ids and weights
    (renormalised over the kept clients when asked) give back result(1.0)."""
    gen = torch.Generator().manual_seed(0)
    ref = {"w": torch.randn(3, 2, generator=gen), "n": torch.tensor(4)}
    acc = DeltaAccumulator(ref, renormalise=renormalise, keep_uploads=True)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    x = {"w": torch.randn(4, 3, 2, generator=gen), "n": torch.tensor([5, 7, 6, 2])}
    acc.add(w[:2], {k: v[:2] for k, v in x.items()}, keep=np.array([True, False]),
            ids=np.array([10, 11]))
    acc.add(w[2:], {k: v[2:] for k, v in x.items()}, keep=np.array([False, True]),
            ids=np.array([12, 13]))
    up = acc.uploads()
    assert len(up) == 2 and up.ids.tolist() == [10, 13]
    assert torch.equal(up.values["w"], x["w"][[0, 3]])
    assert torch.equal(up.values["n"], torch.tensor([5, 2]))
    scale = 1.0 / 0.5 if renormalise else 1.0
    # float64 weights, renormalised by one division: a few eps64 (2.2e-16) apart
    assert torch.allclose(up.weights, torch.tensor([0.1, 0.4], dtype=torch.float64) * scale,
                          rtol=1e-15, atol=0)
    result = acc.result(1.0)
    back = rebuilt(up, ref)["w"]
    assert (back.to(torch.float32) - result["w"]).abs().max() <= (
        torch.finfo(torch.float32).eps * result["w"].abs().max())
    # a copy: changing what was added later changes nothing kept
    x["w"].zero_()
    assert torch.equal(acc.uploads().values["w"], up.values["w"])


def test_uploads_are_kept_only_when_asked():
    acc = DeltaAccumulator({"w": torch.zeros(2)})
    acc.add(torch.ones(1, dtype=torch.float64), {"w": torch.ones(1, 2)})
    with pytest.raises(RuntimeError, match="needs_uploads = True"):
        acc.uploads()


def test_nothing_kept_and_subnormal_weights():
    """No upload arrived: empty tensors of the right shape; kept weights so small that
    offered / kept overflows: the weights stay finite, as the aggregate does."""
    acc = DeltaAccumulator({"w": torch.zeros(2, 3)}, renormalise=True, keep_uploads=True)
    acc.add(torch.tensor([0.5], dtype=torch.float64), {"w": torch.ones(1, 2, 3)},
            keep=np.array([False]))
    up = acc.uploads()
    assert len(up) == 0 and up.values["w"].shape == (0, 2, 3) and len(up.ids) == 0
    acc = DeltaAccumulator({"w": torch.zeros(2)}, renormalise=True, keep_uploads=True)
    acc.add(torch.tensor([1.0, 1e-310], dtype=torch.float64), {"w": torch.ones(2, 2)},
            keep=np.array([False, True]))
    up = acc.uploads()
    assert torch.isfinite(up.weights).all() and math.isclose(float(up.weights[0]), 1.0)
    assert torch.equal(acc.result(1.0)["w"], torch.ones(2))


SEEN: list[dict] = []


@dataclass
class _NoOptions:
    pass


class CheckUploads(ServerStep):
    """A test step: the plain aggregate, after checking that the uploads rebuild it."""

    name = "check_uploads_test"
    reference = "test"
    Options = _NoOptions
    needs_uploads = True

    def update(self, ctx, model):
        new = ctx.aggregate.result(1.0)
        up = ctx.aggregate.uploads()
        back = rebuilt(up, ctx.aggregate.reference)
        worst = max(float((back[k].to(new[k].dtype) - new[k]).abs().max() /
                          max(float(new[k].abs().max()), 1e-30)) for k in back)
        SEEN.append({"t": ctx.t, "n": len(up), "worst": worst,
                     "ids": None if up.ids is None else up.ids.tolist(),
                     "names": sorted(up.values)})
        return new


@pytest.fixture
def check_step(scratch):
    register_transform("check_uploads_test")(CheckUploads)
    SEEN.clear()
    yield SEEN


@pytest.mark.parametrize("algorithm", ["fedavg", "sflv1", "sflv2", "sl", "csefsl"])
def test_every_algorithm_family_hands_its_uploads_to_the_step(check_step, algorithm):
    """The uploads of the clients that arrived by the deadline, and only those, rebuild the
    round's aggregate (to float32 rounding), on FL, the SFL variants and SL."""

    def config(steps, **clock):
        return digits_config(algorithm={"name": algorithm, "server_transforms": steps},
                             model={"name": "mlp", "hidden": [16], "cut": 1},
                             partition={"scheme": "dirichlet", "alpha": 0.5, "num_clients": 6},
                             clock={"profile": "fixed", "uplink": [1e7, 1e3] * 3, **clock},
                             rounds=3)

    # every second client uploads a thousand times slower: a deadline of half the
    # natural round drops those (SL: the turns after it)
    natural = run_experiment(config([]), write=False).records[1]["sim_time_s"]
    cfg = config([{"name": "check_uploads_test"}], deadline=0.5 * natural)
    result = run_experiment(cfg, write=False)
    assert result.status == "completed"
    rows = [r for r in result.records if r["round"] > 0]
    assert [s["t"] for s in check_step] == [r["round"] for r in rows]
    eps = torch.finfo(torch.float32).eps
    whole = sorted(result.state["model"])
    for seen, row in zip(check_step, rows):
        # the trained part: the whole model, SFL-V1's server copies included; the
        # client side where the server keeps one model
        if algorithm in ("sflv2", "csefsl"):
            assert set(seen["names"]) < set(whole)
        else:
            assert seen["names"] == whole
        assert seen["worst"] <= 4 * eps
        if algorithm == "sl":
            assert seen["n"] == 1          # SL: the last client's hand-over
        else:
            assert seen["n"] == row["participants"] - row["dropped"]
            assert len(seen["ids"]) == seen["n"]
    assert all(r["dropped"] > 0 for r in rows)


@pytest.fixture
def trimmed(scratch, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for mod in [m for m in sys.modules if m.split(".")[0] == "splitfed_lab"]:
        monkeypatch.delitem(sys.modules, mod)
    import splitfed_lab.robust

    yield splitfed_lab.robust
    for mod in [m for m in sys.modules if m.split(".")[0] == "splitfed_lab"]:
        del sys.modules[mod]


class _Ctx:
    def __init__(self, acc):
        self.aggregate, self.metrics = acc, {}


def test_trimmed_mean_by_hand(trimmed):
    """Five uploads, beta 0.2: per coordinate the largest and the smallest value go, the
    middle three are averaged, whatever the weights; the integer buffer is aggregated."""
    ref = {"w": torch.zeros(2), "n": torch.tensor(0)}
    acc = DeltaAccumulator(ref, keep_uploads=True)
    acc.add(torch.tensor([0.9, 0.025, 0.025, 0.025, 0.025], dtype=torch.float64),
            {"w": torch.tensor([[100.0, 10.0], [1.0, 20.0], [2.0, -50.0], [3.0, 30.0],
                                [-7.0, 40.0]]), "n": torch.tensor([1, 2, 3, 4, 5])})
    step = trimmed.TrimmedMean(trimmed.TrimmedMeanOptions(beta=0.2))
    ctx = _Ctx(acc)
    out = step.update(ctx, dict(ref))
    assert torch.equal(out["w"], torch.tensor([2.0, 20.0]))
    assert int(out["n"]) == 5 and ctx.metrics == {"trimmed": 2.0}
    step = trimmed.TrimmedMean(trimmed.TrimmedMeanOptions(beta=0.19))   # floor(0.95) = 0
    assert torch.allclose(step.update(_Ctx(acc), dict(ref))["w"],
                          torch.tensor([99.0 / 5, 50.0 / 5]))


def test_trimmed_mean_with_beta_0_is_fedavg_with_equal_weights(trimmed):
    """beta 0 under uniform weighting: the unweighted mean of the uploads, FedAvg's
    aggregate; one round, so the two models differ by float32 rounding of float64 sums
    only (at most one unit in the last place)."""
    base = dict(partition={"scheme": "dirichlet", "alpha": 0.3, "num_clients": 5},
                participation={"mode": "full", "weighting": "uniform"}, rounds=1)
    plain = run_experiment(digits_config(**base), write=False)
    robust = run_experiment(digits_config(
        algorithm={"name": "fedavg", "server_transforms": [
            {"name": "trimmed_mean", "beta": 0.0}]}, **base), write=False)
    for k, v in plain.state["model"].items():
        got = robust.state["model"][k]
        assert (got - v).abs().max() <= torch.finfo(torch.float32).eps * v.abs().max(), k
    assert robust.records[-1]["trimmed"] == 0.0
    # beta 0.2 of 5 uploads trims one at each end: another model
    cut = run_experiment(digits_config(
        algorithm={"name": "fedavg", "server_transforms": [
            {"name": "trimmed_mean", "beta": 0.2}]}, **base), write=False)
    assert cut.records[-1]["trimmed"] == 2.0
    assert not any(torch.allclose(cut.state["model"][k], v)
                   for k, v in plain.state["model"].items())
