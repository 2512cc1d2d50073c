"""FedCLG (paper 004, Bian et al., Sec. IV, Algorithm 1): FedCLG-C (eq. 10) and FedCLG-S
(eq. 11), hybrid FL whose server gradient corrects the partial-participation error.

Each round t (Algorithm 1) the server draws D_s^t, samples S_t and computes, before the
clients start, a server gradient at the global model (line 4)

    g^s_t = grad f_s(x_t, zeta_s)   (a minibatch of D_s^t; all of D_s^t with
                                     ``server_gradient: full`` or
                                     ``server_data.full_batch``).

Every sampled client i has its own gradient at x_t, g^i_t = grad f_i(x_t, zeta_i).

- FedCLG-C (eq. 10): the server broadcasts g^s_t with x_t; client i sets
  c_i = g^s_t - g^i_t and takes K_i corrected steps from x_t,

      x^i_{t,k+1} = x^i_{t,k} - eta (g^i_{t,k} + c_i),   k = 0, ..., K_i - 1,

  at EVERY local step (some public code applies c_i once per epoch; the paper does
  not). The server aggregates as eq. 4 and trains on D_s^t as eq. 5.
- FedCLG-S (eq. 11): clients run plain local SGD (eq. 3) and upload Delta^i_t =
  x^i_{t,K} - x_t together with g^i_t; the server aggregates

      x^s_{t+1} = x_t + eta_g sum_{i in S_t} w_i (Delta^i_t - K_i eta (g^s_t - g^i_t)),

  then trains on D_s^t as eq. 5. Signs as printed: Delta is x_K - x_t (Sec. III-A), and
  Delta^i - K eta (g^s - g^i) = -eta sum_k (g^i_{t,k} + g^s - g^i), the FedCLG-C step
  without the drift (eq. 62 of Appendix C). The text after eq. 11 calls eta_g "the
  learning rate for the server's local training": a typo, it is the global rate of
  Algorithm 1 line 1 (``global_lr``).

Decisions (docs/design.md and what the paper leaves open):

- g^i_t (option ``client_gradient``): "first_batch" (default) is the gradient of the
  client's first local minibatch at x_t, i.e. g^i_t = g^i_{t,0}: eq. 10 writes both as
  grad f_i(x_t, zeta_i), and a client gets it for free from its first step. With it the
  first corrected step of FedCLG-C is exactly x_t - eta g^s_t. "fresh_batch" draws a
  separate minibatch (stream ``client_gradients``) and "full" uses all the client's data
  (grad f_i(x_t)); both cost the client one more pass (added to ``samples``, and to
  the cost over-selection and ``--dry-run`` predict: ``client_samples``). In this
  simulation g^i_t is computed for the whole cohort in one batched pass of stacked copies
  at x_t, without stepping (:func:`stacked_gradients`); the first local batch is the one
  the executor will draw (a copy of the ``batches`` stream).
- g^s_t (option ``server_gradient``): "batch" (default) is the gradient of one minibatch
  of B_s samples of D_s^t (``server_batch_size``), as Algorithm 1 line 4 writes it;
  "full" is grad f_s(x_t) on all of D_s^t, the gradient the analysis uses (Assumption 2
  bounds the variance of grad f_s over D_s^t by sigma^2 / m_s, and Remark 6 and the
  Fig. 6 text tie the quality of the correction to m_s, which a fixed-size minibatch
  would not). "full" changes g^s_t only: the E server steps of eq. 5 keep their
  minibatches (``server_data.full_batch`` makes both full-batch). In ``fedclg_c`` and
  ``fedclg_s`` the one ``algorithm.server_batch_size`` is the B_s of both, g^s_t's
  minibatch and the server steps' (Algorithm 1 has one B_s).
- eta = ``env.lr(t)``, gamma = ``env.lr(t, server_lr)`` (Sec. VI decay); K_i is client i's
  own step count (``train.local_steps``, or ceil(D_i / B) * ``train.local_epochs``); the
  paper's 1/M is w_i = 1/M (``participation.weighting=uniform`` or equal data sizes, as in
  Sec. VI); by default w_i are FedAvg's data-size weights (a_i / q_i under bernoulli), in
  both the model delta and the correction of eq. 11.
- Corrections act on parameters only: g^s, g^i and c_i have no BatchNorm buffers, and
  buffers are averaged like parameters (FedAvg). The gradient passes run in training
  mode on throw-away copies, so x_t's running statistics are untouched by them.
- The correction is added to the minibatch gradient before the optimizer (as SCAFFOLD's):
  with ``train.weight_decay`` / ``train.momentum`` the decay / momentum acts on the
  corrected gradient. The paper assumes plain SGD (the default).
- Communication (``model`` kind, parameter-sized): FedCLG-C broadcasts g^s_t with x_t
  (bytes_down/model = 2x FedAvg's for a model without buffers); FedCLG-S uploads g^i_t with
  the model (bytes_up/model = 2x). ``with_replacement``: every slot has its own first
  batch, so its own g^i_t and c_i.
- A round with an empty cohort computes no g^s_t, keeps x_t and trains the server.

The algorithms: FedAvg with the gradient transform ``fedclg_c``/``fedclg_s``, then eq. 5.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from splitfed.algorithms.fedavg import FedAvg
from splitfed.algorithms.server_only import ServerTrain
from splitfed.engine.algorithm import variant
from splitfed.engine.batches import batch_plan
from splitfed.engine.clock import CLIENT, SERVER
from splitfed.engine.flops import TRAIN_FACTOR
from splitfed.engine.stacked import StackedModel
from splitfed.engine.transforms import GradientRound, GradientTransform
from splitfed.models.cohort import SAMPLES_PER_CALL


@dataclass
class CorrectionOptions:
    client_gradient: Literal["first_batch", "fresh_batch", "full"] = field(
        default="first_batch", metadata={
            "help": "g_i at x_t: the first local minibatch, a fresh one, or all client data"})
    server_gradient: Literal["batch", "full"] = field(default="batch", metadata={
        "help": "g_s at x_t: a minibatch of D_s^t, or all of D_s^t (server_data.full_batch "
                "also gives all of it)"})
    server_batch_size: int | None = field(default=None, metadata={
        "ge": 1, "le": 10**6, "help": "B_s of g_s (null: train.batch_size)"})


def stacked_gradients(module, start, x: torch.Tensor, y: torch.Tensor,
                      rows: list[np.ndarray], chunk_size: int) -> dict[str, torch.Tensor]:
    """Gradients of the mean cross-entropy on each ``rows[s]`` at ``start``, [S, ...] per
    parameter: one batched forward/backward of stacked copies per chunk, no step.

    Row sets of unequal length are padded by cycling each set, the padding weighted 0
    (the gradient is exact; BatchNorm batch statistics then include the repeats).
    """
    names = [n for n, _ in module.named_parameters()]
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for lo in range(0, len(rows), chunk_size):
        part = rows[lo:lo + chunk_size]
        width = max(len(r) for r in part)
        idx = torch.from_numpy(np.stack([np.resize(r, width) for r in part])).to(x.device)
        model = StackedModel(module, start, len(part))
        logits = model.forward(x[idx])
        ce = F.cross_entropy(logits.flatten(0, 1), y[idx].flatten(),
                             reduction="none").view(len(part), width)
        if all(len(r) == width for r in part):
            losses = ce.mean(1)
        else:
            w = torch.zeros_like(ce)
            for j, r in enumerate(part):
                w[j, :len(r)] = 1.0 / len(r)
            losses = (ce * w).sum(1)
        grads = torch.autograd.grad(losses.sum(), [model.state[n] for n in names])
        for n, g in zip(names, grads):
            out[n].append(g)
    return {n: torch.cat(v) for n, v in out.items()}


class CLGCorrection(GradientTransform):
    """g^s_t at x_t and the clients' g^i_t (Algorithm 1 line 4), and the variant's
    correction: at every local step (C, eq. 10) or at aggregation (S, eq. 11)."""

    Options = CorrectionOptions
    distributed = False                   # not on the multi-process runtime yet
    needs_server_data = True
    splits = False                        # g^s and g^i of the whole model

    #: whether the clients need g^s_t before their first step (FedCLG-C: it is sent with
    #: x_t; FedCLG-S uses it only at aggregation)
    clients_wait_for_g_s = False

    def start(self, env, state, t, cohort, round_):
        x_t, batch = round_.model, self.server_gradient_batch(env, round_.server_rows)
        g_s = self.server_gradient(env, x_t, batch)
        self.charge_server_gradient(env, len(batch))
        g_i, extra = self.client_gradients(env, x_t, cohort)
        out = self.correction(env, t, cohort, g_s, g_i, round_)
        out.samples, out.server_samples = extra, len(batch)
        return out

    def charge_server_gradient(self, env, samples: int) -> None:
        """g^s_t on the simulated clock: a forward and backward pass of ``samples`` on the
        server's lane at the round's start (Algorithm 1 line 4, before the clients
        start); under FedCLG-C the downloads of g^s_t depart once it is computed."""
        clock = env.clock
        macs = samples * TRAIN_FACTOR * clock.macs(env.model, tuple(env.data.input_shape))
        clock.compute(SERVER, None, macs)
        if self.clients_wait_for_g_s:
            clock.server_sends_after_own_work()

    def server_gradient_batch(self, env, rows: np.ndarray) -> np.ndarray:
        """zeta_s: a minibatch of D_s^t (``server_data`` stream), or D_s^t itself
        (``server_gradient: full`` or ``server_data.full_batch``; nothing is drawn then)."""
        if self.options.server_gradient == "full" or env.server_data.full_batch:
            return rows
        size = int(self.options.server_batch_size or env.config.train.batch_size)
        return batch_plan(rows, 1, size, env.streams.numpy("server_data"))[0]

    def server_gradient(self, env, x_t, batch: np.ndarray) -> dict[str, torch.Tensor]:
        """g^s_t = grad f_s(x_t, zeta_s) (Algorithm 1 line 4), parameters only."""
        g = stacked_gradients(env.model, x_t, env.server_data.x, env.server_data.y, [batch], 1)
        return {n: v[0] for n, v in g.items()}

    def client_samples(self, env, ids):
        """The samples of g^i_t's own pass, one per slot of ``ids``: none with
        ``first_batch`` (the first local step's batch), ``train.batch_size`` with
        ``fresh_batch`` (one batch of :func:`batch_plan`, which has B samples also for a
        client with fewer, repeating them), D_i with ``full``. What
        :meth:`client_gradients` charges the clock and counts in ``samples``;
        over-selection and ``--dry-run`` predict the pass with it."""
        ids = np.asarray(ids, dtype=np.int64)
        mode = self.options.client_gradient
        if mode == "first_batch":
            return np.zeros(len(ids), dtype=np.int64)
        if mode == "fresh_batch":
            return np.full(len(ids), int(env.config.train.batch_size), dtype=np.int64)
        return env.data_sizes[ids]

    def client_gradients(self, env, x_t, cohort) -> tuple[dict[str, torch.Tensor], int]:
        """g^i_t per cohort slot, [S, ...] per parameter, and the extra samples it cost
        (:meth:`client_samples`, charged to the clients on the clock)."""
        mode, tr = self.options.client_gradient, env.config.train
        ids = cohort.ids
        executor = env.executor(env.model)
        chunk = executor.chunk_size
        if mode == "first_batch":
            rng = copy.deepcopy(env.streams.numpy("batches"))
            rows = [plan[0] for plan in executor.plans(ids, env.local_steps(ids), rng)]
        elif mode == "fresh_batch":
            rng = env.streams.numpy("client_gradients")
            rows = [batch_plan(env.client_indices[c], 1, tr.batch_size, rng)[0] for c in ids]
        else:
            rows = [env.client_indices[c] for c in ids]
            width = max(len(r) for r in rows)
            chunk = env.config.engine.chunk_size or max(1, SAMPLES_PER_CALL // width)
        grads = stacked_gradients(env.model, x_t, env.data.train.x, env.data.train.y,
                                  rows, chunk)
        extra = self.client_samples(env, ids)
        if extra.any():                       # a pass the local steps do not make
            per = TRAIN_FACTOR * env.clock.macs(env.model, tuple(env.data.input_shape))
            env.clock.compute(CLIENT, ids, extra * per)
        return grads, int(extra.sum())


class ClientCorrection(CLGCorrection):
    """FedCLG-C (eq. 10): c_i = g^s - g^i added at every local step."""

    name = "fedclg_c"
    reference = "Bian et al. (paper 004), FedCLG-C, eq. 10"
    clients_wait_for_g_s = True

    def message_bytes(self, env, part_bytes):
        """g^s_t down (the size of the model)."""
        return part_bytes, 0

    def correction(self, env, t, cohort, g_s, g_i, round_):
        g_s = env.transport.broadcast("model", cohort.ids, g_s)
        return _StepCorrection({n: g_s[n].unsqueeze(0) - g_i[n] for n in g_i})


class _StepCorrection(GradientRound):
    def __init__(self, corrections):
        self.corrections = corrections
        self.cache: dict[bytes, list[torch.Tensor]] = {}

    def update(self, names, params, grads, slots):
        """g + c_i for the active slots."""
        key = np.asarray(slots).tobytes()
        if key not in self.cache:
            rows = torch.from_numpy(np.asarray(slots, dtype=np.int64))
            self.cache.clear()
            self.cache[key] = [self.corrections[n].index_select(
                0, rows.to(self.corrections[n].device)) for n in names]
        return torch._foreach_add(grads, self.cache[key])


class AggregateCorrection(CLGCorrection):
    """FedCLG-S (eq. 11): the correction is applied at aggregation."""

    name = "fedclg_s"
    reference = "Bian et al. (paper 004), FedCLG-S, eq. 11"
    needs_rate = True                     # eta_g: the rate step's global_lr

    def message_bytes(self, env, part_bytes):
        """g^i_t up (the size of the model)."""
        return 0, part_bytes

    @torch.no_grad()
    def correction(self, env, t, cohort, g_s, g_i, round_):
        """The uploaded g^i and eta w_i K_i per slot; eq. 11's correction is summed in
        ``adjust``, over the clients the aggregation kept."""
        g_i = env.transport.upload("model", cohort.ids, g_i)
        coef = (torch.from_numpy(np.array(cohort.weights, dtype=np.float64))
                * torch.from_numpy(env.local_steps(cohort.ids).astype(np.float64))
                * float(env.lr(t)))
        eta_g = round_.algorithm.server_steps[0].options.global_lr     # (needs_rate)
        return _AggregateRound(env, eta_g, g_s, g_i, coef, cohort.ids)


class _AggregateRound(GradientRound):
    def __init__(self, env, global_lr, g_s, g_i, coef, ids):
        self.env, self.eta_g, self.g_s, self.g_i, self.coef, self.ids = (
            env, float(global_lr), g_s, g_i, coef, ids)

    @torch.no_grad()
    def adjust(self, model, acc):
        """x_t + eta_g sum_i w_i Delta_i, minus eta_g eta sum_i w_i K_i (g^s - g^i).

        With a round deadline the sum runs over the kept clients only, with the same
        renormalised weights as their Delta_i (docs/clock.md): a late client contributes
        neither its model delta nor its correction term."""
        if acc.count == 0:
            return model
        out = dict(model)
        keep = torch.from_numpy(self.env.clock.on_time(self.ids))
        coef = self.coef[keep] * acc.scale
        for n, g in self.g_i.items():
            c = coef.to(g.device)
            kept = g[keep.to(g.device)].double()
            corr = c.sum() * self.g_s[n].double() - torch.tensordot(c, kept, dims=1)
            out[n] = (out[n].double() - self.eta_g * corr.to(out[n].device)).to(out[n].dtype)
        return out


FedCLGC = variant("FedCLGC", FedAvg, name="fedclg_c", gradient=[ClientCorrection],
                  server=[ServerTrain], distributed=False,
                  reference="Bian et al. (paper 004), FedCLG-C, Algorithm 1 and eq. 10")
FedCLGS = variant("FedCLGS", FedAvg, name="fedclg_s", gradient=[AggregateCorrection],
                  server=[ServerTrain], distributed=False,
                  reference="Bian et al. (paper 004), FedCLG-S, Algorithm 1 and eq. 11")
