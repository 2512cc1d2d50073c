"""GAS: asynchronous split federated learning with generated activations (zeroth-order).

GAS (Yang and Liu, AAAI 2025; paper 001's reference [8]) as paper 001 runs it as a
baseline: "we modify both vanilla SplitFed and GAS to use ZO optimization" (Sec. 5), with
the decisions of docs/design.md, "GAS baseline". One engine round is one aggregation of the client
models; inside it the server serves the round's participants (the active clients) in the
order of their simulated clocks:

1. Every participant receives the global client model and starts its K local steps
   (``train.local_steps``/``local_epochs``). A step is paper 001's zeroth-order client
   step (eq. 4): on its minibatch xi the client computes h = h(x_c; xi) and, for a
   direction u_c on the sphere of radius sqrt(d_c), h+- = h(x_c +- lambda u_c; xi), and
   uploads the three activation tensors and the labels.
2. The uploads become events of :class:`~splitfed.engine.clock.EventQueue` at the time
   the virtual clock says they arrive (``clock.arrival_time``); the server pops them in
   time order. For each it answers at once with the current server model x_s,
   delta_c = F(x_s, h+) - F(x_s, h-) (one scalar, eq. 6), and the client steps
   x_c <- x_c - eta_c delta_c / (2 lambda) u_c and starts its next step, so a fast client
   may upload several times while a straggler computes once.
3. The unperturbed h goes into the activation buffer. When the buffer holds
   ``buffer_size`` uploads (default: the number of active clients, the round's
   participants), the server (a) folds them into per-class running statistics of the
   activations, newer ones weighted more, (b) tops every class with statistics up to
   ``train.batch_size`` samples drawn from N(mean, var) (``covariance: diagonal``, the
   default) or N(mean, Sigma) (``full``), and (c) takes one step on the real and generated
   activations together: a ZO step G_s = (F(x_s + lambda u_s) - F(x_s - lambda u_s)) /
   (2 lambda) u_s (paper 001 eq. 5; ``server_order: first`` for GAS's own first-order
   server), x_s <- x_s - eta_s G_s. A buffer that is not full when the round ends is kept
   for the next round.
4. A client that has finished its K steps uploads its model; once all participants' models
   have arrived (the model buffer holds K = the round's participants) the fed server
   aggregates x_c <- x_c + eta_g sum_m w_m (x_c,m - x_c) with the engine's weights.

Running statistics (docs/design.md: newer weighted more). The s-th server step's activations weigh
s each; per class the pooled weighted mean and (co)variance are kept exactly:
W' = W + s n_k, a = W / W', mu' = a mu + (1 - a) m, var' = a (var + (mu' - mu)^2) +
(1 - a) (v + (mu' - m)^2) (outer products for ``full``), with m, v the batch's class
mean and population (co)variance. GAS's reference code weighs an activation by its
client's iteration counter, which also grows with training time; the step index is the
same idea without per-client counters.

Decisions where GAS's code differs or paper 001 is silent: a class is topped up only
once it has statistics (the reference waits until every class has them); a class with
more than ``batch_size`` real activations keeps all of them (the reference truncates it
to the batch size); the reference's logit adjustment on the client loss is not used
(paper 001 describes GAS by its buffer and generated activations only). Client
optimizer state does not exist (ZO steps); eta_c is ``train.lr``, eta_s ``server_lr``,
lambda ``smoothing``, eta_g ``global_lr`` (1: GAS averages the client models); under
``train.lr_decay`` / ``lr_min`` eta_c and eta_s follow the schedule (``env.lr``).

Within the engine's round structure a round ends when the last participant's model has
arrived: a straggler's steps do not spill into the next aggregation period, as they do
in GAS's continuous process (where a finished client is replaced at once by a new one).
A client id that occurs twice in a cohort (``with_replacement``) runs its slots one after
the other on its one timeline.

Simulated time (docs/clock.md): client passes on the clients' timelines; the server's
answers (2 q passes over the client's batch) and steps (2 q passes over the real and
generated activations) on the shared server lane, each starting when the lane is free and
the triggering upload has arrived; the record's ``server_macs`` counts both (a
first-order server step: a forward and a backward pass), and its ``client_macs`` the
clients' 2 q + 1 forward passes per sample of every step. With a round deadline, late
clients' models are left out of the aggregation; the server keeps what it learnt from
their activations. The learned model depends on the speeds (the event order does),
unlike the synchronous algorithms': ``asynchronous = True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from splitfed.checkpoint import Rule
from splitfed.engine import zo
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.clock import CLIENT, SERVER, EventQueue
from splitfed.engine.rounds import Round
from splitfed.engine.split import (SplitModel, per_client_loss, zeroth_order_client_macs,
                                   zeroth_order_cut_bytes)
from splitfed.engine.stacked import ForwardCopies
from splitfed.errors import ConfigError
from splitfed.models import output_shape
from splitfed.rng import derive_seed

COVARIANCES = ("diagonal", "full")
#: the most memory ``covariance: full`` may take: K float32 D x D covariances kept, and
#: about six float64 D x D matrices while one is updated or factored
MAX_COVARIANCE_BYTES = 2 << 30


@dataclass
class GASOptions:
    buffer_size: Optional[int] = field(default=None, metadata={
        "ge": 1, "le": 10**6, "help": "uploads per server step (null: the round's participants)"})
    covariance: Literal["diagonal", "full"] = field(default="diagonal", metadata={
        "help": "per-class activation statistics: diagonal variance or full covariance"})
    generate: bool = field(default=True, metadata={
        "help": "top each class up with generated activations (false: plain async SFL)"})
    server_lr: float = field(default=0.01, metadata={"gt": 0, "help": "eta_s (Table 6)"})
    global_lr: float = field(default=1.0, metadata={"gt": 0, "help": "eta_g (1: average)"})
    smoothing: float = field(default=0.005, metadata={"gt": 0, "help": "lambda (Table 6)"})
    directions: int = field(default=1, metadata={
        "ge": 1, "le": 10**4,
        "help": "q directions averaged"})
    direction_kind: Literal["sphere", "gaussian"] = field(default="sphere", metadata={
        "help": "ZO directions u: uniform on the sphere of radius sqrt(d) or with N(0, 1) "
                "entries (gaussian); both have E[u u^T] = I"})
    server_order: Literal["zeroth", "first"] = field(default="zeroth", metadata={
        "help": "zeroth: ZO server steps (paper 001); first: GAS's first-order server"})


# ---------------------------------------------------------------- class statistics

def empty_stats(num_classes: int, dim: int, covariance: str = "diagonal") -> dict:
    """Per-class running statistics: total weight [K], mean [K, D], var [K, D] or
    covariance [K, D, D]."""
    if covariance not in COVARIANCES:
        raise ValueError(f"algorithm.covariance must be one of {COVARIANCES}, "
                         f"got {covariance!r}")
    shape = (num_classes, dim) if covariance == "diagonal" else (num_classes, dim, dim)
    return {"weight": torch.zeros(num_classes, dtype=torch.float64),
            "mean": torch.zeros(num_classes, dim), "var": torch.zeros(shape)}


@torch.no_grad()
def update_stats(stats: dict, h: torch.Tensor, y: torch.Tensor, weight: float) -> None:
    """Fold activations ``h`` [N, ...] with labels ``y`` [N], each of weight ``weight``,
    into ``stats`` (exact pooled weighted mean and population (co)variance per class).
    The statistics stay on the CPU whatever the device of ``h`` (they are small, and the
    activations generated from them then come from the same random stream on every
    device)."""
    full = stats["var"].dim() == 3
    flat, y = h.flatten(1).to("cpu", torch.float64), y.cpu()
    for k in torch.unique(y).tolist():
        f = flat[y == k]
        m = f.mean(0)
        c = f - m
        v = c.T @ c / len(f) if full else (c * c).mean(0)
        w_old = float(stats["weight"][k])
        w_new = w_old + weight * len(f)
        a = w_old / w_new
        mu = stats["mean"][k].to(torch.float64)
        mean = a * mu + (1 - a) * m
        d_old, d_new = mean - mu, mean - m
        if full:
            var = (a * (stats["var"][k].to(torch.float64) + torch.outer(d_old, d_old))
                   + (1 - a) * (v + torch.outer(d_new, d_new)))
        else:
            var = a * (stats["var"][k].to(torch.float64) + d_old ** 2) + (1 - a) * (v + d_new ** 2)
        stats["weight"][k] = w_new
        stats["mean"][k] = mean.to(stats["mean"].dtype)
        stats["var"][k] = var.to(stats["var"].dtype)


def _cholesky(cov: torch.Tensor) -> torch.Tensor:
    """A Cholesky factor of ``cov``, adding a growing diagonal jitter if it is singular;
    NaNs when ``cov`` is not finite (the activations overflowed: the generated ones are
    then NaN, and the run ends ``diverged`` as with diagonal statistics)."""
    if not bool(torch.isfinite(cov).all()):
        return torch.full_like(cov, float("nan"))
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    jitter = 0.0
    for _ in range(12):
        factor, info = torch.linalg.cholesky_ex(cov + jitter * eye)
        if int(info) == 0:
            return factor
        jitter = max(jitter * 10, 1e-8 * float(cov.diagonal().mean().clamp_min(1e-12)))
    raise ValueError("GAS: a class covariance is not positive definite even with jitter")


@torch.no_grad()
def generate(stats: dict, y: torch.Tensor, batch_size: int, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [G, D] and labels [G] that top every class with statistics up to
    ``batch_size`` samples, given the real labels ``y``; drawn from N(mean, var)."""
    num_classes, dim = stats["mean"].shape
    counts = torch.bincount(y.flatten().cpu(), minlength=num_classes)
    full = stats["var"].dim() == 3
    hs, ys = [], []
    for k in range(num_classes):
        need = batch_size - int(counts[k])
        if need <= 0 or float(stats["weight"][k]) == 0:
            continue
        z = torch.randn(need, dim, generator=gen, dtype=stats["mean"].dtype)
        if full:
            z = z @ _cholesky(stats["var"][k].to(torch.float64)).T.to(z.dtype)
        else:
            z = z * stats["var"][k].clamp_min(0).sqrt()
        hs.append(stats["mean"][k] + z)
        ys.append(torch.full((need,), k, dtype=y.dtype))
    if not hs:
        return torch.zeros(0, dim), torch.zeros(0, dtype=y.dtype)
    return torch.cat(hs), torch.cat(ys)


