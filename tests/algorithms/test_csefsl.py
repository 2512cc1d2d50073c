"""CSE-FSL (paper 000, Algorithm 1) against plain references, what crosses the cut, and
the server-side storage metric."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from helpers import assert_float_close, digits_config

from splitfed.algorithms.csefsl import CSEFSL
from splitfed.engine.batches import batch_plan
from splitfed.engine.evaluate import evaluate
from splitfed.engine.loop import macs_per_sample
from splitfed.errors import ConfigError
from splitfed.experiment import build_algorithm, build_environment, run_experiment
from splitfed.models import split
from splitfed.models.aux import build_aux_head
from splitfed.rng import RandomStreams, derive_seed
from splitfed.transport import InProcessTransport

MLP = {"name": "mlp", "hidden": [32, 16], "cut": 1}
CUT_KINDS = [("activations", "up"), ("labels", "up"), ("activation_grads", "down")]


def cfg_for(steps=2, rounds=3, participation=None, chunk=None, name="csefsl", **algorithm):
    return digits_config(
        algorithm={"name": name, **algorithm}, rounds=rounds, model=MLP,
        partition={"scheme": "dirichlet", "num_clients": 4, "alpha": 1.0,
                   "min_partition_size": 5},
        train={"batch_size": 8, "local_steps": steps, "local_epochs": None, "lr": 0.1},
        participation=participation or {"mode": "full"},
        engine={"chunk_size": chunk} if chunk else {})


def close(got, want32, want64, what=""):
    """``got`` matches a reference computed in float32 (``want32``) and in float64
    (``want64``) from the same float32 inputs, within the bound of tests/helpers.py."""
    assert got.keys() == want64.keys()
    for k in want64:
        assert_float_close(got[k], want32[k], want64[k], what=f"{what} {k}")


def sgd_step(module, lr):
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def average(modules, weights):
    keys = modules[0].state_dict()
    return {k: sum(float(w) * m.state_dict()[k] for m, w in zip(modules, weights))
            for k in keys}


class Recording(InProcessTransport):
    def __init__(self, ledger):
        super().__init__(ledger)
        self.sent = []

    def _deliver(self, kind, direction, ids, payload):
        if isinstance(payload, torch.Tensor):
            self.sent.append((self.ledger.round, kind, payload.detach().clone()))
        return super()._deliver(kind, direction, ids, payload)

    def tensors(self, t, kind):
        return torch.cat([p for r, k, p in self.sent if (r, k) == (t, kind)])


def manual(cfg, transport=None):
    """Environment, algorithm, initial state and a one-round driver (as the loop does)."""
    env = build_environment(cfg)
    if transport is not None:
        env.transport = transport(env.ledger)
    algo = build_algorithm(cfg)

    def step(state, t):
        env.ledger.round = t
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        return algo.round(env, state, t, cohort).state, cohort

    return env, algo, algo.init_state(env), step


def test_upload_rounds_follow_line_8_with_paper_round_t_minus_1():
    assert [t for t in range(1, 11) if CSEFSL(CSEFSL.Options(period=3)).uploads(t)] == [4, 7, 10]
    assert [t for t in range(1, 5) if CSEFSL().uploads(t)] == [2, 3, 4]
    with pytest.raises(ConfigError, match="period"):
        run_experiment(cfg_for(period=0), write=False)


def test_first_step_uses_the_true_server_gradient():
    """l = 1, K = 1: the only local step of round 2 is x_C - mu_L J^T z_b (lines 27-29),
    z_b from the server model as it stands when that client is served, and x_A is kept
    (line 30)."""
    cfg = cfg_for(steps=1, rounds=2)
    env, _, state, step = manual(cfg)
    state, _ = step(state, 1)                                 # auxiliary steps only
    before = state
    after, cohort = step(state, 2)
    streams = RandomStreams(cfg.seed)
    rng = streams.numpy("batches")
    for _ in range(2):                                        # rounds 1 and 2 draw K = 1
        plans = [batch_plan(env.client_indices[c], 1, 8, rng) for c in cohort.ids]
    order = streams.numpy("order").permutation(cohort.size)

    def expected(dtype):
        client, server = split(copy.deepcopy(env.model).to(dtype), env.cut)
        client.load_state_dict({k: before["model"][k] for k in client.state_dict()})
        server.load_state_dict({k: before["model"][k] for k in server.state_dict()})
        x, y = env.data.train.x.to(dtype), env.data.train.y
        updated = [None] * cohort.size
        for s in order:
            rows = torch.from_numpy(plans[s][0])
            mine = copy.deepcopy(client)
            acts = mine(x[rows])
            h = acts.detach().requires_grad_(True)
            params = list(server.parameters())
            g_h, *g_s = torch.autograd.grad(F.cross_entropy(server(h), y[rows]), [h, *params])
            with torch.no_grad():
                for p, g in zip(params, g_s):
                    p -= 0.1 / cohort.size * g                # mu / m, m = uploads
            client_params = list(mine.parameters())
            g_c = torch.autograd.grad(acts, client_params, g_h)
            with torch.no_grad():
                for p, g in zip(client_params, g_c):
                    p -= 0.1 * g
            updated[s] = mine
        return {**average(updated, cohort.weights), **server.state_dict()}
    close(after["model"], expected(torch.float32), expected(torch.float64))
    assert after["aux"].keys() == before["aux"].keys()
    assert all(torch.equal(after["aux"][k], v) for k, v in before["aux"].items())
    assert not torch.allclose(after["model"]["out.weight"], before["model"]["out.weight"])


def test_no_cut_traffic_outside_upload_rounds_and_none_down_without_feedback():
    for feedback in (True, False):
        cfg = cfg_for(rounds=4, period=2, server_feedback=feedback,
                      participation={"mode": "uniform", "clients_per_round": 3})
        env, algo, state, step = manual(cfg)
        for t in range(1, 5):
            state, cohort = step(state, t)
            sampled = np.zeros(env.num_clients, dtype=bool)
            sampled[cohort.ids] = True
            for kind, direction in CUT_KINDS:
                per_client = env.ledger.per_client(t, kind, direction)
                if t == 3 and (feedback or kind != "activation_grads"):
                    assert (per_client[sampled] > 0).all(), (t, kind)
                else:
                    assert per_client.sum() == 0, (t, kind, feedback)
            assert (env.ledger.per_client(t, "model", "down")[sampled] > 0).all()
            assert (env.ledger.per_client(t, "model", "up")[sampled] > 0).all()
        grads_down = env.ledger.total("activation_grads")
        assert grads_down == (env.ledger.total("activations") if feedback else 0)


@pytest.mark.parametrize("order", ["random", "cohort"])
def test_one_sequential_server_update_per_upload_in_order(order):
    """With replacement (repeated clients are separate slots), small chunks: the server
    model equals the uploads applied one at a time in the drawn order, and every slot gets
    back the gradient of the server model it met."""
    cfg = cfg_for(rounds=2, order=order, chunk=2,
                  participation={"mode": "with_replacement", "clients_per_round": 6})
    env, _, state, step = manual(cfg, Recording)
    state, _ = step(state, 1)
    before = state
    after, cohort = step(state, 2)
    assert len(set(cohort.ids.tolist())) < cohort.size      # the sample has repeats
    h = env.transport.tensors(2, "activations")
    y = env.transport.tensors(2, "labels")
    down = env.transport.tensors(2, "activation_grads")
    assert h.shape[0] == y.shape[0] == down.shape[0] == cohort.size
    # the same sequence in float32 and in float64, from the recorded float32 activations
    dtypes = (torch.float32, torch.float64)
    servers = {dt: split(copy.deepcopy(env.model).to(dt), env.cut)[1] for dt in dtypes}
    for server in servers.values():
        server.load_state_dict({k: before["model"][k] for k in server.state_dict()})
    rng = RandomStreams(cfg.seed).numpy("order")
    sequence = rng.permutation(cohort.size) if order == "random" else range(cohort.size)
    for s in sequence:
        grads = []
        for dt, server in servers.items():
            hs = h[s].to(dt).requires_grad_(True)
            F.cross_entropy(server(hs), y[s]).backward()
            grads.append(hs.grad)
            sgd_step(server, 0.1 / cohort.size)
        assert_float_close(down[s], *grads, what=f"slot {s} activation gradient")
    close({k: after["model"][k] for k in servers[torch.float32].state_dict()},
          *(servers[dt].state_dict() for dt in dtypes))


def reference(cfg, rounds, dtype=torch.float32):
    """Algorithm 1, one client at a time, plain modules and autograd, in ``dtype`` from the
    engine's float32 initial model, auxiliary head and data."""
    env = build_environment(cfg)
    opts, tr = cfg.algorithm.options, cfg.train
    client, server = split(copy.deepcopy(env.model), env.cut)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "aux"))
        head = build_aux_head(client, env.data.input_shape, env.data.num_classes)
    client, server, head = client.to(dtype), server.to(dtype), head.to(dtype)
    streams = RandomStreams(cfg.seed)
    x, y = env.data.train.x.to(dtype), env.data.train.y
    lr, K = tr.lr, tr.local_steps
    for t in range(1, rounds + 1):
        cohort = env.sampler.sample(streams.numpy("participation"))
        n = cohort.size
        plans = [torch.from_numpy(batch_plan(env.client_indices[c], K, tr.batch_size,
                                             streams.numpy("batches"))) for c in cohort.ids]
        clients = [copy.deepcopy(client) for _ in range(n)]
        heads = [copy.deepcopy(head) for _ in range(n)]
        first = 0
        if t > 1 and (t - 1) % opts.get("period", 1) == 0:      # paper t - 1
            z_b = [None] * n
            for s in streams.numpy("order").permutation(n):
                h = clients[s](x[plans[s][0]]).detach().requires_grad_(True)
                F.cross_entropy(server(h), y[plans[s][0]]).backward()
                z_b[s] = h.grad
                sgd_step(server, lr / n)
            if opts.get("server_feedback", True):
                for s in range(n):
                    clients[s](x[plans[s][0]]).backward(z_b[s])
                    sgd_step(clients[s], lr)
                first = 1
        for s in range(n):
            for k in range(first, K):
                rows = plans[s][k]
                F.cross_entropy(heads[s](clients[s](x[rows])), y[rows]).backward()
                sgd_step(clients[s], lr)
                sgd_step(heads[s], lr)
        client.load_state_dict(average(clients, cohort.weights))
        head.load_state_dict(average(heads, cohort.weights))
    return {**client.state_dict(), **server.state_dict()}, head.state_dict()


