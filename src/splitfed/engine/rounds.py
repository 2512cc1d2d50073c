"""The common prologue and epilogue of a round, and what a round returns.

Every federated and split algorithm does the same around its own client work: keep the
model when nobody was sampled, send the clients their start, collect what they upload,
aggregate the on-time uploads with the cohort's weights (:class:`~splitfed.engine.
aggregate.DeltaAccumulator`), average the clients' training losses, and then move the
global model with the server steps (:mod:`splitfed.engine.transforms`). :class:`Round`
does all of it once; an algorithm's ``round`` only trains::

    rnd = Round(self, env, state, t, cohort)
    if rnd.empty:
        return rnd.finish()
    start = rnd.send(part)                            # broadcast, transforms begin
    for chunk in env.executor(env.model).train(start, cohort.ids, rnd.steps,
                                               lr=env.lr(t), hook=rnd.hook, ...):
        rnd.upload(chunk.slots, chunk.state, chunk.loss)
    return rnd.finish()

:class:`RoundResult` is what ``round`` returns to the loop: the new state, the mean
training loss, the training samples of the clients (``samples``), of the server-side
model (``server_samples``, None: the same as the clients') and of the whole model on the
server (``server_model_samples``: server data; they become the MAC counts), the
multiply-accumulates of the server-side model when the algorithm counts them itself
(``server_macs``: a server that does other work per sample than a forward and a backward
pass, such as MU-SplitFed's forward-only zeroth-order steps), those of the clients
likewise (``client_macs``: zeroth-order clients, CSE-FSL's auxiliary heads) and any
further metrics, logged as they are. The round loop checks every result
(:func:`splitfed.engine.loop.check_result`): the state keeps the keys ``init_state``
declared, ``train_loss`` is None or a real number, the metrics are numbers (or None).
To add to a result after ``rnd.finish()``, replace its fields with
``dataclasses.replace(result, state={**result.state, "model": model},
metrics={**result.metrics, "norm": 1.0})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from splitfed.engine.aggregate import DeltaAccumulator, Uploads
from splitfed.engine.transforms import StepContext, describe, start_gradients, tensor_mismatch
from splitfed.metrics import metric_problem
from splitfed.origins import call_plugin


@dataclass
class RoundResult:
    """What one round returns to the loop (module doc)."""

    state: dict
    train_loss: float | None = None
    samples: int = 0
    server_samples: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: samples on which the server trained (or took the gradient of) the WHOLE model:
    #: server epochs on its own data, FedCLG's g_s; priced at the whole model's MACs
    server_model_samples: int = 0
    #: MACs of the server side of the split model in the round (all its copies), when the
    #: algorithm counts them itself (what its server's passes charged the clock); None:
    #: ``server_samples`` x a forward and a backward pass of the server side
    server_macs: int | None = None
    #: MACs of the clients in the round (all of them), when the algorithm counts them
    #: itself (what their passes charged the clock); None: ``samples`` x a forward and a
    #: backward pass of the clients' part
    client_macs: int | None = None

    def record(self) -> dict[str, float]:
        """The metrics the loop logs for the round (samples become MACs there)."""
        out = {} if self.train_loss is None else {"train_loss": self.train_loss}
        return {**out, **self.metrics}


class SingleDelta:
    """The aggregate of one model that replaces ``reference`` (SL's last hand-over):
    ``result(eta) = x + eta (last - x)`` in the model's own precision (paper 003 eq. 4)."""

    count = 1
    scale = 1.0

    def __init__(self, reference: dict[str, torch.Tensor], last: dict[str, torch.Tensor]):
        self.reference, self.last = reference, last

    def result(self, global_lr: float = 1.0) -> dict[str, torch.Tensor]:
        return {k: (v + global_lr * (self.last[k] - v)) if v.is_floating_point()
                else self.last[k].clone() for k, v in self.reference.items()}

    def delta(self) -> dict[str, torch.Tensor]:
        return {k: self.last[k] - v for k, v in self.reference.items() if v.is_floating_point()}

    def uploads(self) -> Uploads:
        """The one model, with weight 1 (as :meth:`DeltaAccumulator.uploads`)."""
        return Uploads({k: self.last[k].detach().clone().unsqueeze(0) for k in self.reference},
                       torch.ones(1, dtype=torch.float64), None)


class Round:
    """One round's common parts for ``algorithm`` (module doc).

    On creation it draws the server's data of the round (D_s^t, for algorithms whose
    steps train on it) and, unless the cohort is empty, opens the gradient transforms'
    round. Attributes: ``model`` (x_t, the global model), ``steps`` (K per cohort slot),
    ``weights`` (the cohort's aggregation weights), ``losses`` (per slot),
    ``server_rows`` (D_s^t or None), ``grad`` (the transforms' round, or None),
``start`` (what the clients now training started from),
    ``metrics`` (extra metrics of the round).
    """

    def __init__(self, algorithm, env, state: dict, t: int, cohort):
        self.algorithm, self.env, self.state, self.t, self.cohort = (
            algorithm, env, state, t, cohort)
        self.model = state["model"]
        self.states = {k: state[k] for k in algorithm.transform_keys() if k in state}
        self.server_rows = (algorithm.draw_server_data(env)
                            if algorithm.needs_server_data else None)
        self.empty = cohort.is_empty()
        self.metrics: dict[str, float] = {}
        self.server_samples: int | None = None
        self.acc = None
        self.grad, self._rounds = None, []
        if self.empty:
            return
        self.weights = torch.tensor(cohort.weights, dtype=torch.float64)
        self.steps = env.local_steps(cohort.ids)
        self.samples = int(self.steps.sum()) * env.config.train.batch_size
        self.losses = torch.zeros(cohort.size, dtype=torch.float64)
        self.grad, self._rounds = start_gradients(algorithm.gradient_transforms, env,
                                                  self.states, t, cohort, self)

    @property
    def hook(self):
        """The chained gradient correction for the executor / stacked models, or None."""
        return None if self.grad is None else self.grad.update

    def send(self, part: dict[str, torch.Tensor], *, reference=None) -> dict[str, torch.Tensor]:
        """Broadcast the clients' trained ``part`` to the cohort; the uploads are
        aggregated against it (or ``reference``, which may hold more: SFL-V1's server
        copies); the gradient transforms begin from what the clients received."""
        received = self.env.transport.broadcast("model", self.cohort.ids, part)
        self.aggregate_against(part if reference is None else reference)
        self.begin(np.arange(self.cohort.size), received)
        return received

    def begin(self, slots, start) -> None:
        """The clients at cohort ``slots`` start local training from ``start`` (their
        trained part as received; ``self.start`` for the transforms)."""
        self.start = start
        if self.grad is not None:
            self.grad.begin(np.asarray(slots), start)

    def aggregate_against(self, reference) -> None:
        """Aggregate against ``reference`` (a dict: a weighted delta accumulator), or use
        the given aggregate object (:class:`SingleDelta`)."""
        if isinstance(reference, dict):
            keep = any(getattr(step, "needs_uploads", False)
                       for step in self.algorithm.server_steps)
            self.acc = DeltaAccumulator(reference, renormalise=self.env.clock.renormalise,
                                        keep_uploads=keep)
        else:
            self.acc = reference

    def upload(self, slots: np.ndarray, final: dict[str, torch.Tensor], loss=None, *,
               ids=None) -> dict:
        """The clients at cohort ``slots`` upload ``final`` (their stacked trained part);
        the on-time ones enter the aggregate with their weights; ``loss`` [slots] are
        their training losses; the transforms collect the final states."""
        slots = np.asarray(slots)
        ids = self.cohort.ids[slots] if ids is None else ids
        uploaded = self.env.transport.upload("model", ids, final)
        self.add(slots, uploaded, loss, ids=ids)
        self.collect(slots, final)
        return uploaded

    def add(self, slots, values: dict[str, torch.Tensor], loss=None, *, ids=None,
            keep=None) -> None:
        """Aggregate ``values`` (stacked, as the server holds them: what arrived, and
        server-side copies) of the on-time clients at cohort ``slots``; record their
        training losses ``loss``. ``keep``: which arrived in time (default: asked of
        the clock now)."""
        slots = np.asarray(slots)
        ids = self.cohort.ids[slots] if ids is None else ids
        self.acc.add(self.weights[torch.from_numpy(slots)], values,
                     keep=self.env.clock.on_time(ids) if keep is None else keep, ids=ids)
        if loss is not None:
            self.losses[torch.from_numpy(slots)] = loss.to(torch.float64).cpu()

    def collect(self, slots, final: dict[str, torch.Tensor]) -> None:
        """The transforms see the clients' final trained part (before aggregation)."""
        if self.grad is not None:
            self.grad.collect(np.asarray(slots), final)

    def finish(self, *, state: dict | None = None, train_loss: float | None = None,
               samples: int | None = None, server_samples: int | None = None,
               metrics: dict | None = None, server_macs: int | None = None,
               client_macs: int | None = None) -> RoundResult:
        """The epilogue: the server steps on the aggregate (none but server training in
        an empty round), the transforms' new states, the result. ``state``: further
        entries of the new state (other model parts go under ``state["model"]``);
        ``server_macs`` and ``client_macs``: :attr:`RoundResult.server_macs` and
        :attr:`RoundResult.client_macs`."""
        algo, env = self.algorithm, self.env
        if not self.empty and self.acc is None:
            from splitfed.engine.algorithm import describe
            from splitfed.errors import PluginError

            raise PluginError(f"algorithm.name: {describe(algo, env)}: Round.finish() was "
                              f"called in round {self.t} for a cohort of {self.cohort.size} "
                              "client(s) before Round.send() (or aggregate_against()): "
                              "there is no aggregate to finish; send the clients their part "
                              "first, or finish at once only when rnd.empty")
        new = {**self.state, **(state or {})}
        model = {**self.model, **new.get("model", {})}
        ctx = StepContext(env, self.t, self.acc, None, self)
        steps = algo.server_steps
        if not self.empty:
            first, steps = steps[0], steps[1:]
            model = self._step(first, ctx, model)
            if self.grad is not None:
                model = {**model, **self.grad.adjust(model, self.acc)}
        for step in steps:
            if not self.empty or step.on_empty:
                model = self._step(step, ctx, model)
        new["model"] = model
        for tr, r in zip(algo.gradient_transforms, self._rounds):
            s = None if r is None else r.finish()
            if s is not None:
                self.states[tr.key] = s
        new.update(self.states)
        extra = {**(metrics or {}), **self.metrics, **ctx.metrics}
        whole = ctx.server_samples + (self.grad.server_samples if self.grad is not None else 0)
        if self.empty:
            return RoundResult(new, train_loss, samples or 0, server_samples, extra, whole,
                               server_macs, client_macs)
        client = self.samples + (self.grad.samples if self.grad is not None else 0)
        return RoundResult(new, float(self.losses.mean()) if train_loss is None else train_loss,
                           client if samples is None else samples, server_samples, extra,
                           whole, server_macs, client_macs)

    def _step(self, step, ctx, model):
        ctx.state = self.states.get(step.key)
        before = dict(ctx.metrics)
        new = call_plugin("transform", step.name, "algorithm.server_transforms", step.update,
                          ctx, model)
        _check_step(step, model, new)
        for key, value in ctx.metrics.items():   # the step's own: its mistake, named
            problem = None if before.get(key, ctx) is value else metric_problem(key, value)
            if problem is not None:
                from splitfed.errors import PluginError

                raise PluginError(f"algorithm.server_transforms: the update of "
                                  f"{describe(step)} set {problem}")
        out = {**model, **new}
        if ctx.state is not None:
            self.states[step.key] = ctx.state
        return out


def _check_step(step, model: dict, new) -> None:
    """What server step ``step`` returned for ``model``: a mapping of some of its tensors'
    names to tensors of the same shapes, dtypes and devices
    (:func:`~splitfed.engine.transforms.tensor_mismatch`); anything else raises
    :class:`~splitfed.errors.PluginError` naming the step (and its plugin)."""
    from splitfed.errors import PluginError

    def bad(what: str) -> PluginError:
        return PluginError(f"algorithm.server_transforms: the update of {describe(step)} "
                           f"{what}; it must return a dict of the model's tensors it changes "
                           "(names of the model it was given, each of its shape and dtype)")

    if not isinstance(new, Mapping):
        raise bad(f"returned {type(new).__name__}")
    for name, value in new.items():
        if name not in model:
            raise bad(f"returned {name!r}, which is not a tensor of the model")
        problem = tensor_mismatch(value, model[name], repr(name), "tensor")
        if problem is not None:
            raise bad(problem)
