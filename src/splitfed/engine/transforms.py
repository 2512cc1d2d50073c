"""Composable pieces of a round: gradient transforms (client side) and server steps.

Every federated and split algorithm of the engine trains its clients with the same local
step and moves its global model with the same aggregation; what distinguishes FedProx,
SCAFFOLD, FedOpt, CLG-SGD or FedCLG from FedAvg is a small object plugged into one of
two places, and the same objects plug into SL, SFL-V1, SFL-V2 and CSE-FSL:

- a :class:`GradientTransform` corrects the clients' local gradients (FedProx's proximal
  term, SCAFFOLD's control variates, FedCLG-C's server-gradient correction). ``init``
  builds its state (kept in the algorithm state under the transform's ``key``, e.g.
  SCAFFOLD's controls); ``start`` opens a round and returns a :class:`GradientRound`
  whose ``update(names, params, grads, slots)`` maps the stacked gradients of the
  clients in cohort ``slots`` before every optimizer step, or just that function;
- a :class:`ServerStep` computes the new global model of the trained part from the
  round's aggregate (:class:`~splitfed.engine.aggregate.DeltaAccumulator`, or any
  object with ``reference``, ``result(eta)``, ``delta()``, ``count`` and, for a step
  with ``needs_uploads``, ``uploads()``, each client's upload and weight): the global
  learning rate (:class:`Rate`, the default: x + eta_g * sum_n w_n (x_n - x)), server
  momentum (:class:`Momentum`), FedOpt's adaptive optimizers, or, after the aggregation,
  training on the server's own data (CLG-SGD's eq. 5).

Transforms chain: several gradient transforms add their corrections in order
(:func:`start_gradients`), and the server steps run in order, each from the model the previous
one returned (the first one from the aggregate's reference, x_t).

A config names them next to the algorithm (``algorithm.client_transforms`` and
``algorithm.server_transforms``, lists of ``{name: ..., option: value}``), so that
SFL-V2 with FedProx's proximal term is ``{name: sflv2, client_transforms: [{name: prox,
mu: 0.01}]}``; the registry :data:`splitfed.algorithms.TRANSFORMS` lists them and a
plugin adds its own with :func:`splitfed.register_transform` (``docs/extending.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from splitfed.origins import call_plugin, component

#: ``update(names, params, grads, slots) -> grads``: the gradient correction of the
#: active copies before the optimizer step. ``params`` and ``grads`` are stacked over
#: the clients at cohort positions ``slots`` ([a, ...] per parameter).
Update = Callable[[Sequence[str], list[torch.Tensor], list[torch.Tensor], np.ndarray],
                  list[torch.Tensor]]


@dataclass
class NoOptions:
    """This transform has no options."""


class GradientRound:
    """One round of a gradient transform, seen from the engine.

    The algorithm calls ``begin(slots, start)`` when the clients at cohort positions
    ``slots`` start local training from ``start`` (their client-side state as received),
    ``update`` before every optimizer step, ``collect(slots, final)`` with their final
    stacked states once they are done (before the aggregation), and ``finish()`` at the
    end of the round, which returns the transform's new state (None: unchanged).
    ``adjust(model, aggregate)`` may correct the aggregated model before the later server
    steps (FedCLG-S). ``samples`` and ``server_samples`` count extra training samples the
    transform made the clients or the server process (the server's on the whole model;
    they enter the MAC counts).
    """

    samples: int = 0
    server_samples: int = 0

    def begin(self, slots: np.ndarray, start: dict[str, torch.Tensor]) -> None:
        self.start = start

    def update(self, names, params, grads, slots):
        return grads

    def collect(self, slots: np.ndarray, final: dict[str, torch.Tensor]) -> None:
        return

    def adjust(self, model: dict[str, torch.Tensor], aggregate) -> dict[str, torch.Tensor]:
        return model

    def finish(self) -> dict | None:
        return None


class _FunctionRound(GradientRound):
    """A round whose transform is a plain function of the gradients."""

    def __init__(self, fn: Update):
        self.update = fn


class Transform:
    """What gradient transforms and server steps share: a ``name`` (also the key of
    their state in the algorithm state), an ``Options`` dataclass, and ``init``."""

    name: ClassVar[str] = ""
    #: the paper and equation it implements
    reference: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: False when the multi-process runtime cannot run it
    distributed: ClassVar[bool] = True
    #: True when it reads the server's own data (hybrid FL)
    needs_server_data: ClassVar[bool] = False

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()

    @property
    def key(self) -> str:
        """Where its state lives in the algorithm state."""
        return self.name

    def init(self, env, params: dict[str, torch.Tensor]) -> dict | None:
        """Its state at round 0 from the trained part it acts on (``params``: parameters
        only, by name); None: no state."""
        return None

    def checkpoint_template(self, env, template, saved):
        """What its saved state must look like (default: ``template``, from ``init``)."""
        return template


class GradientTransform(Transform):
    """A correction of the clients' local gradients (module doc). Subclasses set ``name``
    and ``Options`` and implement ``start``; ``init`` when they keep state."""

    #: False when it needs the whole model on the clients (no split algorithm takes it)
    splits: ClassVar[bool] = True
    #: True when its round's ``adjust`` acts at the global rate of the plain aggregating
    #: step (``rate``, ``algorithm.global_lr``), which must then aggregate (FedCLG-S,
    #: eq. 11); an algorithm whose aggregating step is another (momentum, FedOpt)
    #: refuses it
    needs_rate: ClassVar[bool] = False

    def message_bytes(self, env, part_bytes: int) -> tuple[int, int]:
        """The bytes (down, up) a participant exchanges for this transform in a round,
        beyond its part of the model (``part_bytes``, each way): what the run's ledger
        will record of its messages, for over-selection's prediction and ``--dry-run``.
        Default: none."""
        return 0, 0

    def client_samples(self, env, ids: np.ndarray) -> int | np.ndarray:
        """The training samples (a forward and a backward pass each, of the part the
        clients train) that the clients ``ids`` (one entry per cohort slot) compute in a
        round for this transform beyond their local steps: what its round charges the
        clock for them (role ``client``) and counts in its ``samples``, for
        over-selection's prediction and ``--dry-run``'s compute (each sample costs the
        algorithm's MACs per training sample). One number for every client, or one per
        id. Default: none (FedCLG's g^i_t pass, with ``client_gradient: fresh_batch`` or
        ``full``, has some)."""
        return 0

    def start(self, env, state: dict | None, t: int, cohort,
              round_) -> GradientRound | Update | None:
        """Open round ``t`` for ``cohort``; ``round_`` is the :class:`~splitfed.engine.
        rounds.Round` (the global model ``round_.model``, the server's data rows
        ``round_.server_rows``, what the clients started from ``round_.start``). None: no
        correction this round."""
        raise NotImplementedError


class ServerStep(Transform):
    """One step of the server's update chain (module doc). ``update`` returns the new
    values of the trained part's tensors and may replace its own state in ``ctx``."""

    #: True for a step that turns the aggregate into a model (rate, momentum, FedOpt):
    #: a chain has one, first; False for steps that train the model further (server data)
    aggregates: ClassVar[bool] = True
    #: whether it runs in a round whose cohort is empty (nothing was aggregated)
    on_empty: ClassVar[bool] = False
    #: True for a step that reads each client's upload (``ctx.aggregate.uploads()``: a
    #: median, a trimmed mean), not only their weighted sum; the round then keeps a copy
    #: of every aggregated upload
    needs_uploads: ClassVar[bool] = False

    def update(self, ctx: StepContext, model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


@dataclass
class StepContext:
    """What a server step sees: the run's environment, the round, the aggregate of the
    clients' trained part, its own state (``state``; assign a new dict to change it) and
    the round's metrics it may add to (``metrics``)."""

    env: Any
    t: int
    aggregate: Any
    state: dict | None
    round: Any = None
    metrics: dict = field(default_factory=dict)
    #: samples on which a step trained the whole model (server data)
    server_samples: int = 0


# ---------------------------------------------------------------------- chains

class _ChainRound(GradientRound):
    def __init__(self, rounds: list[GradientRound]):
        self.rounds = rounds
        self.samples = sum(r.samples for r in rounds)
        self.server_samples = sum(r.server_samples for r in rounds)

    def begin(self, slots, start):
        for r in self.rounds:
            r.begin(slots, start)

    def update(self, names, params, grads, slots):
        for r in self.rounds:
            grads = r.update(names, params, grads, slots)
        return grads

    def collect(self, slots, final):
        for r in self.rounds:
            r.collect(slots, final)

    def adjust(self, model, aggregate):
        for r in self.rounds:
            model = r.adjust(model, aggregate)
        return model


def describe(transform: Transform) -> str:
    """``transform 'name'``, with the plugin that registered it (for error messages)."""
    return component("transform", transform.name)


def tensor_mismatch(value, like: torch.Tensor, name: str, whose: str) -> str | None:
    """How a plugin's ``value`` for tensor ``name`` differs from ``like``, the tensor it
    stands for, by type, shape, dtype and device (``whose``: "gradient", "tensor"), as
    the end of "the update of ... returned ..."; None when it does not."""
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__} for {name}"
    if value.shape != like.shape:
        return (f"returned shape {tuple(value.shape)} for {name}, whose {whose} has shape "
                f"{tuple(like.shape)}")
    if value.dtype is not like.dtype:
        return f"returned {value.dtype} for {name}, whose {whose} is {like.dtype}"
    if value.device != like.device:
        return f"returned a tensor on {value.device} for {name}, whose {whose} is on {like.device}"
    return None


def _checked(transform: Transform, names, grads, out) -> list[torch.Tensor]:
    """``out``, what ``transform``'s update returned for ``grads``: one tensor per
    parameter, each of its gradient's shape, dtype and device (:func:`tensor_mismatch`);
    anything else raises PluginError (on every step: the device is compared as the dtype
    is, a few hundred nanoseconds a parameter)."""
    def bad(what: str):
        from splitfed.errors import PluginError

        return PluginError(f"algorithm.client_transforms: the update of {describe(transform)} "
                           f"{what}; it must return a list of {len(grads)} tensors, each "
                           "of the shape, dtype and device of the gradient it replaces "
                           "([clients, ...] per parameter)")

    if not isinstance(out, (list, tuple)):
        raise bad(f"returned {type(out).__name__}")
    if len(out) != len(grads):
        raise bad(f"returned {len(out)} gradients for {len(grads)} parameters")
    for name, g, o in zip(names, grads, out):
        problem = tensor_mismatch(o, g, name, "gradient")
        if problem is not None:
            raise bad(problem)
    return out if isinstance(out, list) else list(out)


class _Checked(GradientRound):
    """A transform's round whose ``update`` output is checked (:func:`_checked`); the
    rest is the round's own."""

    def __init__(self, transform: Transform, inner: GradientRound):
        self.transform, self.inner = transform, inner

    @property
    def samples(self) -> int:
        return self.inner.samples

    @property
    def server_samples(self) -> int:
        return self.inner.server_samples

    def _call(self, fn, *args):
        """``fn(*args)``, a method of the transform's round: a plugin's failure is one
        line naming it (:func:`~splitfed.origins.call_plugin`)."""
        return call_plugin("transform", self.transform.name, "algorithm.client_transforms",
                           fn, *args)

    def begin(self, slots, start):
        self._call(self.inner.begin, slots, start)

    def update(self, names, params, grads, slots):
        out = self._call(self.inner.update, names, params, grads, slots)
        return _checked(self.transform, names, grads, out)

    def collect(self, slots, final):
        self._call(self.inner.collect, slots, final)

    def adjust(self, model, aggregate):
        return self._call(self.inner.adjust, model, aggregate)

    def finish(self):
        return self._call(self.inner.finish)


def start_gradients(transforms: Sequence[GradientTransform], env, state: dict, t: int,
                    cohort, round_) -> tuple[GradientRound | None, list]:
    """Open the round of every transform in order; returns the chained round (None when
    no transform corrects anything this round) and the per-transform rounds. What each
    transform's ``update`` returns is checked on every step: as many gradients as it was
    given, each of the same shape, dtype and device (:class:`~splitfed.errors.PluginError`
    naming the transform otherwise)."""
    rounds, live = [], []
    for tr in transforms:
        r = call_plugin("transform", tr.name, "algorithm.client_transforms", tr.start, env,
                        state.get(tr.key), t, cohort, round_)
        if r is not None and not isinstance(r, GradientRound):
            if not callable(r):
                from splitfed.errors import PluginError

                raise PluginError(f"algorithm.client_transforms: start of {describe(tr)} "
                                  f"returned {type(r).__name__}; it must return a "
                                  "GradientRound, a function update(names, params, grads, "
                                  "slots) -> grads, or None")
            r = _FunctionRound(r)
        r = None if r is None else _Checked(tr, r)
        rounds.append(r)
        if r is not None:
            live.append(r)
    if not live:
        return None, rounds
    return (live[0] if len(live) == 1 else _ChainRound(live)), rounds




# ---------------------------------------------------------------------- server steps

@dataclass
class RateOptions:
    global_lr: float = field(default=1.0, metadata={"gt": 0, "help": "eta_g"})


class Rate(ServerStep):
    """x_{t+1} = x_t + eta_g * sum_n w_n (x_n - x_t): the aggregation with a global
    learning rate (FedAvg with eta_g = 1; paper 003 Algorithm 1's global step)."""

    name = "rate"
    reference = "McMahan et al. 2017; paper 003 Algorithm 1 (global learning rate)"
    Options = RateOptions

    def update(self, ctx, model):
        return ctx.aggregate.result(self.options.global_lr)


@dataclass
class MomentumOptions:
    server_lr: float = field(default=1.0, metadata={"gt": 0, "help": "server rate eta"})
    beta: float = field(default=0.9, metadata={"ge": 0, "lt": 1, "help": "momentum"})


class Momentum(ServerStep):
    """Server momentum (FedAvgM, Hsu et al. 2019, Algorithm 1): with the aggregated delta
    Delta_t = sum_n w_n (x_n - x_t), v_t = beta v_{t-1} + Delta_t and
    x_{t+1} = x_t + eta v_t (v_0 = 0); on parameters only, buffers take the plain
    aggregate. The state (``v``) persists across rounds; an empty round keeps it."""

    name = "momentum"
    reference = "Hsu, Qi and Brown 2019, FedAvgM (server momentum)"
    Options = MomentumOptions

    def init(self, env, params):
        return {"v": {n: torch.zeros_like(p) for n, p in params.items()}}

    @torch.no_grad()
    def update(self, ctx, model):
        o = self.options
        new = ctx.aggregate.result(1.0)            # buffers: the plain aggregate
        delta = ctx.aggregate.delta()
        ref = ctx.aggregate.reference
        v_new = {}
        for name, v in ctx.state["v"].items():
            v = o.beta * v + delta[name]
            new[name] = ref[name] + o.server_lr * v
            v_new[name] = v
        ctx.state = {"v": v_new}
        return new