@pytest.mark.parametrize("feedback", [True, False])
def test_matches_unbatched_reference(feedback):
    """l = 2, uniform participation: rounds 1-2 auxiliary only, round 3 uploads."""
    cfg = cfg_for(rounds=3, period=2, server_feedback=feedback, chunk=2,
                  participation={"mode": "uniform", "clients_per_round": 3})
    state = run_experiment(cfg, write=False).state
    (model32, aux32), (model64, aux64) = reference(cfg, 3), reference(cfg, 3, torch.float64)
    close(state["model"], model32, model64, "model")
    close(state["aux"], aux32, aux64, "aux")


def test_with_replacement_and_mlp_head_run():
    cfg = cfg_for(rounds=3, aux="mlp", aux_hidden=16,
                  participation={"mode": "with_replacement", "clients_per_round": 5})
    result = run_experiment(cfg, write=False)
    assert result.status == "completed"
    assert result.state["aux"]["1.weight"].shape == (16, 32)
    last = result.records[-1]
    assert np.isfinite(last["train_loss"]) and 0 <= last["aux_test_acc"] <= 1
    assert last["bytes_up/activations"] == 5 * 8 * 32 * 4


def test_server_storage_and_server_macs():
    """server_param_bytes: one server copy for CSE-FSL, SFL-V2, SL and GAS, one per
    participating client for SFL-V1 and MU-SplitFed, none for FedAvg; CSE-FSL's server
    trains on uploads only, its clients train their part and their auxiliary head."""
    participation = {"mode": "uniform", "clients_per_round": 3}
    env = build_environment(cfg_for())
    _, server = split(env.model, env.cut)
    one = sum(p.numel() * p.element_size() for p in server.state_dict().values())
    assert one == (32 * 16 + 16 + 16 * 10 + 10) * 4
    for name, copies in {"csefsl": 1, "sflv2": 1, "sl": 1, "gas": 1, "sflv1": 3,
                          "musplitfed": 3, "fedavg": 0}.items():
        records = run_experiment(cfg_for(rounds=2, participation=participation, name=name),
                                 write=False).records
        assert [r["server_param_bytes"] for r in records[1:]] == [copies * one] * 2, name
    cfg = cfg_for(rounds=2, participation=participation)
    client_per_sample, server_per_sample = macs_per_sample(CSEFSL(), env)
    records = run_experiment(cfg, write=False).records
    assert records[1]["server_macs"] == 0                     # round 1: no uploads
    assert records[2]["server_macs"] == 3 * 8 * server_per_sample   # one batch per client
    head = 32 * 10                          # the linear auxiliary head on 32 cut values
    assert records[1]["client_macs"] == 3 * 2 * 8 * (client_per_sample + 3 * head)
    # an upload round: the first step backpropagates the server's gradient, not the head's
    assert records[2]["client_macs"] == 3 * 8 * (2 * (client_per_sample + 3 * head) - 2 * head)


