"""What an algorithm is: hyperparameters in, hooks filled in; the engine does the rest.

An algorithm is a class with an ``Options`` dataclass (its hyperparameters, validated from
the ``algorithm`` section of the config) and three methods:

- ``init_state(env) -> state``: the learned state at round 0 (a dict of tensors and
  plain values: the global model, server optimizer state, control variates...).
- ``round(env, state, t, cohort) -> (state, metrics)``: one round for the sampled cohort,
  using the engine's executor, transport and aggregation; never its own round loop.
- ``eval_model(env, state) -> nn.Module``: the global model to evaluate.

``server_copies(env, cohort)`` (storage accounting) says how many copies of the
server-side model the main server holds during a round; the loop reports
``server_param_bytes`` = copies x bytes of one copy (parameters and buffers).

Constructors hold hyperparameters only (learned state lives in ``state``), which keeps
sweeps, cloning and checkpoints trivial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn


@dataclass
class NoOptions:
    """This algorithm has no options of its own."""


class Algorithm:
    name: ClassVar[str] = ""
    #: the paper and algorithm box this implements, for ``splitfed list`` and the docs
    reference: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: True when clients hold only the first ``cut`` blocks of the model
    split: ClassVar[bool] = False
    #: False for algorithms without clients (the centralized reference)
    federated: ClassVar[bool] = True
    #: config overrides under which the conformance tests expect this algorithm to learn
    #: their small task (e.g. more rounds for zeroth-order methods); {} for none
    conformance_overrides: ClassVar[dict] = {}
    #: True when the learned model depends on simulated time (the order of events, GAS);
    #: the synchronous algorithms' parameters never depend on the speeds
    asynchronous: ClassVar[bool] = False
    #: True when every client computation goes through the engine's placed primitives,
    #: so that the multi-process runtime (``splitfed launch``) can run the algorithm
    #: unchanged; subclasses inherit it
    distributed: ClassVar[bool] = False

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()

    def check(self, env) -> None:
        """Raise ConfigError if the options cannot work with the built ``env``; called
        before the run directory is created. Default: nothing to check."""

    def init_state(self, env) -> dict:
        """Default: the global model (a copy of ``env.model``'s state) under ``"model"``."""
        return {"model": {k: v.detach().clone() for k, v in env.model.state_dict().items()}}

    def checkpoint_template(self, env, template: dict, saved: dict) -> dict:
        """What a checkpointed state must look like (:mod:`splitfed.checkpoint` checks the
        saved state against it before resuming): ``template`` is ``init_state(env)``;
        an algorithm whose state gains keys during the rounds adds them when ``saved``
        has them. Default: ``template``."""
        return template

    def round(self, env, state: dict, t: int, cohort) -> tuple[dict, dict[str, float]]:
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
