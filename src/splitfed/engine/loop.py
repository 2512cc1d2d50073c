"""The round loop, written once for every algorithm.

Each round: sample the participants, let the algorithm run its round (it returns a
:class:`~splitfed.engine.rounds.RoundResult`, checked by :func:`check_result`), read the
round's bytes from the ledger, turn the samples it trained on into client and server
multiply-accumulates (``server_samples``, when an algorithm's server trains on fewer or
more samples than its clients; None: the same as ``samples``; ``server_model_samples``:
samples on which the server trains the whole model, on its own data; ``server_macs``
and ``client_macs``: the MACs of the server side and of the clients when the algorithm
counts them itself), record the server-side model memory (``server_param_bytes``:
``algorithm.server_copies`` copies of the server part), evaluate every ``eval_every``
rounds, every round of the last ``eval_last`` rounds, at round 0 and at the last round
(:func:`evaluates`), log one record. The run diverges
(:func:`splitfed.metrics.divergence`) at the first round whose training loss, or whose
evaluated test loss or accuracy, is not finite: the record of that round is logged (a
non-finite training loss skips the evaluation) and the run stops with status
``diverged``.

Progress: with ``progress: true`` a progress bar (tqdm); with ``progress: false`` and
``progress_lines`` (what :func:`splitfed.experiment.run_experiment` passes for a run that
writes a run directory) one line per evaluated round (and one when it diverges) on
stderr, ``<name>: round 5/20, train loss 0.4123, test acc 0.8123, elapsed
12.3 s``, so that long runs show their progress in logs; stdout stays clean.

``clients_used`` counts the round's distinct participants whose work the round used (the
cohort after availability and over-selection, less the clients the deadline dropped). A
federated run (``algorithm.federated``) whose rounds all had ``clients_used == 0`` (every
client unavailable, late or dropped, in every round) ends with status
``no_client_trained`` instead of ``completed``: no client's update reached an aggregate.
(The server side of SL, SFL-V2, CSE-FSL and GAS, and SFL-V1's mid-round server averages, may
still have trained on a late client's activations, docs/clock.md "Deadline"; the status
says that the clients' work was never aggregated.) Runs
where the server alone trains (``centralized``, ``server_only``: ``algorithm.federated``
False) are not affected. Their rounds sample nobody: every record counts 0
``participants``, ``clients_used`` and ``dropped``, and the participation section and the
clock's deadline and over-selection, which only concern clients, change nothing in them
(a study can run them beside federated runs with the same settings).

The virtual clock (``env.clock``, :mod:`splitfed.engine.clock`) opens each round for the
sampled cohort (taking out clients a trace marks unavailable) and closes it after the
algorithm's round: every record has ``sim_round_s`` (simulated seconds of the round),
``sim_time_s`` (cumulative), ``slowest_client`` (the participant that finished last) and
``dropped`` (clients dropped by the deadline or unavailable).
"""

from __future__ import annotations

import math
import numbers
import re
import sys
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from splitfed.engine.evaluate import evaluate
from splitfed.engine.flops import TRAIN_FACTOR, forward_macs
from splitfed.engine.participation import NOBODY
from splitfed.engine.rounds import RoundResult
from splitfed.engine.transforms import describe as describe_transform
from splitfed.errors import ConfigError, PluginError, one_line, out_of_memory_as, preview
from splitfed.metrics import (  # noqa: F401 - RESERVED_KEYS: re-exported
    RESERVED_KEYS, divergence, metric_problem)
from splitfed.models import dry_output, output_shape, split
from splitfed.origins import call_algorithm, call_plugin, component
from splitfed.safeio import unsaveable
from splitfed.transport import payload_bytes


def _evaluate(algorithm, env, state) -> dict[str, float]:
    test = env.data.test
    model = call_algorithm(env.config.algorithm.name, "eval_model", algorithm.eval_model,
                           env, state)
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"{_named(env.config)}: eval_model returned "
                          f"{type(model).__name__}; it must return the model to evaluate "
                          "(a torch.nn.Module)")
    return evaluate(model, test.x, test.y, env.config.engine.eval_batch_size)


def _named(cfg) -> str:
    """``algorithm.name: algorithm 'x'`` (with its plugin) for messages about the run's
    algorithm."""
    return f"algorithm.name: {component('algorithm', cfg.algorithm.name)}"


