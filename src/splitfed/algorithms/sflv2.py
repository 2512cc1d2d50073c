"""SFL-V2: split federated learning with one shared server-side model.

Paper 002 (Han et al., NeurIPS 2024), Appendix B, Algorithm 2. The main server trains a
single server-side model x_s; each participating client n starts the round from the
global client-side model x_c and runs tau = K iterations:

    client n:  h = h(x_c,n; zeta_n)               -> activations and labels up
    server:    x_s <- x_s - (eta / q_n) grad_{x_s} F_n(h, x_s)   (line 12)
               r_c,n = grad_h F_n(h, x_s)          -> cut-layer gradient down
    client n:  x_c,n <- x_c,n - eta g_c,n

after which x_c <- sum_n (a_n / q_n) x_c,n (line 20; the engine's delta form) and the
server keeps its model (line 16). q_n = 1 except under bernoulli participation.

Decisions (docs/design.md): ``order="iteration"`` (default): within every iteration the
server serves the participating clients one at a time, in a fresh random permutation, updating after
each; the cut-layer gradient a client receives is computed with the server model just
before that client's own server update. ``order="per_client"``: each client runs all its
iterations before the next client starts (clients in a random order), as the SplitFed
reference code does. Client forward and backward passes run batched over the cohort; the
server is sequential by definition. Server optimizer state (momentum) persists across
rounds; ``server_lr`` defaults to ``train.lr``.

Simulated time (docs/clock.md): the server's steps
(:func:`~splitfed.engine.split.server_step`) run on its shared lane in the order above.
With a round deadline, a client whose model arrives late is left out of the client-side
aggregation; the server keeps every update it made with that client's activations.

Transforms (:mod:`splitfed.engine.transforms`) act on the client side: a gradient
transform corrects the clients' local steps (FedProx's proximal term, SCAFFOLD's controls
on the client-side model), a server step moves the aggregated client-side model; the
server-side model is trained by the server's own steps above.

Recipe (docs/design.md, SFL training recipes): ``recipe="paper"`` (default) is the
above, with ``train.momentum`` and ``train.weight_decay`` on both sides (the clients'
optimizer state lives for the round, the server's for the run). ``recipe="released_code"``
is the authors' released code: each client's iterations in turn (``per_client`` order;
``order: iteration`` is refused), and the server's optimizer re-created for every batch,
so its momentum never builds: a fresh SGD's first step is x - eta (g + wd x), which the
server takes as SGD without momentum; the server keeps no optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from splitfed.engine.algorithm import Algorithm
from splitfed.engine.batches import gather
from splitfed.engine.rounds import Round
from splitfed.engine.split import (SplitModel, participation_probability, return_gradients,
                                   send_activations, server_opt_template, server_step, sgd)
from splitfed.errors import ConfigError
from splitfed.models.sequential import starts_with_flatten


@dataclass
class SFLV2Options:
    order: Literal["iteration", "per_client"] = field(default="iteration", metadata={
        "help": "iteration: random server order every iteration; per_client: each client "
                "runs all its iterations before the next (always so with "
                "recipe=released_code)"})
    server_lr: Optional[float] = field(default=None, metadata={
        "gt": 0, "help": "server step size eta (null: train.lr)"})
    recipe: Literal["paper", "released_code"] = field(default="paper", metadata={
        "help": "paper: Algorithm 2 as written, the server's optimizer state persists; "
                "released_code: the authors' released code, clients served per_client "
                "and the server's optimizer re-created every batch (no server momentum)"})


class SFLV2(Algorithm):
    name = "sflv2"
    reference = "paper 002 (Han et al. 2024), Appendix B Algorithm 2"
    Options = SFLV2Options
    distributed = True
    split = True
    uses_transforms = True
    state_keys = ("model", "server_opt")

    def init_state(self, env) -> dict:
        return {**super().init_state(env), "server_opt": None}

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """A saved ``server_opt`` is the server optimizer's state dict (or None)."""
        return server_opt_template(env, super().checkpoint_template(env, template, saved))

    def check(self, env) -> None:
        """The released code serves clients one after another: an explicit
        ``order: iteration`` contradicts ``recipe: released_code``."""
        written = env.config.algorithm.options.get("order")
        if self.options.recipe == "released_code" and written == "iteration":
            raise ConfigError("algorithm.order: recipe 'released_code' serves each client's "
                              "iterations in turn; leave order unset or set per_client "
                              "(order: iteration needs recipe: paper)")

    @property
    def order(self) -> str:
        """The serving order of the round: the option, or the recipe's."""
        return "per_client" if self.options.recipe == "released_code" else self.options.order

    def round(self, env, state, t, cohort):
        rnd = Round(self, env, state, t, cohort)
        if rnd.empty:
            return rnd.finish()
        tr = env.config.train
        parts = SplitModel.of(env)
        steps = rnd.steps
        executor = env.executor(parts.client)
        plans = executor.plans(cohort.ids, steps, env.streams.numpy("batches"))
        client_start = rnd.send(parts.client_state(state["model"]))
        server = parts.server_module(parts.server_state(state["model"]))
        server_params = list(server.parameters())
        released = self.options.recipe == "released_code"
        if released:    # the released code's optimizer per batch: SGD without momentum
            opt = torch.optim.SGD(server.parameters(), lr=tr.lr, momentum=0.0,
                                  weight_decay=tr.weight_decay)
        else:
            opt = sgd(server, env, state["server_opt"])
        server_lr = env.lr(t, self.options.server_lr) / participation_probability(
            env, cohort.ids)
        kw = {"momentum": tr.momentum, "weight_decay": tr.weight_decay}
        rng = env.streams.numpy("order")
        order = self.order
        if order == "iteration":
            groups = executor.chunks(steps)
        else:
            groups = [np.array([s]) for s in rng.permutation(cohort.size)]
        clients = [env.stacked(parts.client, client_start, len(g), ids=cohort.ids[g], **kw)
                   for g in groups]
        losses = rnd.losses
        loss_sums = [0.0] * cohort.size     # float64 sums per slot, as losses[slot] += would
        x_all, y_all = env.data.train.x, env.data.train.y
        # a server part that flattens its input first gets each group's activations in C
        # order, copied once: each step's flatten is then a view of the same values, not
        # a copy from the folded layout (any other first layer sees them as they came:
        # a convolution's kernel depends on its input's memory layout)
        flat_first = starts_with_flatten(parts.server)

        def iterate(members: list[int], k: int) -> None:
            """Iteration k for the client groups ``members`` (their active prefixes)."""
            sent = []
            for j in members:
                g = groups[j]
                a = int((steps[g] > k).sum())
                rows = torch.from_numpy(np.stack([plans[s][k] for s in g[:a]]))
                rows = rows.to(env.device)
                acts = clients[j].forward(gather(x_all, rows), a)
                h, y = send_activations(env, cohort.ids[g[:a]], acts, gather(y_all, rows))
                sent.append((j, a, acts, h, y))
            # per served row: (sent entry, row, its activations and labels, slot, step
            # size, client id), as plain Python values once per iteration
            served = [(i, r, h_c[r], y[r], slot, float(server_lr[slot]),
                       int(cohort.ids[slot]))
                      for i, (j, a, _, h, y) in enumerate(sent)
                      for h_c in (h.detach().contiguous() if flat_first else h,)
                      for r, slot in enumerate(groups[j][:a].tolist())]
            grads = [[None] * a for (_, a, _, _, _) in sent]
            for pos in rng.permutation(len(served)).tolist():
                i, r, h_r, y_r, slot, lr_r, cid = served[pos]
                loss, grads[i][r] = server_step(env, server, opt, h_r, y_r, lr_r, cid,
                                                params=server_params)
                loss_sums[slot] += float(loss)
            for (j, a, acts, _, _), g_rows in zip(sent, grads):
                down = return_gradients(env, cohort.ids[groups[j][:a]], torch.stack(g_rows))
                clients[j].step(acts, down, lr=env.lr(t), ids=groups[j][:a], hook=rnd.hook)

        if order == "iteration":
            for k in range(int(steps.max())):
                iterate([j for j, g in enumerate(groups) if steps[g].max() > k], k)
        else:
            for j, g in enumerate(groups):
                for k in range(int(steps[g[0]])):
                    iterate([j], k)
        for g, client in zip(groups, clients):
            rnd.upload(g, client.final())
        losses += torch.tensor(loss_sums, dtype=torch.float64)
        losses /= torch.from_numpy(steps).to(torch.float64)
        server_state = {k: v.detach().clone() for k, v in server.state_dict().items()}
        return rnd.finish(state={"model": server_state,
                                 "server_opt": None if released else opt.state_dict()})
