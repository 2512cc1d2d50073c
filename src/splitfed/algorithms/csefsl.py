"""CSE-FSL: split federated learning with client-side auxiliary networks.

Paper 000 (Talebi 2024), Algorithm 1 (CSE-SFL of its reference [4]). The model is split
into x_C (client side) and x_S (server side); each client also holds a small auxiliary
head x_A on the cut activation, so x = (x_C, x_A) trains on the local loss F_i^c without
the server. Every round t the sampled clients S_t start from the global (x_C, x_A) and
run K local steps (lines 31-43):

    z_f = x_C,i^k(xi^k);   F_i^c = CE(x_A,i^k(z_f), y)
    x_C,i^{k+1} = x_C,i^k - mu_L grad_{x_C} F_i^c,  x_A,i^{k+1} = x_A,i^k - mu_L grad_{x_A} F_i^c

In rounds with t mod l = 0 and t != 0 (line 8) each client also uploads the smashed data
z_f,i of its first local step (computed with x_C,i^0, before its own update) and the
labels (lines 25-26). The server serves the uploads one at a time on its single model
(lines 9-16):

    z_b,i = grad_{z_f} F_i^s(x_S; z_f,i, y_i)      -> down when ``server_feedback``
    x_S <- x_S - (mu / m) grad_{x_S} F_i^s(x_S; z_f,i, y_i)

and with ``server_feedback`` the client's first step backpropagates z_b,i through x_C
while x_A,i^1 = x_A,i^0 (lines 27-30). At the end of the round x_C and x_A are averaged
(line 6, the engine's delta form with the cohort's weights); x_S is never averaged.

Decisions (docs/design.md and this file):

- Rounds: the paper's t = 0..T-1 is our t - 1 (our rounds are 1-based), so uploads
  happen in rounds t = 1 + l, 1 + 2l, ...: rounds 1..l train on the auxiliary loss only,
  as paper rounds 0..l-1 do.
- ``server_feedback`` (default true, Algorithm 1): false is the original CSE-FSL, with
  no gradient download; the first step is then an ordinary auxiliary step on the
  uploaded batch.
- m in mu / m (line 16): ``server_scale="cohort"`` divides by the number of uploads of
  the round (the cohort size, repeats counted), the paper's m under full participation;
  ``"population"`` by the number of clients N (line 16 read literally with line 77's
  [S] = {0..m-1}); ``"none"`` uses mu, the update of the proofs (eqs. A38, A48).
- Order (line 9 says "in sequence" and fixes none): ``order="random"`` draws a fresh
  permutation of the uploads from the ``order`` stream in every upload round;
  ``"cohort"`` serves them in cohort order (draw order under ``with_replacement``).
- z_b,i is computed with the server model just before client i's own server update
  (lines 14-16). Server optimizer state persists across rounds; client and auxiliary
  optimizer state is fresh each round; ``server_lr`` (mu) defaults to ``train.lr``.
- Every slot of a with-replacement sample is a separate copy with its own batches and
  its own server update.
- The auxiliary head (``aux``: one linear layer on the flattened cut activation, or an
  MLP with ``aux_hidden`` units) is initialised from the run seed (stream ``aux``).
  Evaluation uses x_C composed with x_S, never the head; ``aux_test_acc`` reports the
  head's own accuracy on every evaluated round in which clients trained.
- Accounting: one server copy (``server_copies`` = 1, the base default); the server's
  MACs count only the uploaded samples (``server_samples``); the clients' MACs
  (``client_macs``) are what their parts and heads charged the clock: a forward and a
  backward pass of both per local sample, less the head's backward pass on the first
  step of an upload round with ``server_feedback``.
- Batched: client parts and heads are stacked per chunk. Rounds without uploads train
  one chunk at a time; in upload rounds every chunk's first-step graph waits for the
  sequential server pass.
- Simulated time (docs/clock.md): the server pass runs on the shared server lane
  (:func:`~splitfed.engine.split.server_step`); without feedback it overlaps the
  clients' local steps. With a round deadline a client whose (x_C, x_A) arrive late is
  left out of both averages; the server keeps its update with that client's upload.
- Transforms (:mod:`splitfed.engine.transforms`) act on x_C: a gradient transform
  corrects its local steps, the server steps move its aggregate; x_A is averaged plainly.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
from torch import nn

from splitfed.engine.aggregate import DeltaAccumulator
from splitfed.engine.algorithm import Algorithm
from splitfed.engine.evaluate import evaluate
from splitfed.engine.flops import TRAIN_FACTOR, forward_macs
from splitfed.engine.loop import evaluates
from splitfed.engine.placement import client_values
from splitfed.engine.rounds import Round
from splitfed.engine.split import (SplitModel, per_client_loss, return_gradients, send_activations,
                                   server_opt_template, server_step, sgd)
from splitfed.models import output_shape
from splitfed.models.aux import build_aux_head
from splitfed.rng import derive_seed

#: forward MACs of one sample through the auxiliary head, per client part and head shape
_HEAD_MACS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class CSEFSLOptions:
    period: int = field(default=1, metadata={
        "ge": 1, "le": 10**6, "help": "l: uploads in rounds t with (t - 1) mod l = 0 and t > 1"})
    server_feedback: bool = field(default=True, metadata={
        "help": "send the cut-layer gradient back for the client's first step "
                "(Algorithm 1); false: original CSE-FSL, nothing comes down"})
    server_lr: Optional[float] = field(default=None, metadata={
        "gt": 0, "help": "server step size mu (null: train.lr)"})
    server_scale: Literal["cohort", "population", "none"] = field(default="cohort", metadata={
        "help": "m in mu/m: cohort: uploads this round; population: all clients; none: 1"})
    order: Literal["random", "cohort"] = field(default="random", metadata={
        "help": "server order of the uploads: fresh random permutation, or cohort order"})
    aux: Literal["linear", "mlp"] = field(default="linear", metadata={
        "help": "auxiliary head: one linear layer, or linear-ReLU-linear"})
    aux_hidden: int = field(default=128, metadata={
        "ge": 1, "le": 10**5, "help": "hidden units of the mlp auxiliary head"})


class _Chunk:
    """One chunk of the cohort: stacked client models and their auxiliary heads."""

    def __init__(self, parts, head, client_start, aux_start, slots, ids, steps, plans, tr,
                 env):
        n = len(slots)
        self.slots, self.ids, self.steps, self.plans = slots, ids, steps, plans
        kw = {"momentum": tr.momentum, "weight_decay": tr.weight_decay, "ids": ids}
        self.client = env.stacked(parts.client, client_start, n, **kw)
        self.aux = env.stacked(head, aux_start, n, **kw)
        self.loss_sum = torch.zeros(n, dtype=torch.float64)
        self.first = None                     # (acts, labels) of an uploaded first step

    def forward(self, env, k: int):
        """Client forward of local step ``k`` for the copies still working."""
        a = int((self.steps > k).sum())
        rows = torch.from_numpy(np.stack([p[k] for p in self.plans[:a]])).to(env.device)
        return self.client.forward(env.data.train.x[rows], a), env.data.train.y[rows]

    def aux_losses(self, acts, y):
        losses = per_client_loss(self.aux.forward(acts, acts.shape[0]), y)
        self.loss_sum[:acts.shape[0]] += losses.detach().to(torch.float64).cpu()
        return losses

    def aux_step(self, acts, y, lr: float, hook=None) -> None:
        """Lines 32-35 / 39-42: x_C and x_A both step on the auxiliary loss (a gradient
        transform ``hook`` corrects x_C's step)."""
        (g_acts,) = self.aux.step(self.aux_losses(acts, y).sum(), lr=lr,
                                  extra_inputs=[acts])
        self.client.step(acts, g_acts, lr=lr, ids=self.slots[:acts.shape[0]], hook=hook)

    def upload_first(self, env):
        """Lines 25-26: the first step's smashed data and labels go up."""
        acts, y = self.forward(env, 0)
        self.first = (acts, y)
        return send_activations(env, self.ids[:acts.shape[0]], acts, y)

    def train(self, env, lr: float, g_first=None, hook=None) -> None:
        """K local steps; ``g_first``: the server's z_b for the uploaded first step."""
        acts, y = self.first if self.first is not None else self.forward(env, 0)
        self.first = None
        if g_first is None:
            self.aux_step(acts, y, lr, hook)
        else:                                 # lines 27-30: server gradient, x_A kept
            with torch.no_grad():
                self.aux_losses(acts.detach(), y)
            self.client.step(acts, g_first, lr=lr, ids=self.slots[:acts.shape[0]], hook=hook)
        for k in range(1, int(self.steps[0])):
            self.aux_step(*self.forward(env, k), lr, hook)


class CSEFSL(Algorithm):
    name = "csefsl"
    reference = "paper 000 (Talebi 2024), Algorithm 1 (CSE-FSL with auxiliary networks)"
    Options = CSEFSLOptions
    distributed = True
    split = True
    uses_transforms = True
    state_keys = ("model", "aux", "server_opt")

    def uploads(self, t: int) -> bool:
        """Line 8 with the paper's round t - 1: (t - 1) mod l = 0 and t - 1 != 0."""
        return t > 1 and (t - 1) % self.options.period == 0

    def _upload_share(self, env, t: int | None) -> float:
        """1 in an upload round ``t``, else 0; ``t`` None: the share of the run's rounds
        that upload ((rounds - 1) // period of them)."""
        if t is None:
            return ((env.config.rounds - 1) // self.options.period) / env.config.rounds
        return int(self.uploads(t))

    def cut_bytes(self, env, activation_bytes, label_bytes, steps, t=None):
        """In an upload round every client sends one batch, its first step's activations
        and labels, and with ``server_feedback`` receives their gradient, whatever its
        number of steps; in the other rounds nothing crosses the cut. ``t`` None: the
        average over the run's rounds ((rounds - 1) // period of them upload)."""
        b, share = env.config.train.batch_size, self._upload_share(env, t)
        down = activation_bytes if self.options.server_feedback else 0
        return (0 * steps + share * b * (activation_bytes + label_bytes),
                0 * steps + share * b * down)

    def client_macs(self, env, macs_per_sample, steps, t=None):
        """Every local step is a forward and a backward pass of the client part and of
        the auxiliary head on its batch; in an upload round with ``server_feedback`` the
        first step backpropagates the server's gradient through the client part instead,
        and the head only evaluates its loss (one forward pass, no backward). ``t`` None:
        the average over the run's rounds ((rounds - 1) // period of them upload)."""
        b, head = env.config.train.batch_size, self.head_macs(env)
        share = self._upload_share(env, t) if self.options.server_feedback else 0
        return (steps * b * (macs_per_sample + TRAIN_FACTOR * head)
                - share * b * (TRAIN_FACTOR - 1) * head)

    def head_macs(self, env) -> int:
        """Forward MACs of one sample through the auxiliary head (:meth:`head`)."""
        client = SplitModel.of(env).client
        key = (self.options.aux, self.options.aux_hidden, env.data.num_classes,
               tuple(env.data.input_shape))
        per = _HEAD_MACS.setdefault(client, {})
        if key not in per:
            cut = tuple(output_shape(client, tuple(env.data.input_shape)))
            per[key] = forward_macs(self.head(env, client), cut)
        return per[key]

    def head(self, env, client: nn.Module) -> nn.Module:
        """The auxiliary head on ``client``'s output, initialised from the run seed (in
        float32), in the dtype of the client part's parameters (a model of
        ``model.dtype`` bfloat16 gives bfloat16 activations)."""
        dtype = next((p.dtype for p in client.parameters() if p.is_floating_point()),
                     torch.get_default_dtype())
        if env.device.type != "cpu":              # the head's dry run builds CPU inputs
            client = copy.deepcopy(client).cpu()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(env.streams.seed, "aux"))
            head = build_aux_head(client, env.data.input_shape, env.data.num_classes,
                                  kind=self.options.aux, hidden=self.options.aux_hidden)
        return head.to(device=env.device, dtype=dtype)

    def init_state(self, env) -> dict:
        head = self.head(env, SplitModel.of(env).client)
        aux = {k: v.detach().clone() for k, v in head.state_dict().items()}
        return {**super().init_state(env), "aux": aux, "server_opt": None}

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """A saved ``server_opt`` is the server optimizer's state dict (or None)."""
        return server_opt_template(env, super().checkpoint_template(env, template, saved))

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        tr = env.config.train
        parts = SplitModel.of(env)
        head = self.head(env, parts.client)
        steps = rnd.steps
        executor = env.executor(parts.client)
        plans = executor.plans(cohort.ids, steps, env.streams.numpy("batches"))
        client_start = rnd.send(parts.client_state(state["model"]))
        aux_start = env.transport.broadcast("model", cohort.ids, state["aux"])
        chunks = (_Chunk(parts, head, client_start, aux_start, s, cohort.ids[s], steps[s],
                         [plans[i] for i in s], tr, env) for s in executor.chunks(steps))
        server_state, metrics, new = parts.server_state(state["model"]), {}, {}
        grads: dict[int, torch.Tensor] = {}
        if self.uploads(t):
            chunks = list(chunks)                 # first steps wait for the server
            sent = [c.upload_first(env) for c in chunks]
            server_state, g_h, metrics["server_loss"], new["server_opt"] = self._serve_all(
                env, state, t, chunks, sent)
            if self.options.server_feedback:
                grads = {i: return_gradients(env, c.ids[:len(g)], g)
                         for i, (c, g) in enumerate(zip(chunks, g_h))}
        aux_acc = DeltaAccumulator(state["aux"], renormalise=env.clock.renormalise)
        lr, charged = env.lr(t), 0
        for i, chunk in enumerate(chunks):        # lazily built: one chunk in memory
            chunk.train(env, lr, grads.get(i), rnd.hook)
            charged += chunk.client.charged + chunk.aux.charged
            client_up = env.transport.upload("model", chunk.ids, chunk.client.final())
            aux_up = env.transport.upload("model", chunk.ids, chunk.aux.final())
            keep = env.clock.on_time(chunk.ids)
            rnd.add(chunk.slots, client_up, client_values(
                env.placement, chunk.ids,
                chunk.loss_sum / torch.from_numpy(chunk.steps).to(torch.float64)), keep=keep)
            rnd.collect(chunk.slots, chunk.client.final())
            aux_acc.add(rnd.weights[torch.from_numpy(chunk.slots)], aux_up, keep=keep)
        uploaded = cohort.size if self.uploads(t) else 0
        result = rnd.finish(state={**new, "model": server_state, "aux": aux_acc.result()},
                            server_samples=uploaded * tr.batch_size, metrics=metrics,
                            client_macs=charged)
        if evaluates(env.config, t):
            result.metrics.update(self._aux_eval(env, parts, head, result.state))
        return result

    def _serve_all(self, env, state, t, chunks, sent):
        """Lines 9-17: one server update per upload, in sequence, on the single x_S."""
        parts = SplitModel.of(env)
        server = parts.server_module(parts.server_state(state["model"]))
        server_params = list(server.parameters())
        opt = sgd(server, env, state["server_opt"])
        where = {int(s): (i, r) for i, c in enumerate(chunks) for r, s in enumerate(c.slots)}
        served = np.array(sorted(where))          # cohort positions of the uploads
        if self.options.order == "random":
            served = served[env.streams.numpy("order").permutation(len(served))]
        divisor = {"cohort": len(served), "population": env.num_clients,
                   "none": 1}[self.options.server_scale]
        lr = env.lr(t, self.options.server_lr) / divisor
        grads = [torch.zeros_like(h) for h, _ in sent]
        total = 0.0
        for s in served:
            i, r = where[int(s)]
            h, y = sent[i]
            loss, grads[i][r] = server_step(env, server, opt, h[r], y[r], lr,
                                            chunks[i].ids[r], params=server_params)
            total += float(loss)
        server_state = {k: v.detach().clone() for k, v in server.state_dict().items()}
        return server_state, grads, total / len(served), opt.state_dict()

    def _aux_eval(self, env, parts, head, state) -> dict[str, float]:
        """Test accuracy of the global client model with the global auxiliary head."""
        head.load_state_dict(state["aux"])
        net = nn.Sequential(parts.client_module(parts.client_state(state["model"])), head)
        test = env.data.test
        res = evaluate(net, test.x, test.y, env.config.engine.eval_batch_size)
        return {"aux_test_acc": res["test_acc"], "aux_test_loss": res["test_loss"]}