def evaluates(cfg, t: int) -> bool:
    """Whether round ``t`` (1-based) is evaluated: every ``eval_every`` rounds, each of
    the last ``eval_last`` rounds, and the last round (round 0 always is)."""
    last = getattr(cfg, "eval_last", 0) or 0
    return t % cfg.eval_every == 0 or t == cfg.rounds or t > cfg.rounds - last


def macs_per_sample(algorithm, env) -> tuple[int, int]:
    """(client, server) MACs of one training sample: a forward pass and its backward."""
    shape = tuple(env.data.input_shape)
    if not algorithm.split:
        full = TRAIN_FACTOR * forward_macs(env.model, shape)
        return (full, 0) if algorithm.federated else (0, full)
    client, server = split(env.model, env.cut)
    cut_shape = output_shape(client, shape)
    return (TRAIN_FACTOR * forward_macs(client, shape),
            TRAIN_FACTOR * forward_macs(server, cut_shape))


def server_copy_bytes(algorithm, env) -> int:
    """Bytes of one copy of the server-side model (parameters and buffers); 0 unsplit."""
    if not algorithm.split:
        return 0
    return payload_bytes(split(env.model, env.cut)[1].state_dict(), per_client=False)


def client_part_bytes(algorithm, env) -> int:
    """Bytes of the model part a client receives and sends each way (the algorithm's
    ``client_part``: the client blocks of a split algorithm, FedLoRA's adapters and
    head, else the whole model)."""
    return payload_bytes(algorithm.client_part(env, env.model.state_dict()),
                         per_client=False)


def work_sizes(algorithm, env) -> tuple[int, int, int, int]:
    """The sizes behind a client's cost (:func:`client_work`), computed once a run:
    (MACs per training sample, bytes of the model part it receives and sends each way
    (the algorithm's ``client_part``: the client blocks of a split algorithm, FedLoRA's
    adapters and head), bytes of one training sample's activation at the cut, in the
    model's dtype, and of its label; 0 and 0 unsplit)."""
    macs = macs_per_sample(algorithm, env)[0]
    model = client_part_bytes(algorithm, env)
    if not algorithm.split:
        return macs, model, 0, 0
    out = dry_output(split(env.model, env.cut)[0], tuple(env.data.input_shape))
    acts = math.prod(out.shape[1:]) * out.element_size()
    y = env.data.train.y
    return macs, model, acts, math.prod(y.shape[1:]) * y.element_size()


def client_work(algorithm, env, steps, t: int | None = None, sizes=None,
                ids=None) -> tuple:
    """What a client's round costs it when it takes ``steps`` local steps (a number or
    an array, one per client) in round ``t`` (None: a round on average), for
    over-selection's prediction (:meth:`~splitfed.engine.clock.VirtualClock.keep_fastest`)
    and ``--dry-run``'s plan: (MACs it computes: the algorithm's ``client_macs`` and the
    samples its gradient transforms add, :func:`transform_samples`, bytes of its model
    part each way, bytes up and down at the cut: the algorithm's ``cut_bytes``, bytes
    down and up of its gradient transforms' messages: :func:`message_bytes`). ``ids``:
    the clients (one per entry of ``steps``; None: every client of the run, 0..N-1).
    ``sizes``: :func:`work_sizes`, when the caller keeps them."""
    macs, model, acts, label = work_sizes(algorithm, env) if sizes is None else sizes
    name = env.config.algorithm.name
    up, down = call_algorithm(name, "cut_bytes", algorithm.cut_bytes, env, acts, label,
                              steps, t)
    computed = call_algorithm(name, "client_macs", algorithm.client_macs, env, macs, steps, t)
    if algorithm.gradient_transforms:
        ids = np.arange(env.num_clients) if ids is None else np.asarray(ids, np.int64)
        extra = transform_samples(algorithm, env, ids)
        if extra.any():                     # FedCLG's g^i_t pass (fresh_batch, full)
            computed = computed + extra * macs
    return computed, model, up, down, message_bytes(algorithm, env, model)


#: the config key of a gradient transform's mistakes
TRANSFORMS_KEY = "algorithm.client_transforms"


def check_transform_hooks(algorithm, env) -> None:
    """Call ``algorithm``'s gradient transforms' ``client_samples`` (every client) and
    ``message_bytes`` once, as a round will, so that a plugin's mistake there is its
    one-line :class:`~splitfed.errors.PluginError` before a run writes anything."""
    if algorithm.gradient_transforms:
        transform_samples(algorithm, env, np.arange(env.num_clients))
        message_bytes(algorithm, env, client_part_bytes(algorithm, env))