def test_round_losses_are_means_over_the_uploads_and_over_each_clients_steps():
    """Rounds (engine/rounds.py): train_loss is the mean over the cohort's slots of each
    client's mean local loss over its K steps (here the auxiliary loss F_i^c before each
    step of round 1, which uploads nothing); ``server_loss`` of an upload round is the
    mean over the uploads of F_i^s(x_S; z_f,i, y_i) as the server meets each one
    (lines 9-16, mu / m with m = the uploads)."""
    cfg = cfg_for(steps=2, rounds=2, order="cohort", participation={"mode": "full"})
    env, algo, state, _ = manual(cfg)
    results = []
    for t in (1, 2):
        env.ledger.round = t
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        results.append(algo.round(env, state, t, cohort))
        state = results[-1].state
    streams = RandomStreams(cfg.seed)
    rng = streams.numpy("batches")
    plans = [[batch_plan(env.client_indices[c], 2, 8, rng) for c in cohort.ids]
             for _ in range(2)]
    start = algo.init_state(build_environment(cfg))

    def expected(dtype):
        client, server = split(copy.deepcopy(env.model).to(dtype), env.cut)
        client.load_state_dict({k: start["model"][k] for k in client.state_dict()})
        server.load_state_dict({k: start["model"][k] for k in server.state_dict()})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "aux"))
            head = build_aux_head(client, env.data.input_shape, env.data.num_classes)
        head = head.to(dtype)
        x, y = env.data.train.x.to(dtype), env.data.train.y
        per_client, clients, heads = [], [], []
        for s in range(cohort.size):                  # round 1: K auxiliary steps each
            mine, aux, losses = copy.deepcopy(client), copy.deepcopy(head), []
            for k in range(2):
                rows = torch.from_numpy(plans[0][s][k])
                loss = F.cross_entropy(aux(mine(x[rows])), y[rows])
                loss.backward()
                losses.append(loss.detach())
                sgd_step(mine, 0.1)
                sgd_step(aux, 0.1)
            per_client.append(torch.stack(losses).mean())
            clients.append(mine)
            heads.append(aux)
        client.load_state_dict(average(clients, cohort.weights))
        served = []                                   # round 2: the uploads in cohort order
        for s in range(cohort.size):
            rows = torch.from_numpy(plans[1][s][0])
            loss = F.cross_entropy(server(client(x[rows]).detach()), y[rows])
            loss.backward()
            served.append(loss.detach())
            sgd_step(server, 0.1 / cohort.size)
        return (torch.stack(per_client).mean().reshape(1),
                torch.stack(served).mean().reshape(1))

    (train32, served32), (train64, served64) = expected(torch.float32), expected(torch.float64)
    assert_float_close(torch.tensor([results[0].train_loss]), train32, train64, terms=8,
                       what="round 1 train_loss")
    assert_float_close(torch.tensor([results[1].metrics["server_loss"]]), served32,
                       served64, terms=8, what="round 2 server_loss")


def test_aux_test_acc_is_the_global_client_part_with_the_global_head():
    """csefsl module doc: ``aux_test_acc`` is the accuracy of x_C composed with the
    auxiliary head x_A as the round left them (the averaged head, not its initial
    draw), on the test set."""
    cfg = cfg_for(steps=3, rounds=2)
    result = run_experiment(cfg, write=False)
    env = build_environment(cfg)
    algo = build_algorithm(cfg)
    client, _ = split(copy.deepcopy(env.model), env.cut)
    client.load_state_dict({k: result.state["model"][k] for k in client.state_dict()})
    head = algo.head(env, client)
    initial = evaluate(nn.Sequential(client, copy.deepcopy(head)), env.data.test.x,
                       env.data.test.y, cfg.engine.eval_batch_size)
    head.load_state_dict(result.state["aux"])
    want = evaluate(nn.Sequential(client, head), env.data.test.x, env.data.test.y,
                    cfg.engine.eval_batch_size)
    last = result.records[-1]
    assert last["aux_test_acc"] == want["test_acc"] != initial["test_acc"]
    assert last["aux_test_loss"] == want["test_loss"]
