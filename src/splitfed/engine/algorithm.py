"""What an algorithm is: hyperparameters in, hooks filled in; the engine does the rest.

An algorithm is a class with an ``Options`` dataclass (its hyperparameters, validated from
the ``algorithm`` section of the config) and three methods:

- ``init_state(env) -> state``: the learned state at round 0 (a dict of tensors and
  plain values: the global model, server optimizer state, the transforms' state...).
  Its keys are the state's keys for the whole run: a round returns a state with the
  same keys (the round loop refuses other ones, since a checkpoint of the run could not
  be resumed; a key that appears only later is declared by ``checkpoint_template``).
- ``round(env, state, t, cohort) -> RoundResult``: one round for the sampled cohort,
  using the engine's executor, transport and the round helper
  (:class:`~splitfed.engine.rounds.Round`: broadcast, on-time weighted aggregation,
  server steps); never its own round loop.
- ``eval_model(env, state) -> nn.Module``: the global model to evaluate.

What varies between algorithms of a family is not a subclass but a transform
(:mod:`splitfed.engine.transforms`): ``transforms()`` returns the algorithm's own
gradient transforms (applied to every local step of its clients) and server steps
(applied to the round's aggregate), built from its options; a config adds more with
``algorithm.client_transforms`` and ``algorithm.server_transforms``. Their state lives in
the algorithm state under each transform's ``key``.

``server_copies(env, cohort)`` (storage accounting) says how many copies of the
server-side model the main server holds during a round; the loop reports
``server_param_bytes`` = copies x bytes of one copy (parameters and buffers).

``cut_bytes(env, activation_bytes, label_bytes, steps, t)`` says what a client sends
and receives at the cut in a round, for over-selection's prediction and ``--dry-run``'s
traffic; the default is first-order split learning's (SL, SFL-V1, SFL-V2).
``client_macs(env, macs_per_sample, steps, t)`` says what a client computes in a round,
for the same prediction and ``--dry-run``'s compute; the default is one forward and one
backward pass per training sample.

Constructors hold hyperparameters only (learned state lives in ``state``), which keeps
sweeps, cloning and checkpoints trivial.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any, ClassVar

from torch import nn

from splitfed.engine.transforms import NoOptions, Rate, RateOptions
from splitfed.errors import ConfigError
from splitfed.origins import call_plugin


class Algorithm:
    name: ClassVar[str] = ""
    #: the paper and algorithm box this implements, for ``splitfed list`` and the docs
    reference: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: True when clients hold only the first ``cut`` blocks of the model
    split: ClassVar[bool] = False
    #: False for algorithms without clients (the centralized reference)
    federated: ClassVar[bool] = True
    #: True when the learned model depends on simulated time (the order of events, GAS);
    #: the synchronous algorithms' parameters never depend on the speeds
    asynchronous: ClassVar[bool] = False
    #: True when every client computation goes through the engine's placed primitives,
    #: so that the multi-process runtime (``splitfed launch``) can run the algorithm
    #: unchanged; subclasses inherit it
    distributed: ClassVar[bool] = False
    #: True when its round runs the gradient transforms and server steps (through
    #: :class:`~splitfed.engine.rounds.Round`), so that a config may add some
    uses_transforms: ClassVar[bool] = False
    #: True when the round's aggregate covers the whole model (SL, SFL-V1), not only the
    #: clients' part: the server steps then act on all of it
    aggregates_all: ClassVar[bool] = False
    #: False when the clients train only a part of an unsplit model (FedLoRA)
    trains_whole_model: ClassVar[bool] = True
    #: the keys of the algorithm's own state (a transform may not take one as its name)
    state_keys: ClassVar[tuple[str, ...]] = ("model",)
    #: local steps per client and round when the algorithm fixes them (MU-SplitFed: 1),
    #: for the plan and over-selection; None: ``train.local_steps`` / ``local_epochs``
    fixed_local_steps: ClassVar[int | None] = None
    #: True when every step it takes is a plain x <- x - eta G with no optimizer (the
    #: zeroth-order steps of MU-SplitFed and GAS): ``train.momentum`` and
    #: ``train.weight_decay`` other than 0 are then refused (:func:`check_plain_steps`),
    #: not ignored
    plain_steps: ClassVar[bool] = False

    def __init__(self, options: Any = None, *, client_transforms=(), server_transforms=()):
        self.options = options if options is not None else self.Options()
        if (client_transforms or server_transforms) and not self.uses_transforms:
            raise ConfigError(f"algorithm.client_transforms/server_transforms: {self.name!r} "
                              "takes no transforms (fedavg, fedprox, scaffold, fedopt, "
                              "clgsgd, sl, sflv1, sflv2, csefsl and their kin do)")
        grads, steps = self.transforms()
        self.gradient_transforms = [*grads, *client_transforms]
        self.server_steps = _server_chain(self.name, steps, list(server_transforms))
        whole = [t.name for t in self.gradient_transforms if not t.splits]
        if whole and (self.split or not self.trains_whole_model):
            raise ConfigError(f"algorithm.client_transforms: {', '.join(whole)} needs the whole "
                              f"model trained on the clients, which {self.name!r} does not do "
                              "(use an FL algorithm such as fedavg)")
        rated = [t.name for t in self.gradient_transforms if getattr(t, "needs_rate", False)]
        if rated and self.server_steps and not isinstance(self.server_steps[0], Rate):
            raise ConfigError(
                f"algorithm: {rated[0]!r} corrects the aggregate at the global rate of the "
                f"plain aggregation ('rate', algorithm.global_lr), as its paper writes it; "
                f"in {self.name!r} the step {self.server_steps[0].name!r} aggregates "
                "instead; use fedavg (or fedclg_s) with global_lr and no aggregating server "
                "step")
        every = (*self.gradient_transforms, *self.server_steps)
        names = [t.name for t in every]
        twice = sorted({k for k in names if names.count(k) > 1})
        if twice:
            raise ConfigError(f"algorithm: {', '.join(map(repr, twice))} would be applied twice "
                              f"({self.name!r} applies {', '.join(map(repr, names))}); list "
                              "each transform once")
        keys = [t.key for t in every]
        taken = sorted({k for k in keys if keys.count(k) > 1 or k in self.state_keys})
        if taken:
            raise ConfigError(f"algorithm: the transform state key(s) {', '.join(taken)} clash "
                              f"with the state of {self.name!r} ({', '.join(self.state_keys)}) "
                              "or another transform's; rename the transform")

    def transforms(self) -> tuple[list, list]:
        """The algorithm's own (gradient transforms, server steps), from its options.
        Default: no correction, and the aggregation with the global learning rate of the
        option ``global_lr`` (1 without one)."""
        return [], [Rate(RateOptions(float(getattr(self.options, "global_lr", 1.0))))]

    def transform_keys(self) -> list[str]:
        return [t.key for t in (*self.gradient_transforms, *self.server_steps)]

    @property
    def needs_server_data(self) -> bool:
        """Whether a transform trains on the server's own data (hybrid FL):
        build_environment then carves the server's pool."""
        return any(t.needs_server_data for t in (*self.gradient_transforms, *self.server_steps))

    @property
    def runs_distributed(self) -> bool:
        """Whether the multi-process runtime runs it: the class says so (``distributed``)
        and so does every transform."""
        return self.distributed and all(
            t.distributed for t in (*self.gradient_transforms, *self.server_steps))

    def draw_server_data(self, env):
        """D_s^t, the server's data of the round: indices into the training set."""
        if env.server_data is None:
            raise ConfigError(f"algorithm {self.name!r} needs server data, but the "
                              "environment has none (build it with build_environment)")
        return env.server_data.draw(env.streams.numpy("server_data"))

    def client_part(self, env, model: dict) -> dict:
        """The part of the global model the clients train and send: all of it, or the
        first ``cut`` blocks for a split algorithm."""
        if not self.split:
            return model
        from splitfed.engine.split import SplitModel

        return SplitModel.of(env).client_state(model)

    def aggregated_part(self, env, model: dict) -> dict:
        """The part of the global model the round's aggregate covers (the server steps
        act on it): the clients' part, or all of it (``aggregates_all``)."""
        return model if self.aggregates_all else self.client_part(env, model)

    def check(self, env) -> None:
        """Raise ConfigError if the options cannot work with the built ``env``; called
        before the run directory is created. Default: nothing to check."""

    def prepare_model(self, env) -> None:
        """Change ``env.model`` as the algorithm runs it, in place and idempotently
        (FedLoRA adds its adapters and freezes the rest); ``init_state`` calls it, and
        ``--dry-run``'s plan calls it to count the model the run trains. Default:
        nothing to change."""

    def init_state(self, env) -> dict:
        """Default: the global model (a copy of ``env.model``'s state) under ``"model"``,
        and the transforms' initial states under their keys."""
        model = {k: v.detach().clone() for k, v in env.model.state_dict().items()}
        return {"model": model, **self.init_transforms(env, model)}

    def init_transforms(self, env, model: dict) -> dict:
        names = [n for n, _ in env.model.named_parameters()]
        out = {}
        for group, part in ((self.gradient_transforms, self.client_part(env, model)),
                            (self.server_steps, self.aggregated_part(env, model))):
            params = {n: part[n] for n in names if n in part}
            field = ("algorithm.client_transforms" if group is self.gradient_transforms
                     else "algorithm.server_transforms")
            for t in group:
                s = call_plugin("transform", t.name, field, t.init, env, params)
                if s is not None:
                    out[t.key] = s
        return out

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """What a checkpointed state must look like (:mod:`splitfed.checkpoint` checks the
        saved state against it before resuming): ``template`` is ``init_state(env)``;
        an algorithm whose state gains keys during the rounds adds them when ``saved``
        has them. Default: ``template``, as each transform amends it."""
        for t in self.gradient_transforms:
            template = call_plugin("transform", t.name, "algorithm.client_transforms",
                                   t.checkpoint_template, env, template, saved)
        for t in self.server_steps:
            template = call_plugin("transform", t.name, "algorithm.server_transforms",
                                   t.checkpoint_template, env, template, saved)
        return template

    def round(self, env, state: dict, t: int, cohort):
        """One round; returns a :class:`~splitfed.engine.rounds.RoundResult`."""
        raise NotImplementedError

    def eval_model(self, env, state: dict) -> nn.Module:
        """Default: ``env.model`` holding ``state["model"]`` (the global client model composed
        with the global server model, for split algorithms)."""
        env.model.load_state_dict(state["model"])
        return env.model

    def server_copies(self, env, cohort) -> int:
        """Copies of the server-side model the main server holds in a round: one for a
        split algorithm with a single server model (SL, SFL-V2, CSE-FSL), none for FL
        and the centralized reference (no server-side part; the fed server's copy of the
        global model is not counted)."""
        return 1 if self.split else 0

    def cut_bytes(self, env, activation_bytes: int, label_bytes: int, steps, t=None):
        """``(up, down)``: the bytes one client sends to the server and receives from it
        at the cut in round ``t`` when it takes ``steps`` local steps of
        ``train.batch_size`` samples (``steps`` a number or an array, one per client; the
        result alike); ``t`` None: a round on average over the run's rounds. Over-selection
        predicts each sampled client's round with it (with its model part, which is
        counted apart) and ``--dry-run`` prints the traffic of a round; it must equal
        what the algorithm's round sends through the transport (the ledger), on average
        where it varies from round to round. ``activation_bytes``: one training sample's
        activation at the cut, in the model's dtype; ``label_bytes``: its label.

        Default: first-order split learning (SL, SFL-V1, SFL-V2): every training sample's
        activation and label up, the activation's gradient down; nothing for an unsplit
        algorithm."""
        if not self.split:
            return 0, 0
        samples = steps * env.config.train.batch_size
        return samples * (activation_bytes + label_bytes), samples * activation_bytes

    def client_macs(self, env, macs_per_sample: int, steps, t=None):
        """The MACs one client computes in round ``t`` when it takes ``steps`` local steps
        of ``train.batch_size`` samples (``steps`` a number or an array, one per client;
        the result alike); ``t`` None: a round on average over the run's rounds.
        Over-selection predicts each sampled client's round with it and ``--dry-run``
        prints the compute of a round; it must equal what the algorithm's round charges
        the clock for that client (role ``client``), on average where it varies from
        round to round. ``macs_per_sample``: a forward and a backward pass of one training
        sample through the client's part of the model (``TRAIN_FACTOR`` forward passes;
        the whole model unsplit).

        Default: one forward and one backward pass per training sample (FL, SL, SFL-V1,
        SFL-V2)."""
        return steps * env.config.train.batch_size * macs_per_sample