def transform_samples(algorithm, env, ids: np.ndarray) -> np.ndarray:
    """The training samples each of the clients ``ids`` computes in a round for
    ``algorithm``'s gradient transforms beyond its local steps
    (:func:`step_client_samples`: FedCLG's g^i_t pass), one per id (int64)."""
    total = np.zeros(len(ids), dtype=np.int64)
    for step in algorithm.gradient_transforms:
        total += step_client_samples(step, env, ids)
    return total


def step_client_samples(step, env, ids: np.ndarray) -> np.ndarray:
    """Gradient transform ``step``'s ``client_samples`` for the clients ``ids``, one per
    id (int64); PluginError naming it when they are not whole numbers >= 0."""
    got = call_plugin("transform", step.name, TRANSFORMS_KEY, step.client_samples, env, ids)
    if not _sample_counts(got, len(ids)):
        raise PluginError(f"{TRANSFORMS_KEY}: {component('transform', step.name)}: "
                          "client_samples must return a whole number of samples >= 0, or "
                          f"an integer array of one per client ({len(ids)}); it returned "
                          f"{preview(got)}")
    return np.broadcast_to(np.asarray(got, dtype=np.int64), (len(ids),))


def _sample_counts(value, n: int) -> bool:
    if isinstance(value, np.ndarray):
        return (value.shape == (n,) and value.dtype.kind in "iu"
                and not (value < 0).any())
    return _whole_bytes(value)


def message_bytes(algorithm, env, part_bytes: int) -> tuple[int, int]:
    """The bytes (down, up) a participant exchanges in a round for ``algorithm``'s
    gradient transforms (:func:`step_message_bytes`: SCAFFOLD's control variates,
    FedCLG's gradients), beyond its part of the model, ``part_bytes`` each way."""
    down = up = 0
    for step in algorithm.gradient_transforms:
        d, u = step_message_bytes(step, env, part_bytes)
        down, up = down + d, up + u
    return down, up


def step_message_bytes(step, env, part_bytes: int) -> tuple[int, int]:
    """Gradient transform ``step``'s ``message_bytes`` (down, up); PluginError naming it
    when they are not two whole numbers >= 0."""
    got = call_plugin("transform", step.name, TRANSFORMS_KEY, step.message_bytes, env,
                      part_bytes)
    if (not isinstance(got, tuple) or len(got) != 2
            or not all(_whole_bytes(b) for b in got)):
        raise PluginError(f"{TRANSFORMS_KEY}: {component('transform', step.name)}: "
                          "message_bytes must return two whole numbers of bytes >= 0 "
                          f"(down, up); it returned {got!r}")
    return int(got[0]), int(got[1])


def _whole_bytes(value) -> bool:
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and value >= 0)


def local_steps_of(algorithm, env, ids: np.ndarray) -> np.ndarray:
    """The local steps of clients ``ids`` in a round of ``algorithm``: its
    ``fixed_local_steps`` when it fixes them, else the config's (``env.local_steps``)."""
    fixed = algorithm.fixed_local_steps
    if fixed is not None:
        return np.full(len(ids), int(fixed), dtype=np.int64)
    return env.local_steps(ids)


def _over_select(algorithm, env, cohort, sizes, t: int):
    """Keep round ``t``'s ``clock.keep`` predicted-fastest clients (over-selection)."""
    macs, model, up, down, (extra_down, extra_up) = client_work(
        algorithm, env, local_steps_of(algorithm, env, cohort.ids), t, sizes, cohort.ids)
    return env.clock.keep_fastest(cohort, macs, model + up + extra_up,
                                  model + down + extra_down)


#: the statuses that end a run before its last round: a checkpoint with one is final
#: (``no_client_trained`` is decided at the last round, so a run extended past it goes on)
ENDS_EARLY = ("diverged",)

def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _keys(keys) -> str:
    return ", ".join(repr(k) for k in sorted(keys, key=str)[:5]) + (
        ", ..." if len(keys) > 5 else "")


