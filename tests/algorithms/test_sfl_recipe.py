"""SFL-V1 and SFL-V2 with ``algorithm.recipe: released_code`` (paper 002's released code:
client optimizers live for the round, the server-side optimizer is re-created every
batch, SFL-V2 serves each client's iterations in turn) against a plain transcription of
that recipe, and the default recipe unchanged.

The transcription is written the way the released code trains: one
``torch.optim.SGD(momentum, weight_decay)`` per client per round over plain torch
modules, a fresh ``torch.optim.SGD`` with the same settings for every server-side batch,
and for SFL-V2 one client after another in the engine's random order. It replays the
engine's random streams (``participation``, ``batches``, ``order``) from the run's seed,
as tests/algorithms/test_split.py does.

Tolerances (``helpers.float_tolerance``): the engine runs in float32; the transcription
runs in float32 and in float64 from the same float32 inputs, and the engine must land
within 8 times the float32 transcription's distance from the float64 one (this
problem's conditioning), plus a floor of 8 eps32 sqrt(B K) max|x|. Each test checks
that the default recipe lies far outside that bound, so the bound sees the recipe.
Weight decay is 0.01 here (the released code uses 5e-4) so that its term on the server
side, lr * wd * |x| per step, is far above the bound too.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_float_close, digits_config, float_tolerance

from splitfed.engine.batches import batch_plan
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.models import split
from splitfed.rng import RandomStreams
from tests.test_checkpoint import check_resume

K, B, LR, MOMENTUM, WD = 3, 8, 0.1, 0.9, 0.01
TERMS = B * K
SPLIT = dict(model={"name": "mlp", "hidden": [32, 16], "cut": 1},
             partition={"scheme": "dirichlet", "num_clients": 5, "alpha": 1.0,
                        "min_partition_size": 5},
             train={"batch_size": B, "local_steps": K, "local_epochs": None, "lr": LR,
                    "momentum": MOMENTUM, "weight_decay": WD},
             participation={"mode": "uniform", "clients_per_round": 3})
RELEASED = "released_code"


def config(name, rounds=2, **algorithm):
    return digits_config(algorithm={"name": name, **algorithm}, rounds=rounds, **SPLIT)


def config_with(name, train, **algorithm):
    return digits_config(algorithm={"name": name, **algorithm}, rounds=2,
                         **{**SPLIT, "train": {**SPLIT["train"], **train}})


def final_state(cfg):
    return run_experiment(cfg, write=False).state


# ------------------------------------------------------------------ the transcription


class Problem:
    """The run's data, partition, sampler and initial model (float32, from
    ``build_environment``) with fresh copies of its random streams, in ``dtype``."""

    def __init__(self, env, dtype):
        self.env = env
        client, server = split(copy.deepcopy(env.model), env.cut)
        self.client, self.server = client.to(dtype), server.to(dtype)
        self.x, self.y = env.data.train.x.to(dtype), env.data.train.y
        self.streams = RandomStreams(env.config.seed)

    def cohort(self):
        return self.env.sampler.sample(self.streams.numpy("participation"))

    def plan(self, cid):
        return batch_plan(self.env.client_indices[cid], K, B, self.streams.numpy("batches"))


def state(*modules):
    return {k: v.detach().clone() for m in modules for k, v in m.state_dict().items()}


def module_with(template, values):
    m = copy.deepcopy(template)
    m.load_state_dict({k: values[k] for k in template.state_dict()})
    return m


def released_iteration(client, client_opt, server, x, y, lr):
    """One iteration as the released code runs it: the client's forward pass, the server
    step with an optimizer made for this batch, the client's step with its round-long
    optimizer from the cut-layer gradient (computed before the server's step)."""
    acts = client(x)
    h = acts.detach().requires_grad_(True)
    server_opt = torch.optim.SGD(server.parameters(), lr=lr, momentum=MOMENTUM,
                                 weight_decay=WD)
    server_opt.zero_grad()
    F.cross_entropy(server(h), y).backward()
    server_opt.step()
    client_opt.zero_grad()
    acts.backward(h.grad)
    client_opt.step()


def average(glob, trained, weights):
    """x + sum_n w_n (x_n - x) (paper 002 eq. 3 with q_n = 1, the engine's delta form)."""
    return {k: x + sum(float(w) * (y[k] - x) for w, y in zip(weights, trained))
            for k, x in glob.items()}


def both_sides_averaged(p: Problem, rounds, train):
    """Rounds in which each client and its server copy start from the global models,
    ``train(client, server, lr, plan)`` trains them, and both sides are aggregated."""
    glob = state(p.client, p.server)
    for t in range(1, rounds + 1):
        cohort, lr = p.cohort(), p.env.lr(t)
        plans = [p.plan(cid) for cid in cohort.ids]
        trained = []
        for s in range(cohort.size):
            client, server = module_with(p.client, glob), module_with(p.server, glob)
            train(client, server, lr, plans[s])
            trained.append(state(client, server))
        glob = average(glob, trained, cohort.weights)
    return glob


def sflv1_released(p: Problem, rounds):
    """SFL-V1 (Algorithm 1, tau_tilde = tau) with the released code's optimizers: each
    client and its server copy start from the global models; both sides aggregated."""
    def train(client, server, lr, plan):
        client_opt = torch.optim.SGD(client.parameters(), lr=lr, momentum=MOMENTUM,
                                     weight_decay=WD)
        for rows in torch.from_numpy(plan):
            released_iteration(client, client_opt, server, p.x[rows], p.y[rows], lr)
    return both_sides_averaged(p, rounds, train)


def sflv2_released(p: Problem, rounds):
    """SFL-V2 (Algorithm 2) with the released code's optimizers and order: the one server
    model serves all K iterations of a client, then the next (random order)."""
    glob, server = state(p.client), p.server
    for t in range(1, rounds + 1):
        cohort, lr = p.cohort(), p.env.lr(t)
        plans = [p.plan(cid) for cid in cohort.ids]
        trained = [None] * cohort.size
        for s in p.streams.numpy("order").permutation(cohort.size):
            client = module_with(p.client, glob)
            client_opt = torch.optim.SGD(client.parameters(), lr=lr, momentum=MOMENTUM,
                                         weight_decay=WD)
            for rows in torch.from_numpy(plans[s]):
                released_iteration(client, client_opt, server, p.x[rows], p.y[rows], lr)
            trained[s] = state(client)
        glob = average(glob, trained, cohort.weights)   # line 20; the server keeps its model
    return {**glob, **state(server)}


def fedavg_whole(p: Problem, rounds):
    """FedAvg on the whole model (client side then server side) with a round-long
    ``torch.optim.SGD(momentum, weight_decay)`` per client: SFL-V1 with the paper's
    recipe and tau_tilde = tau."""
    def train(client, server, lr, plan):
        opt = torch.optim.SGD([*client.parameters(), *server.parameters()], lr=lr,
                              momentum=MOMENTUM, weight_decay=WD)
        for rows in torch.from_numpy(plan):
            opt.zero_grad()
            F.cross_entropy(server(client(p.x[rows])), p.y[rows]).backward()
            opt.step()
    return both_sides_averaged(p, rounds, train)


def references(cfg, transcribe, rounds):
    env = build_environment(cfg)
    return (transcribe(Problem(env, torch.float32), rounds),
            transcribe(Problem(env, torch.float64), rounds))


def assert_matches(got, ref32, ref64, what):
    assert got.keys() == ref64.keys(), what
    for k in ref64:
        assert_float_close(got[k], ref32[k], ref64[k], terms=TERMS, what=f"{what} {k}")


def bounds_away(other, ref32, ref64):
    """How many bounds ``other`` lies from the float64 transcription (its worst tensor)."""
    return max((other[k].double() - ref64[k]).abs().max().item()
               / float_tolerance(ref32[k], ref64[k], terms=TERMS) for k in ref64)


# ------------------------------------------------------------------ against the transcription


def test_sflv1_released_code_matches_transcription():
    cfg = config("sflv1", rounds=3, recipe=RELEASED)
    ref32, ref64 = references(cfg, sflv1_released, 3)
    assert_matches(final_state(cfg)["model"], ref32, ref64, "sflv1 released_code")
    # the paper's recipe (server copies keep their momentum for the round) is far away
    paper = final_state(config("sflv1", rounds=3))["model"]
    assert bounds_away(paper, ref32, ref64) > 20


def test_sflv2_released_code_matches_transcription():
    cfg = config("sflv2", rounds=3, recipe=RELEASED)
    ref32, ref64 = references(cfg, sflv2_released, 3)
    got = final_state(cfg)
    assert_matches(got["model"], ref32, ref64, "sflv2 released_code")
    assert got["server_opt"] is None          # nothing of the server optimizer is kept
    # the paper's recipe (server momentum kept for the run) is far away, in either order
    for algorithm in ({"order": "per_client"}, {}):
        paper = final_state(config("sflv2", rounds=3, **algorithm))
        assert bounds_away(paper["model"], ref32, ref64) > 20, algorithm
        assert paper["server_opt"]["state"]            # momentum buffers, kept for the run


def test_sflv2_released_code_is_per_client_order_with_order_per_client_written():
    a = final_state(config("sflv2", recipe=RELEASED))["model"]
    b = final_state(config("sflv2", recipe=RELEASED, order="per_client"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ equivalences


@pytest.mark.parametrize("name,paper", [("sflv1", {}), ("sflv2", {"order": "per_client"})])
def test_without_momentum_the_recipes_agree_bit_for_bit(name, paper):
    """A fresh SGD's first step is x - eta (g + wd x): without momentum, re-creating the
    server optimizer every batch changes nothing (weight decay included)."""
    train = {"momentum": 0.0}
    a = final_state(config_with(name, train, recipe=RELEASED))["model"]
    b = final_state(config_with(name, train, **paper))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sflv1_cut_matters_only_with_the_released_recipe():
    """tau_tilde = tau: with the paper's recipe SFL-V1 is FedAvg on the whole model,
    momentum and weight decay included, so the cut does not matter (float rounding
    only); with the released recipe only the client side has momentum, and it does."""
    def at(cut, **algorithm):
        cfg = digits_config(algorithm={"name": "sflv1", **algorithm}, rounds=3,
                            **{**SPLIT, "model": {**SPLIT["model"], "cut": cut}})
        return final_state(cfg)["model"]

    fedavg = final_state(digits_config(algorithm={"name": "fedavg"}, rounds=3,
                                       **SPLIT))["model"]
    ref32, ref64 = references(digits_config(algorithm={"name": "fedavg"}, rounds=3, **SPLIT),
                              fedavg_whole, 3)
    assert_matches(fedavg, ref32, ref64, "fedavg")
    for cut in (1, 2):
        assert_matches(at(cut), ref32, ref64, f"sflv1 cut {cut}")
    # the released recipe's two cuts differ by far more than that rounding bound
    one, two = at(1, recipe=RELEASED), at(2, recipe=RELEASED)
    assert max((one[k].double() - two[k].double()).abs().max().item()
               / float_tolerance(ref32[k], ref64[k], terms=TERMS) for k in one) > 100


@pytest.mark.parametrize("name", ["sflv1", "sflv2"])
def test_resume_with_the_released_recipe_is_bit_identical(tmp_path, monkeypatch, name):
    """Nothing of the server optimizer is kept, and the run resumes from a checkpoint
    to the same bits (interrupted in round 3, after the checkpoint of round 2)."""
    cfg = digits_config(algorithm={"name": name, "recipe": RELEASED}, rounds=4,
                        checkpoint_every=2, **SPLIT)
    check_resume(tmp_path, monkeypatch, cfg, 3)


# ------------------------------------------------------------------ refused configs


@pytest.mark.parametrize("name", ["sl", "fedavg", "csefsl", "musplitfed"])
def test_other_algorithms_refuse_the_recipe(name):
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm.recipe'; allowed keys"):
        build_algorithm(digits_config(algorithm={"name": name, "recipe": RELEASED}))


@pytest.mark.parametrize("name", ["sflv1", "sflv2"])
def test_an_unknown_recipe_names_the_allowed_ones(name):
    with pytest.raises(ConfigError, match=r"algorithm.recipe.*'paper'.*'released_code'"):
        build_algorithm(digits_config(algorithm={"name": name, "recipe": "released"}))


def test_sflv2_released_code_refuses_iteration_order():
    cfg = config("sflv2", recipe=RELEASED, order="iteration")
    with pytest.raises(ConfigError, match=r"^algorithm.order: recipe 'released_code'"):
        run_experiment(cfg, write=False)