def describe(algorithm, env=None) -> str:
    """``algorithm 'name'`` for error messages: the name the config gives it (``env``'s
    config, else the class's ``name``), with the plugin that registered it."""
    from splitfed.origins import component

    cfg = getattr(env, "config", None)
    return component("algorithm",
                     getattr(getattr(cfg, "algorithm", None), "name", None) or algorithm.name)


def _server_chain(name: str, own: list, given: list) -> list:
    """The algorithm's server steps with the config's: a given aggregating step (one,
    first) replaces the algorithm's plain-rate step; the others run after its own."""
    agg = [s for s in given if s.aggregates]
    if len(agg) > 1 or (agg and given[0] is not agg[0]):
        raise ConfigError("algorithm.server_transforms: at most one aggregating step "
                          f"({', '.join(s.name for s in agg)}), and it comes first")
    if not agg:
        return [*own, *given]
    if own and not isinstance(own[0], Rate):
        raise ConfigError(f"algorithm.server_transforms: {name} moves its model with its own "
                          f"step {own[0].name!r}, which {agg[0].name!r} would replace; use "
                          f"fedavg (or the split algorithm) with server_transforms "
                          f"[{own[0].name}] or [{agg[0].name}]")
    if own and own[0].options.global_lr != 1.0:
        raise ConfigError(f"algorithm.global_lr={own[0].options.global_lr} and the server step "
                          f"{agg[0].name!r} both set the aggregation; leave global_lr at 1 "
                          "(the step has its own rate)")
    return [agg[0], *own[1:], *given[1:]]