def _check_model(algorithm, env, state: dict, bad) -> None:
    """With the default ``eval_model`` (which loads ``state["model"]`` into ``env.model``):
    ``state["model"]`` has the model's keys and tensor shapes."""
    from splitfed.engine.algorithm import Algorithm

    model = state.get("model")
    if type(algorithm).eval_model is not Algorithm.eval_model:
        return
    if not isinstance(model, dict):
        raise bad(f"returned a state whose 'model' is {type(model).__name__}; with the "
                  "default eval_model it holds the whole model's state_dict (client and "
                  "server sides)" if "model" in state else "returned a state without "
                  "'model'; with the default eval_model it holds the whole model's "
                  "state_dict (client and server sides)")
    expected = env.model.state_dict()
    extra, missing = set(model) - set(expected), set(expected) - set(model)
    if extra or missing:
        what = (f"other keys ({_keys(extra)})" if extra else
                f"no values for {_keys(missing)}")
        raise bad(f"returned a state['model'] with {what}; it holds the whole model's "
                  "state_dict (client and server sides)")
    for key, value in model.items():
        want, dtype = expected[key].shape, expected[key].dtype
        if (not isinstance(value, torch.Tensor) or value.shape != want
                or value.dtype != dtype):
            got = (f"shape {tuple(value.shape)} and {value.dtype}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise bad(f"returned state['model'][{key!r}] of {got}; the model's is a tensor "
                      f"of shape {tuple(want)} and {dtype}")


#: what a checkpoint stores by its ``state_dict()`` (splitfed.checkpoint), besides plain data
CHECKPOINTED = (torch.nn.Module, torch.optim.Optimizer)