# ---------------------------------------------------------------- the algorithm

class GAS(Algorithm):
    name = "gas"
    reference = ("GAS (Yang and Liu, AAAI 2025) with zeroth-order clients, the baseline of "
                 "paper 001 Sec. 5; docs/design.md 'GAS baseline'")
    Options = GASOptions
    distributed = True
    split = True
    asynchronous = True
    plain_steps = True                    # x - eta G on both sides: no momentum, no decay

    def cut_bytes(self, env, activation_bytes, label_bytes, steps, t=None):
        """Every local step sends h, h+ and h- of each direction (2 q + 1 tensors) and the
        labels, and receives q scalars."""
        return zeroth_order_cut_bytes(env, self.options.directions, activation_bytes,
                                      label_bytes, steps)

    def client_macs(self, env, macs_per_sample, steps, t=None):
        """Every local step runs 2 q + 1 forward passes of the batch (h, and h+- of each
        direction) and no backward pass."""
        return zeroth_order_client_macs(env, self.options.directions, macs_per_sample, steps)

    def check(self, env) -> None:
        """``covariance: full`` fits in :data:`MAX_COVARIANCE_BYTES` at the cut (a
        transformer's cut activation is sequence length x (hidden + 1) values, whose
        square per class is far beyond any memory)."""
        if self.options.covariance != "full":
            return
        dim, k = self._dim(env), env.data.num_classes
        need = k * dim * dim * 4 + 6 * dim * dim * 8
        if need > MAX_COVARIANCE_BYTES:
            raise ConfigError(
                f"algorithm.covariance: full keeps a {dim} x {dim} covariance per class at "
                f"the cut ({k} classes): {need} bytes, more than the "
                f"{MAX_COVARIANCE_BYTES} allowed; use covariance: diagonal, or a cut "
                "(model.cut) with a smaller activation")

    @staticmethod
    def _dim(env) -> int:
        """D, the number of values of one sample's activation at the cut."""
        return int(np.prod(GAS._cut_shape(env)))

    @staticmethod
    def _cut_shape(env) -> tuple[int, ...]:
        """The shape of one sample's activation at the cut."""
        return tuple(output_shape(SplitModel.of(env).client, tuple(env.data.input_shape)))

    def init_state(self, env) -> dict:
        dim = self._dim(env)
        return {**super().init_state(env), "server_steps": 0, "buffer": None,
                "stats": empty_stats(env.data.num_classes, dim, self.options.covariance)}

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """A saved ``buffer`` (None: empty) holds k >= 1 uploads (fewer than
        ``buffer_size``, when set): ``ids`` [k] of clients of the run, ``h`` [k, B, cut
        shape] of floats, ``y`` [k, B] of classes; checked before a resume changes any
        file."""
        template = super().checkpoint_template(env, template, saved)
        cut = self._cut_shape(env)
        bound = self.options.buffer_size
        clients, classes = env.num_clients, env.data.num_classes

        def check(buffer) -> str | None:
            if buffer is None:
                return None
            if not isinstance(buffer, dict) or set(buffer) != {"ids", "h", "y"} or \
                    not all(isinstance(v, torch.Tensor) for v in buffer.values()):
                return "is not a dict of the tensors ids, h and y"
            ids, h, y = buffer["ids"], buffer["h"], buffer["y"]
            if ids.dtype != torch.int64 or ids.dim() != 1 or len(ids) < 1 or \
                    (bound is not None and len(ids) >= bound):
                return (f"holds ids of shape {tuple(ids.shape)}, not 1 to "
                        f"{'buffer_size - 1' if bound else 'k'} client ids")
            k = len(ids)
            if not h.is_floating_point() or h.dim() != 2 + len(cut) or h.shape[0] != k or \
                    tuple(h.shape[2:]) != cut or h.shape[1] < 1:
                return (f"holds activations h of shape {tuple(h.shape)}, not "
                        f"{(k, 'B', *cut)} of floats")
            if y.dtype != torch.int64 or tuple(y.shape) != tuple(h.shape[:2]):
                return f"holds labels y of shape {tuple(y.shape)}, not {tuple(h.shape[:2])}"
            if int(ids.min()) < 0 or int(ids.max()) >= clients:
                return f"holds a client id outside 0..{clients - 1}"
            if int(y.min()) < 0 or int(y.max()) >= classes:
                return f"holds a label outside 0..{classes - 1}"
            return None
        return {**template, "buffer": Rule(check)}

    @torch.no_grad()
    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        o, parts = self.options, SplitModel.of(env)
        ids, n, steps = cohort.ids, cohort.size, rnd.steps
        plans = env.executor(parts.client).plans(ids, steps, env.streams.numpy("batches"))
        base = int(env.streams.numpy("zo").integers(2**62))
        gen = torch.Generator().manual_seed(int(env.streams.numpy("gas").integers(2**62)))
        start = rnd.send(parts.client_state(state["model"]))
        client = ForwardCopies(parts.client, start, n, clock=env.clock, role=CLIENT, ids=ids,
                               placement=env.placement)
        server = ForwardCopies(parts.server, parts.server_state(state["model"]), 1,
                               clock=env.clock, role=SERVER, ids=ids[:1],
                               placement=env.placement)
        stats = {k: v.clone() for k, v in state["stats"].items()}
        size = o.buffer_size or n
        buffer = [] if state["buffer"] is None else [(int(c), h, y) for c, h, y in zip(
            state["buffer"]["ids"].tolist(), state["buffer"]["h"], state["buffer"]["y"])]
        server_steps, server_samples = int(state["server_steps"]), 0
        losses, lr, server_lr = [], env.lr(t), env.lr(t, o.server_lr)
        x_all, y_all = env.data.train.x, env.data.train.y
        queue, uploads = EventQueue(), {}

        def launch(i: int, k: int) -> None:
            """Slot i computes step k's activations and uploads them: an event."""
            cid = int(ids[i])
            rows = torch.from_numpy(plans[i][k]).to(env.device)
            x, y = x_all[rows][None], y_all[rows][None]
            seeds = [derive_seed(base, f"client/{i}/{k}/{j}") for j in range(o.directions)]
            sent = [client.forward(x, slot=i, update_stats=True)]
            sent += zo.probe(lambda p: client.forward(x, p, slot=i), client.params(i), seeds,
                             o.smoothing, o.direction_kind)[0]
            got = [env.transport.upload("activations", [cid], a) for a in sent]
            y_s = env.transport.upload("labels", [cid], y)
            queue.push(float(env.clock.arrival_time([cid])[0]), (i, k, seeds, got, y_s))

        for i in range(n):
            if steps[i] > 0:
                launch(i, 0)
        while len(queue):
            _, (i, k, seeds, got, y) = queue.pop()
            cid = int(ids[i])
            deltas, evals = [], []
            for j in range(len(seeds)):
                f = [per_client_loss(server.forward(got[1 + 2 * j + s], charge_to=[cid]), y)
                     for s in (0, 1)]
                deltas.append(f[0] - f[1])
                evals += f
            losses.append(float(torch.stack(evals).mean()))
            deltas = env.transport.download("scalars", [cid], torch.stack(deltas, dim=1))
            zo.descend_(client.params(i), seeds, deltas / (2 * o.smoothing), lr,
                        o.direction_kind)
            buffer.append((cid, got[0][0], y[0]))
            if len(buffer) >= size:
                server_steps += 1
                server_samples += self._server_step(env, server, stats, buffer, server_steps,
                                                    cid, base, gen, server_lr)
                buffer = []
            if k + 1 < steps[i]:
                launch(i, k + 1)
            else:
                uploads[i] = env.transport.upload(
                    "model", [cid], {key: v[i:i + 1] for key, v in client.state.items()})
        done = sorted(uploads)
        if done:
            rnd.add(np.array(done), {key: torch.cat([uploads[i][key] for i in done])
                                     for key in uploads[done[0]]})
        kept = None if not buffer else {
            "ids": torch.tensor([c for c, _, _ in buffer]),
            "h": torch.stack([h for _, h, _ in buffer]), "y": torch.stack([y for *_, y in buffer])}
        server_state = {k: v[0].clone() for k, v in server.state.items()}
        return rnd.finish(state={"model": server_state, "stats": stats, "buffer": kept,
                                 "server_steps": server_steps},
                          train_loss=float(np.mean(losses)) if losses else float("nan"),
                          server_samples=server_samples, server_macs=server.charged,
                          client_macs=client.charged,
                          metrics={"server_steps": server_steps - int(state["server_steps"])})

    def _server_step(self, env, server: ForwardCopies, stats: dict, buffer, step: int, cid: int,
                     base: int, gen: torch.Generator, lr: float) -> int:
        """One server step on the buffered activations and the generated ones (module doc,
        item 3); charged to the shared lane after ``cid``'s upload. Returns its samples."""
        o = self.options
        h = torch.cat([b[1] for b in buffer])
        y = torch.cat([b[2] for b in buffer])
        update_stats(stats, h, y, float(step))
        if o.generate:
            h_gen, y_gen = generate(stats, y, env.config.train.batch_size, gen)
            if len(y_gen):
                h = torch.cat([h, h_gen.to(h).view(-1, *h.shape[1:])])
                y = torch.cat([y, y_gen.to(y)])
        x, y = h[None], y[None]
        if o.server_order == "first":
            grads = server.first_order_grads(x, y, charge_to=[cid])
        else:
            seeds = [derive_seed(base, f"server/{step}/{j}") for j in range(o.directions)]
            grads = zo.zo_gradient(
                lambda p: per_client_loss(server.forward(x, p, charge_to=[cid]), y),
                server.params(), o.smoothing, seeds, o.direction_kind)
        server.step(grads, lr)
        return int(y.numel())