def options_of(cls: type, options: Any):
    """``cls`` options holding the same-named fields of ``options`` (a wider dataclass)."""
    return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})


def merge_options(name: str, parts: list[type]) -> type:
    """One options dataclass with the fields of every dataclass in ``parts`` (the first
    one of each name wins); each part validates (and normalises) its own fields."""
    specs, seen = [], set()
    for part in parts:
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if f.name in seen:
                continue
            seen.add(f.name)
            kw = {"metadata": f.metadata}
            if f.default is not dataclasses.MISSING:
                kw["default"] = f.default
            if f.default_factory is not dataclasses.MISSING:
                kw["default_factory"] = f.default_factory
            specs.append((f.name, hints[f.name], dataclasses.field(**kw)))

    def __post_init__(self):
        for part in parts:
            checked = options_of(part, self)
            for f in dataclasses.fields(part):
                object.__setattr__(self, f.name, getattr(checked, f.name))

    doc = "Options of " + ", ".join(p.__name__ for p in parts) + "."
    return dataclasses.make_dataclass(name, specs, namespace={
        "__post_init__": __post_init__, "__doc__": doc})


def variant(cls_name: str, base: type, *, name: str, reference: str, gradient=(), server=(),
            step=None, **attrs) -> type:
    """The algorithm ``base`` with more transforms: its own gradient ``transforms``
    (applied before ``base``'s), server steps (after ``base``'s) and, with ``step``, an
    aggregating step that replaces ``base``'s plain rate, all built from its options:
    ``base``'s (or ``step``'s) and every transform's (:func:`merge_options`). FedProx is
    ``variant("FedProx", FedAvg, name="fedprox", reference=..., gradient=[Proximal])``."""
    module = sys._getframe(1).f_globals.get("__name__", __name__)
    first = base.Options if step is None else step.Options
    options = merge_options(f"{cls_name}Options", [
        first, *(t.Options for t in server), *(t.Options for t in gradient)])
    options.__module__ = module

    def transforms(self):
        grads, steps = base.transforms(self)
        if step is not None:
            steps = [step(options_of(step.Options, self.options)), *steps[1:]]
        return ([*(t(options_of(t.Options, self.options)) for t in gradient), *grads],
                [*steps, *(t(options_of(t.Options, self.options)) for t in server)])

    added = ", ".join(t.name for t in (*gradient, *([step] if step else []), *server))
    return type(cls_name, (base,), {
        "__module__": module, "__doc__": f"{base.__name__} with {added} ({reference}).",
        "name": name, "reference": reference, "Options": options,
        "transforms": transforms, **attrs})


#: the optimizer keys of ``train`` that an algorithm with ``plain_steps`` does not use
OPTIMIZER_KEYS = ("momentum", "weight_decay")


def check_plain_steps(algorithm, cfg) -> None:
    """Refuse ``train.momentum`` / ``train.weight_decay`` other than 0 for an algorithm
    whose steps take no optimizer (``plain_steps``): the run would ignore them, and a
    comparison with algorithms that use them would be unfair without a word."""
    if not getattr(algorithm, "plain_steps", False):
        return
    for key in OPTIMIZER_KEYS:
        value = getattr(cfg.train, key)
        if value:
            raise ConfigError(f"train.{key}: {cfg.algorithm.name} steps with plain "
                              f"x <- x - lr G and no optimizer, so train.{key}={value!r} "
                              f"would be ignored; set train.{key}=0 for its runs")