def _skeleton(state: Any) -> Any:
    """``init_state``'s state as a checkpoint template, without its memory: tensors on
    the meta device and numpy arrays as broadcast views (a template is compared by
    dtype and shape)."""
    def shape_only(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, np.ndarray):
            return np.broadcast_to(np.zeros((), dtype=v.dtype), v.shape)
        if isinstance(v, dict):
            return {k: shape_only(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(shape_only(x) for x in v)
        return v
    return {k: shape_only(v) for k, v in state.items()}


def _checkpoint_round(cfg, t: int, start: int) -> bool:
    """Whether :func:`run_rounds` checks round ``t``'s state against the checkpoint
    template: the first round it runs, every round a checkpoint may be written after
    (``checkpoint_every``) and the last."""
    every = getattr(cfg, "checkpoint_every", 0) or 0
    return t == start or t == cfg.rounds or (every > 0 and t % every == 0)


def check_resumable(algorithm, env, skeleton: dict, state: dict, t: int) -> None:
    """A checkpoint of ``state`` (round ``t``'s) could be resumed: it fits
    ``algorithm.checkpoint_template(env, init_state, state)`` (``skeleton``: init_state's,
    from :func:`_skeleton`; its ``model`` too when the algorithm has its own
    ``eval_model``, else the round's, which :func:`_check_model` checks against the
    model), as :func:`splitfed.checkpoint.restore` will require; else
    :class:`~splitfed.errors.PluginError` naming the algorithm, the round and the entry,
    in a run that otherwise would only fail when it is resumed."""
    from splitfed.checkpoint import misfit
    from splitfed.engine.algorithm import Algorithm, describe

    base = dict(skeleton)
    if "model" in state and type(algorithm).eval_model is Algorithm.eval_model:
        base["model"] = state["model"]     # checked against the model (_check_model)
    template = call_algorithm(env.config.algorithm.name, "checkpoint_template",
                              algorithm.checkpoint_template, env, base, state)
    why = misfit(state, template)
    if why is not None:
        for key, tr in _transforms_by_key(algorithm).items():   # a transform's own state
            own = (misfit({key: state[key]}, {key: template[key]})
                   if key in state and isinstance(template, dict) and key in template
                   else None)
            if own is not None:
                raise PluginError(
                    f"{_transform_field(algorithm, tr)}: {describe_transform(tr)} kept a "
                    f"state in round {t} whose checkpoint could not be resumed: {own} (as "
                    "its init returned it); return from init each entry of the round-0 "
                    "state with its kind and shape (0.0 for a float, a tensor of the final "
                    "shape), or declare a state that changes in the transform's "
                    "checkpoint_template (docs/extending.md, State keys)")
        raise PluginError(
            f"algorithm.name: {describe(algorithm, env)}: round {t} returned a state whose "
            f"checkpoint could not be resumed: {why} (as init_state declared it); give "
            "each entry its kind and shape in init_state (0.0 for a float, a tensor of "
            "the final shape), or declare a state that changes in checkpoint_template "
            "(docs/extending.md, State keys)")


def _transforms_by_key(algorithm) -> dict:
    """``algorithm``'s gradient transforms and server steps by their state keys."""
    return {tr.key: tr for tr in (*getattr(algorithm, "gradient_transforms", ()),
                                  *getattr(algorithm, "server_steps", ()))}


def _transform_field(algorithm, tr) -> str:
    """The config key that lists transform ``tr`` of ``algorithm``."""
    client = tr in tuple(getattr(algorithm, "gradient_transforms", ()))
    return f"algorithm.{'client' if client else 'server'}_transforms"


def _check_saveable(algorithm, state: dict, bad) -> None:
    """Every entry of ``state`` but the model is one a checkpoint holds; else ``bad(what)``
    (the algorithm's mistake), or a :class:`~splitfed.errors.PluginError` naming the
    transform whose state it is."""
    steps = _transforms_by_key(algorithm)
    for key in state:
        where = None if key == "model" else unsaveable(state[key], f"state[{key!r}]",
                                                        CHECKPOINTED)
        if where is None:
            continue
        what = (f"a state that a checkpoint cannot hold ({where}); the state holds tensors, "
                "numpy arrays, numbers, strings, modules, optimizers, and lists and dicts "
                "of these")
        if key in steps:
            tr = steps[key]
            raise PluginError(f"{_transform_field(algorithm, tr)}: {describe_transform(tr)} "
                              f"kept {what}")
        raise bad(f"returned {what}")


def check_result(algorithm, env, result, t: int, declared: tuple = ()) -> RoundResult:
    """``result``, what ``algorithm.round`` returned for round ``t``, checked; anything
    else raises :class:`~splitfed.errors.PluginError` naming the algorithm and what is
    wrong: a :class:`~splitfed.engine.rounds.RoundResult` whose ``state`` is a dict with
    the keys of the run's initial state ``declared`` (``init_state``'s; a key an
    algorithm or transform adds later is declared by its ``checkpoint_template``, as a
    checkpoint's state is checked on resuming) and, with the default ``eval_model``, a
    ``state["model"]`` of the model's keys and shapes, ``train_loss`` None or a real number (a
    non-finite one makes the run diverge), ``samples`` whole numbers >= 0, ``metrics`` a
    dict of names to real numbers or None, not one of :data:`RESERVED_KEYS`."""
    from splitfed.engine.algorithm import describe

    def bad(what: str) -> PluginError:
        return PluginError(f"algorithm.name: {describe(algorithm, env)}: round {t} {what}")

    if not isinstance(result, RoundResult):
        raise bad(f"returned {type(result).__name__}; round must return a splitfed.engine."
                  "rounds.RoundResult (what rnd.finish() returns)")
    state = result.state
    if not isinstance(state, dict):
        raise bad(f"returned a state of type {type(state).__name__}; the state is a dict "
                  "(init_state's keys)")
    if declared:
        known = {k: state[k] for k in declared if k in state}
        allowed = set(call_algorithm(env.config.algorithm.name, "checkpoint_template",
                                     algorithm.checkpoint_template, env, known, state))
        extra, missing = set(state) - allowed, set(declared) - set(state)
        steps = _transforms_by_key(algorithm)
        theirs = sorted(k for k in extra if k in steps)
        if theirs:                           # a transform's state, not the algorithm's
            tr = steps[theirs[0]]
            raise PluginError(
                f"{_transform_field(algorithm, tr)}: "
                f"{describe_transform(tr)} kept a state under {theirs[0]!r} in round {t} that "
                "its init did not declare (it returned None); return the round-0 state "
                "from init (or declare it in the transform's checkpoint_template), so "
                "that the run's checkpoints can be resumed")
        if extra:
            raise bad(f"returned state keys that init_state did not declare ({_keys(extra)}); "
                      "declare every key of the state in init_state (with its round-0 "
                      "value), so that the run's checkpoints can be resumed")
        if missing:
            raise bad(f"returned a state without the keys ({_keys(missing)}) that "
                      "init_state declared; return the whole state (rnd.finish(state=...) "
                      "and dataclasses.replace(result, state={**result.state, ...}) keep "
                      "the other keys)")
    _check_model(algorithm, env, state, bad)
    _check_saveable(algorithm, state, bad)
    if result.train_loss is not None and not _real(result.train_loss):
        raise bad(f"returned train_loss {result.train_loss!r:.60} "
                  f"({type(result.train_loss).__name__}); expected None or a real number "
                  "(float(loss))")
    for field in ("samples", "server_samples", "server_model_samples", "server_macs",
                  "client_macs"):
        value = getattr(result, field)
        if value is None and field in ("server_samples", "server_macs", "client_macs"):
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise bad(f"returned {field} {value!r:.60}; expected a whole number >= 0")
    if not isinstance(result.metrics, dict):
        raise bad(f"returned metrics of type {type(result.metrics).__name__}; expected a "
                  "dict of names to numbers")
    for key, value in result.metrics.items():
        problem = metric_problem(key, value)
        if problem is not None:
            raise bad(f"returned {problem}")
    return result


def initial_state(algorithm, env) -> dict:
    """``algorithm.init_state(env)``, checked: a dict whose ``"model"`` (where the
    algorithm keeps one) has the model's keys, shapes and dtypes, and, for an algorithm
    that takes transforms, whose other keys are its ``state_keys`` or its transforms'
    keys; else :class:`~splitfed.errors.PluginError` naming the algorithm. A run calls it before
    it creates its run directory, and ``--dry-run`` calls it too."""
    cfg = env.config

    def too_large(e: BaseException) -> ConfigError:
        asked = re.search(r"allocate (\d+) bytes", str(e))
        what = (f"an allocation of {int(asked[1]) / 2**30:.1f} GiB failed" if asked
                else f"{type(e).__name__}: {one_line(e, 100)}")
        return ConfigError(f"{_named(cfg)}: its state does not fit in this machine's memory "
                           f"({what}); it holds the model and whatever the algorithm "
                           "and its transforms keep, and what they keep per client "
                           "(as SCAFFOLD's control variates) grows with "
                           f"partition.num_clients ({env.num_clients}): use fewer "
                           "clients or a smaller model")
    with out_of_memory_as(too_large):
        state = call_algorithm(cfg.algorithm.name, "init_state", algorithm.init_state, env)
    if not isinstance(state, dict):
        raise PluginError(f"{_named(cfg)}: init_state returned {type(state).__name__}; "
                          "it must return the algorithm's state, a dict")
    _check_model(algorithm, env, state, lambda what: PluginError(
        f"{_named(cfg)}: init_state {what}"))
    _check_saveable(algorithm, state, lambda what: PluginError(
        f"{_named(cfg)}: init_state {what}"))
    if getattr(algorithm, "uses_transforms", False):   # a config may add transforms
        own = set(getattr(algorithm, "state_keys", ("model",)))
        unlisted = set(state) - own - set(algorithm.transform_keys())
        if unlisted:
            raise PluginError(
                f"{_named(cfg)}: init_state returned the key(s) {_keys(unlisted)}, which "
                f"are not in its class's state_keys ({_keys(own)}) nor a transform's; "
                "list every key of the algorithm's own state in state_keys, so that no "
                "transform a config adds can take its name (docs/extending.md, State "
                "keys)")
    return state


def run_rounds(algorithm, env, logger, state: dict | None = None,
               start_round: int = 1, checkpoint=None,
               progress_lines: bool = False, initial: bool = False) -> tuple[dict, str]:
    """Run rounds ``start_round..config.rounds``; returns the final state and the status.

    ``state``: the state to start from; None: :func:`initial_state`'s. ``initial``: the
    given ``state`` is :func:`initial_state`'s (a run that called it before creating its
    directory); the state the rounds return is then checked as the state None starts.

    ``checkpoint(t, state, status)``, when given, is called after each round's record is
    logged (:class:`splitfed.checkpoint.Checkpointer` decides whether to write).
    ``progress_lines``: with ``progress: false``, a line on stderr per evaluated round."""
    cfg = env.config
    initial = initial or state is None
    if state is None:
        state = initial_state(algorithm, env)
    skeleton = _skeleton(state) if initial else None
    declared = tuple(state) if isinstance(state, dict) else ()
    started = time.perf_counter()
    lines = progress_lines and not cfg.progress
    if start_round == 1:
        first = {"round": 0, **_evaluate(algorithm, env, state)}
        logger.log(first)
        if divergence([first]) is not None:          # the initial model: no round runs
            if lines:
                _progress_line(cfg, first, started, "diverged")
            return state, "diverged"
    status = "completed"
    needs_clients = getattr(algorithm, "federated", True)
    used_any = any(r.get("clients_used", 0) for r in getattr(logger, "records", []) or [])
    client_macs, server_macs = macs_per_sample(algorithm, env)
    model_macs = TRAIN_FACTOR * forward_macs(env.model, tuple(env.data.input_shape))
    copy_bytes = server_copy_bytes(algorithm, env)
    sizes = work_sizes(algorithm, env) if env.clock.keep is not None else None
    warned_silent = False
    bar = tqdm(range(start_round, cfg.rounds + 1), desc=cfg.name, unit="round",
               disable=not cfg.progress, dynamic_ncols=True)
    for t in bar:
        env.ledger.round = t
        t0 = time.perf_counter()
        env.streams.seed_global(t)               # dropout's generator, for this round
        if needs_clients:
            cohort = env.clock.begin_round(
                env.sampler.sample(env.streams.numpy("participation")))
            if env.clock.keep is not None:
                cohort = _over_select(algorithm, env, cohort, sizes, t)
        else:                                    # the server alone trains: nobody takes part
            cohort = env.clock.begin_round(NOBODY)
        result = check_result(algorithm, env,
                              call_algorithm(cfg.algorithm.name, f"round {t}",
                                             algorithm.round, env, state, t, cohort), t,
                              declared)
        state = result.state
        if skeleton is not None and _checkpoint_round(cfg, t, start_round):
            check_resumable(algorithm, env, skeleton, state, t)
        used = env.clock.used(cohort.ids)
        used_any = used_any or used > 0
        record = {"round": t, "participants": int(cohort.size), "clients_used": used,
                  **result.record(),
                  **env.ledger.round_totals(t), **env.clock.end_round(),
                  "round_time_s": time.perf_counter() - t0}
        server = result.samples if result.server_samples is None else result.server_samples
        record["client_macs"] = (result.samples * client_macs if result.client_macs is None
                                 else result.client_macs)
        split_macs = (server * server_macs if result.server_macs is None
                      else result.server_macs)
        record["server_macs"] = split_macs + result.server_model_samples * model_macs
        record["server_param_bytes"] = call_algorithm(
            cfg.algorithm.name, "server_copies", algorithm.server_copies, env, cohort
        ) * copy_bytes
        if divergence([record]) is not None:          # a non-finite training loss
            status = "diverged"
        elif evaluates(cfg, t):
            record.update(_evaluate(algorithm, env, state))
            if divergence([record]) is not None:      # a non-finite test loss
                status = "diverged"
        if (needs_clients and used > 0 and not warned_silent
                and record["bytes_up"] == 0 and record["bytes_down"] == 0):
            warned_silent = True
            _warn_silent(cfg, t, used)
        if t == cfg.rounds and status == "completed" and needs_clients and not used_any:
            status = "no_client_trained"
        logger.log(record)
        if lines and ("test_acc" in record or status == "diverged"):
            _progress_line(cfg, record, started, status)
        if checkpoint is not None:
            checkpoint(t, state, status)
        bar.set_postfix({k: f"{record[k]:.4f}" for k in ("train_loss", "test_acc")
                         if k in record})
        if status == "diverged":
            break
    bar.close()
    return state, status


def _warn_silent(cfg, t: int, used: int) -> None:
    """A warning on stderr (once a run): clients took part in round ``t`` but nothing
    went through the transport, so the records count no bytes and the clock no
    communication (an algorithm that moves tensors without ``env.transport``)."""
    print(f"splitfed: warning: {_named(cfg)} used {used} client(s) in round {t} but sent "
          "nothing through env.transport: the records count 0 bytes and the clock no "
          "communication time for it (docs/extending.md: everything that crosses the "
          "network goes through the transport)", file=sys.stderr, flush=True)


def _progress_line(cfg, record: dict, started: float, status: str) -> None:
    """One line on stderr: the round, its training loss and test accuracy, the time."""
    parts = [f"{cfg.name}: round {record['round']}/{cfg.rounds}"]
    for key, what in (("train_loss", "train loss"), ("test_acc", "test acc")):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{what} {value:.4f}")
    parts.append(f"elapsed {time.perf_counter() - started:.1f} s")
    if status == "diverged":
        parts.append("diverged (non-finite loss): the run stops")
    print(", ".join(parts), file=sys.stderr, flush=True)
