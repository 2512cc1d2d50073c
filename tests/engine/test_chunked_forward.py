"""Zeroth-order copies (MU-SplitFed's ``ForwardCopies``) evaluate a large cohort in
several calls (``cohort_forward_chunked``): the values of one call bit for bit, running
statistics included; a template that draws random numbers stays in one call; whole
MU-SplitFed runs are unchanged."""

import pytest
import torch
from torch import nn

from splitfed.config import build_config
from splitfed.engine import stacked
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.models import build_model, cohort, split
from splitfed.models.cohort import (MIN_CLIENTS_PER_CALL, balanced_chunks, cohort_forward,
                                    cohort_forward_chunked)
from tests.helpers import assert_same_run, bn_mlp, register_images


@pytest.mark.parametrize("n,chunk", [(1, 1), (2, 1), (15, 1), (16, 1), (17, 3), (100, 17),
                                     (100, 10), (7, 100), (33, 16), (40, 8), (41, 8)])
def test_balanced_chunks_cover_the_cohort_evenly_with_eight_clients_or_more(n, chunk):
    bounds = balanced_chunks(n, chunk)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert len(bounds) == max(1, min(-(-n // chunk), n // MIN_CLIENTS_PER_CALL))
    assert len(bounds) == 1 or min(sizes) >= MIN_CLIENTS_PER_CALL


def _stacked(part, n, g):
    return {k: (v.detach().unsqueeze(0).expand(n, *v.shape)
                + 0.01 * torch.randn(n, *v.shape, generator=g))
            if v.is_floating_point() else v.unsqueeze(0).expand(n, *v.shape).clone()
            for k, v in part.state_dict().items()}


@pytest.mark.parametrize("name,options,shape", [
    ("lenet5", {}, (1, 28, 28)), ("alexnet", {"width": 0.0625}, (1, 28, 28)),
    ("resnet18", {"width": 4}, (3, 32, 32))])
@pytest.mark.parametrize("training", [True, False])
def test_chunked_calls_give_the_values_of_one_call(name, options, shape, training):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    client, _ = split(build_model(name, shape, 10, **options), 2)
    n = 25
    x = torch.randn(n, 3, *shape, generator=g)
    state = _stacked(client, n, g)
    one = {k: v.clone() for k, v in state.items()}
    want = cohort_forward(client, one, x, training=training)
    for chunk in (8, 12, 13):                 # calls of 9, 8, 8 / 13, 12
        got_state = {k: v.clone() for k, v in state.items()}
        got = cohort_forward_chunked(client, got_state, x, training=training, chunk=chunk)
        assert torch.equal(got, want), chunk
        for k in one:                        # BatchNorm's running statistics and counter
            assert torch.equal(got_state[k], one[k]), (chunk, k)


def test_a_template_with_dropout_stays_in_one_call_in_training():
    torch.manual_seed(0)
    template = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Dropout(0.5), nn.Flatten(),
                             nn.Linear(12, 3))
    g = torch.Generator().manual_seed(2)
    n = 16
    x = torch.randn(n, 4, 2, 4, 4, generator=g)
    state = _stacked(template, n, g)
    torch.manual_seed(7)
    want = cohort_forward(template, state, x, training=True)
    torch.manual_seed(7)
    got = cohort_forward_chunked(template, state, x, training=True, chunk=8)
    assert torch.equal(got, want)
    # in evaluation dropout draws nothing: chunked, with the values of one call
    assert torch.equal(cohort_forward_chunked(template, state, x, training=False, chunk=8),
                       cohort_forward(template, state, x, training=False))


@torch.no_grad()
def test_default_copies_per_call_on_a_cpu():
    copies = stacked.ForwardCopies.__new__(stacked.ForwardCopies)
    copies.chunk_size = None
    for (n, b), want in {(100, 32): 17, (50, 10): 50, (100, 10): 50, (10, 10): 10,
                         (200, 10): 50, (3, 1000): 1}.items():
        assert copies._chunk(torch.empty(n, b, 0)) == want, (n, b)
    copies.chunk_size = 4
    assert copies._chunk(torch.empty(100, 32, 0)) == 4


def test_a_pass_under_autograd_stays_in_one_call(monkeypatch):
    torch.manual_seed(0)
    client, _ = split(build_model("lenet5", (1, 28, 28), 10), 2)
    g = torch.Generator().manual_seed(3)
    state = _stacked(client, 16, g)
    x = torch.randn(16, 2, 1, 28, 28, generator=g)
    sizes = []
    real = cohort.cohort_forward

    def counting(module, state, x, *, training):
        sizes.append(x.shape[0])
        return real(module, state, x, training=training)
    monkeypatch.setattr(cohort, "cohort_forward", counting)
    with torch.no_grad():
        cohort_forward_chunked(client, state, x, training=True, chunk=8)
    assert sizes == [8, 8]
    sizes.clear()
    params = {k: v.requires_grad_(True) if v.is_floating_point() else v
              for k, v in state.items()}
    out = cohort_forward_chunked(client, params, x, training=True, chunk=8)
    assert sizes == [16] and out.requires_grad


NAME = "chunked_forward_images"


@pytest.fixture
def images(monkeypatch):
    register_images(monkeypatch, NAME)


def _mu(data, model, **algorithm):
    return build_config({
        "name": "t", "rounds": 2, "progress": False, "seed": 5,
        "algorithm": {"name": "musplitfed", **algorithm}, "data": {"name": data},
        "partition": {"scheme": "iid", "num_clients": 16}, "model": model,
        "train": {"batch_size": 6, "lr": 0.05}, "participation": {"mode": "full"},
        "engine": {"chunk_size": 8}})


@pytest.mark.parametrize("algorithm", [{}, {"directions": 2, "tau": 3},
                                       {"client_order": "first"}])
def test_musplitfed_runs_are_the_runs_of_one_call(monkeypatch, images, algorithm):
    cfg = _mu(NAME, {"name": "lenet5", "cut": 2}, **algorithm)
    sizes = []
    with monkeypatch.context() as m:
        def counting(module, state, x, *, training):
            sizes.append(x.shape[0])
            return real(module, state, x, training=training)
        real = cohort.cohort_forward
        m.setattr(cohort, "cohort_forward", counting)
        chunked = run_experiment(cfg, write=False)
    assert sizes.count(8) >= 2                    # 16 copies in calls of 8
    # the first-order ablation's client pass builds a graph: one call of 16
    assert (16 in sizes) == (algorithm.get("client_order") == "first")
    with monkeypatch.context() as m:
        m.setattr(stacked.ForwardCopies, "_chunk", lambda self, x: None)
        one = run_experiment(cfg, write=False)
    assert_same_run(chunked, one)


def test_musplitfed_with_batchnorm_is_the_run_of_one_call(monkeypatch):
    def two_rounds():
        cfg = _mu("digits", {"name": "mlp", "hidden": [16]})
        env, algo = build_environment(cfg), build_algorithm(cfg)
        env.model = bn_mlp()
        state = algo.init_state(env)
        for t in (1, 2):
            cohort = env.sampler.sample(env.streams.numpy("participation"))
            state = algo.round(env, state, t, cohort).state
        return state["model"]

    chunked = two_rounds()
    with monkeypatch.context() as m:
        m.setattr(stacked.ForwardCopies, "_chunk", lambda self, x: None)
        one = two_rounds()
    assert any("running_mean" in k for k in one)
    for k, v in one.items():
        assert torch.equal(chunked[k], v), k
