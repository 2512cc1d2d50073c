"""Composition root: turn a :class:`~splitfed.config.RunConfig` into a finished run.

Everything is built and validated (data, partition, model, cut, sampler, algorithm
options) before the run directory is created, so a bad config never leaves a half-written
run behind.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from splitfed.algorithms import ALGORITHMS, get_algorithm
from splitfed.checkpoint import (CHECKPOINT, Checkpointer, check_config,
                                 checkpoint_records, cpu_capability, load_checkpoint,
                                 remove_stale_temp_files, restore, thread_warnings,
                                 truncate_metrics)
from splitfed.config import RunConfig, build_config, server_batch_sizes
from splitfed.exact import ceil_times
from splitfed.configtools import dump_text, from_dict, load_yaml, to_dict, yaml_round_trip
from splitfed.data import check_dataset_options, load_dataset
from splitfed.data.partition import PARTITIONERS, natural, partition, partition_summary
from splitfed.data.server_data import build_server_data
from splitfed.engine.algorithm import check_plain_steps
from splitfed.engine.clock import VirtualClock
from splitfed.engine.env import Environment
from splitfed.engine.loop import ENDS_EARLY, check_transform_hooks, initial_state, run_rounds
from splitfed.engine.participation import make_sampler
from splitfed.engine.profiles import build_profiles
from splitfed.errors import (ConfigError, DataError, FormatError, RunInterrupted,
                             SplitfedError, out_of_memory_as)
from splitfed.files import atomic_write_text, read_json_object
from splitfed.locking import LOCK_NAME, DirLock
from splitfed.metrics import (MetricLogger, decode_record, divergence, is_finite_number,
                              last_value, read_records, record_summary)
from splitfed.models import build_model, resolve_cut
from splitfed.origins import call_algorithm
from splitfed.provenance import provenance
from splitfed.rng import RandomStreams, derive_seed
from splitfed.tracking import open_trackers, preflight
from splitfed.transport import InProcessTransport, Ledger


#: the statuses of a run that ended (``summary.json``): running it again gives the same run
FINISHED_STATUSES = ("completed", "diverged", "no_client_trained")
#: the statuses of a run that stopped before it ended (``summary.json``): it resumes
UNFINISHED_STATUSES = ("failed", "interrupted")


@dataclass
class RunResult:
    """A finished run. ``records`` are the records of ``metrics.jsonl`` (non-finite
    numbers as floats). Accuracies follow :func:`splitfed.metrics.record_summary`: a
    diverged run's final accuracy is NaN, its best the best before it diverged."""

    status: str
    records: list[dict]
    run_dir: Path | None
    wall_time_s: float
    state: dict

    @property
    def numbers(self) -> dict:
        """``rounds``, ``diverged_round``, ``final_test_acc``, ``best_test_acc``."""
        return record_summary(self.records, self.status)

    @property
    def final_accuracy(self) -> float | None:
        """The last evaluated test accuracy; NaN when the run diverged; None when no
        round was evaluated."""
        return self.numbers["final_test_acc"]

    @property
    def best_accuracy(self) -> float | None:
        """The best test accuracy evaluated (before the divergence, when it diverged)."""
        return self.numbers["best_test_acc"]

    @property
    def diverged_round(self) -> int | None:
        """The round at which the run diverged (:func:`splitfed.metrics.divergence`)."""
        return self.numbers["diverged_round"]


def summary_line(cfg: RunConfig, result: RunResult) -> str:
    """The line ``splitfed run`` prints for a finished run: what ran, its status and
    test accuracy; a diverged run says at which round instead of an accuracy."""
    n = result.numbers
    what = (f"{cfg.algorithm.name} on {cfg.data.name} ({cfg.model.name}, "
            f"{cfg.partition.num_clients} clients, {cfg.partition.scheme})")
    wall = f"wall time {result.wall_time_s:.1f} s"
    if n["diverged_round"] is not None:
        best = n["best_test_acc"]
        best = "" if best is None else f" (best test accuracy {best:.4f} before it)"
        return (f"{what}: status {result.status} at round {n['diverged_round']}: the "
                f"loss became non-finite, no final accuracy{best}, {wall}")
    acc = n["final_test_acc"]
    acc_text = "n/a" if acc is None else f"{acc:.4f}"
    return (f"{what}: status {result.status}, test accuracy {acc_text} after "
            f"{n['rounds']} rounds, {wall}")


def resolve_device(name: str) -> torch.device:
    """``engine.device`` checked: the torch device, or a one-line ConfigError naming the
    field and the allowed values (the config check, studies' preflight and the benchmark
    all use it)."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"engine.device: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"engine.device: {name!r} is not supported; allowed: cpu, cuda, "
                          "cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device: 'cuda' requested but no CUDA device is available; "
                          "use engine.device=cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"engine.device: {name!r}: this machine has "
                          f"{torch.cuda.device_count()} CUDA devices; allowed: cuda:0.."
                          f"cuda:{torch.cuda.device_count() - 1}")
    return dev


def load_data(cfg: RunConfig, streams: RandomStreams, device: torch.device,
              cache: dict | None = None):
    """The data set of ``cfg`` on ``device``; with ``cache``, the one held there when it
    was loaded for the same data section and seed, else loaded and held (only the last)."""
    d = cfg.data
    key = data_key(cfg, device) if cache is not None else None
    if cache is not None and key in cache:
        return cache[key]
    check_dataset_options(d.name, d.options)     # before a key could clash with rng=
    bundle = load_dataset(d.name, d.data_dir, rng=streams.numpy("data"),
                          limit_train=d.limit_train, limit_test=d.limit_test, **d.options)
    for split in (bundle.train, bundle.test):
        split.x, split.y = split.x.to(device), split.y.to(device)
    if cache is not None:
        cache.clear()
        cache[key] = bundle
    return bundle


def data_key(cfg: RunConfig, device: torch.device | str | None = None) -> str:
    """What the data set a run loads depends on: its data section, its seed (the loader's
    random stream) and the device."""
    return json.dumps([to_dict(cfg.data), cfg.seed, str(device)], sort_keys=True,
                      default=str)


def check_partition_options(cfg: RunConfig) -> None:
    """ConfigError naming the first ``partition`` option its scheme does not take (the
    partitioner's keyword arguments; none for ``natural``), before any data is loaded."""
    p = cfg.partition
    if p.scheme == "natural":
        if p.options:
            raise ConfigError(f"partition.{next(iter(p.options))}: not an option of scheme "
                              "'natural', which takes the data set's own split; options: "
                              "none")
        return
    if p.scheme in PARTITIONERS:
        allowed = [n for n in inspect.signature(PARTITIONERS[p.scheme]).parameters
                   if n not in ("labels", "num_clients", "rng")]
        for key in p.options:
            if key not in allowed:
                raise ConfigError(f"partition.{key}: not an option of scheme {p.scheme!r}; "
                                  f"options: {', '.join(allowed) or 'none'}")


def make_partition(cfg: RunConfig, bundle, streams: RandomStreams,
               exclude: np.ndarray | None = None) -> list[np.ndarray]:
    """The clients' index arrays; ``exclude`` (the server's pool) is taken out first.

    ConfigError when ``partition.num_clients`` exceeds the training samples or when the
    scheme leaves a client without samples (such a client could not train when sampled).
    """
    p = cfg.partition
    check_partition_options(cfg)
    if p.scheme == "natural":
        if bundle.natural_partition is None:
            raise ConfigError(f"partition.scheme: 'natural' needs a data set with a natural "
                              f"partition (synthetic); {bundle.name} has none")
        parts = bundle.natural_partition
        if len(parts) != p.num_clients:
            raise ConfigError(f"partition.num_clients: the natural partition of {bundle.name} "
                              f"has {len(parts)} clients, got {p.num_clients}")
        parts = natural(bundle.train.y.cpu().numpy(), p.num_clients, None,  # (no draws)
                        natural=parts)
        parts = parts if exclude is None else [i[~np.isin(i, exclude)] for i in parts]
        empty = sum(len(i) == 0 for i in parts)
        if empty:
            raise ConfigError(f"partition.scheme: the natural partition of {bundle.name} "
                              f"leaves {empty} of {len(parts)} clients with no samples "
                              "(data.limit_train or the server's pool took them); raise "
                              "data.limit_train or lower server_data.fraction")
        return parts
    labels = bundle.train.y.cpu().numpy()
    keep = np.arange(len(labels))
    if exclude is not None:
        keep = np.setdiff1d(keep, exclude)
    if p.num_clients > len(keep):
        pooled = " left after the server's pool" if exclude is not None else ""
        raise ConfigError(f"partition.num_clients: {p.num_clients} clients for the "
                          f"{len(keep)} training samples{pooled} of {bundle.name}; allowed: "
                          f"1..{len(keep)}")
    parts = partition(labels[keep], p.num_clients, p.scheme, streams.numpy("partition"),
                      **p.options)
    empty = sum(len(i) == 0 for i in parts)
    if empty:
        fix = {"dirichlet": "a larger alpha or partition.min_partition_size>=1",
               "pathological": "a larger partition.num_classes_per_partition",
               "shard": "fewer partition.num_shards_per_partition"}.get(p.scheme, "")
        raise ConfigError(f"partition.scheme: {p.scheme} leaves {empty} of {len(parts)} "
                          f"clients with no samples; use fewer clients (partition.num_clients)"
                          + (f" or {fix}" if fix else ""))
    return [keep[i] for i in parts]


def client_data(cfg: RunConfig, bundle, streams: RandomStreams):
    """(the server's data or None, the clients' index arrays) as a run draws them: the
    server's pool first when the algorithm uses server data, then the partition of the
    rest (``server_data.disjoint``) or of the whole training set. A machine without
    the memory to draw them gets a one-line DataError, as the loader's does."""
    with out_of_memory_as(lambda e: DataError(
            f"partition: this machine has not the memory to partition the "
            f"{len(bundle.train)} training samples of {bundle.name} among "
            f"{cfg.partition.num_clients} clients")):
        server = _server_data(cfg, bundle, streams)
        pool = server.pool if server is not None and cfg.server_data.disjoint else None
        return server, make_partition(cfg, bundle, streams, exclude=pool)


def uses_server_data(cfg: RunConfig) -> bool:
    """Whether a run draws the server's pool (paper 004): its algorithm trains on server
    data, or ``server_data.always``. Builds the algorithm (its errors propagate)."""
    return bool(build_algorithm(cfg).needs_server_data or cfg.server_data.always)


def carves_server_pool(cfg: RunConfig) -> bool:
    """Whether a run removes the server's pool from the training set before partitioning
    it, so that its clients hold less data than a run of the same partition that does
    not (:func:`client_data`)."""
    return uses_server_data(cfg) and bool(cfg.server_data.disjoint)


def _server_data(cfg: RunConfig, bundle, streams: RandomStreams):
    """The server's pool (paper 004) if the run uses server data, else None."""
    if not uses_server_data(cfg):
        return None
    return build_server_data(cfg.server_data, bundle.train, bundle.num_classes,
                             streams.numpy("server_pool"))


def _build_model(cfg: RunConfig, bundle, streams: RandomStreams):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(streams.seed, "init"))
        model = build_model(cfg.model.name, bundle.input_shape, bundle.num_classes,
                            **cfg.model.options)
    unsplit = not getattr(ALGORITHMS.get(cfg.algorithm.name), "split", True)
    if unsplit and cfg.model.cut is None and not model.valid_cuts:
        return model, None  # a one-block model (mlp with hidden: []) trains unsplit only
    cut = resolve_cut(model, cfg.model.cut)
    return model, cut


#: the largest model whose forward pass :func:`_check_forward` tries on one sample (the
#: pass of a larger one costs seconds; their data and sizes are checked by their builders)
PROBE_MAX_PARAMS = 2 * 10**8


def _check_forward(cfg: RunConfig, model, bundle) -> None:
    """One sample of the data through the whole model, in eval mode without gradients,
    so that a model that cannot take the data set's samples (token ids into a model of
    images, sequences longer than its positions) or that does not give one score per
    class of the data set (its output must have the shape ``(1, num_classes)``: the
    training and evaluation losses are the cross-entropy against the labels) is refused
    with a ConfigError before anything is written, not in the first evaluation or never.
    The model's state is unchanged (no gradient, no running statistics, no random
    numbers drawn)."""
    for m in model.modules():          # every sample's token ids against the vocabulary
        if hasattr(m, "check_token_ids"):
            for split in (bundle.train, bundle.test):
                if len(split):
                    m.check_token_ids(split.x)
    if sum(p.numel() for p in model.parameters()) > PROBE_MAX_PARAMS:
        return
    data = bundle.test if len(bundle.test) else bundle.train
    x = data.x[:1]
    was_training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            out = model(x)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model raises, the pairing is wrong
        raise ConfigError(
            f"model.name: {cfg.model.name} cannot take the samples of data.name="
            f"{cfg.data.name} (shape {tuple(x.shape[1:])}, {x.dtype}): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        model.train(was_training)
    _check_output(cfg, out, int(bundle.num_classes))


def single_sample_batches(cfg: RunConfig, data_sizes,
                          server_rows: int | None) -> list[tuple[str, str]]:
    """The config keys that give some training pass a batch of one sample, each with its
    remedy: a batch size of 1 (``train.batch_size``, ``algorithm.server_batch_size``, a
    ``server_train`` step's), a full-batch server pass (``server_data.full_batch``,
    ``server_gradient: full``) on a D_s^t of ``server_rows`` = 1 sample, a full-data
    client pass (``client_gradient: full``) of a client holding 1 of ``data_sizes``."""
    opts = cfg.algorithm.options
    batch = "use a batch of at least 2 samples"
    found = [(key, batch) for key, size in
             [("train.batch_size", cfg.train.batch_size), *server_batch_sizes(cfg)]
             if size == 1]
    if server_rows == 1 and (cfg.server_data.full_batch or opts.get("server_gradient") == "full"):
        found.append(("server_data.samples_per_round" if cfg.server_data.samples_per_round
                      else "server_data.fraction",
                      "the full-batch server pass trains on D_s^t, of 1 sample; give it at "
                      "least 2"))
    if opts.get("client_gradient") == "full" and 1 in data_sizes:
        found.append(("algorithm.client_gradient",
                      "its pass 'full' trains on all of a client's data, and a client holds "
                      "1 sample; use first_batch or fresh_batch, or a partition that gives "
                      "every client at least 2 samples"))
    return found


def _check_single_sample_batches(cfg: RunConfig, model, bundle, data_sizes,
                                 server_rows: int | None) -> None:
    """A batch of one sample cannot train a model whose batch normalisation then sees
    one value per channel (ResNet-18 or MobileNetV2 on small images: the statistics of
    one value are undefined, and PyTorch raises in the first step). When a training pass
    has one sample (:func:`single_sample_batches`) and the model has a BatchNorm layer,
    one sample goes through it in training mode here, so that such a config is refused
    before anything is written; the model's state is restored (its running statistics)
    and no random numbers are drawn."""
    ones = single_sample_batches(cfg, data_sizes, server_rows)
    if not ones or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                           for m in model.modules()):
        return
    if sum(p.numel() for p in model.parameters()) > PROBE_MAX_PARAMS:
        return
    data = bundle.train if len(bundle.train) else bundle.test
    x = data.x[:1]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    was_training = model.training
    try:   # dropout in training mode draws on x's device: keep that generator's state too
        with (torch.no_grad(),
              torch.random.fork_rng(devices=[x.device.index or 0] if x.is_cuda else [])):
            model.train()
            model(x)
    except ValueError as e:
        if "value per channel" not in str(e):
            raise
        key, remedy = ones[0]
        raise ConfigError(f"{key}: 1 sample per batch cannot train {cfg.model.name} on "
                          f"{cfg.data.name}: a batch normalisation layer would see one value "
                          "per channel (PyTorch: " + str(e).splitlines()[0] + f"); {remedy}"
                          ) from None
    finally:
        model.load_state_dict(saved)
        model.train(was_training)


def _check_output(cfg: RunConfig, out, n: int) -> None:
    """``out``, the model's output for one sample, holds one score per class: a floating
    point tensor of shape ``(1, n)``; else a ConfigError naming the model and ``n``."""
    name = cfg.model.name
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"model.name: {name} returns a {type(out).__name__}, not a tensor "
                          f"of scores; it must return one score per class for each sample, "
                          f"and the data set has {n} classes")
    shape = tuple(out.shape)
    if out.dim() == 2 and shape[0] == 1 and shape[1] != n:
        raise ConfigError(f"model.name: {name} returns {shape[1]} "
                          f"output{'' if shape[1] == 1 else 's'} per sample, but the data set "
                          f"has {n} classes")
    if shape != (1, n):
        raise ConfigError(f"model.name: {name} returns outputs of shape {shape} for one "
                          f"sample; expected (1, {n}): one score per class (the data set "
                          f"has {n} classes)")
    if not out.is_floating_point():
        raise ConfigError(f"model.name: {name} returns {out.dtype} outputs; scores must be "
                          "floating point")


def build_environment(cfg: RunConfig, *, data_cache: dict | None = None) -> Environment:
    """Load data, partition it, build the model and engine parts; validates everything.

    Besides each part's own checks, the config is checked against the data and the
    machine before anything is allocated for the run: the model's parameter count (built
    on the meta device first), the batch size and the samples a round trains on
    (:func:`splitfed.config.check_against_data`), and a clock trace under which no client
    could ever take part.

    ``data_cache`` (a dict, kept by the caller): the data set of the last call with the
    same ``data`` section, seed and device is reused instead of loaded again (checking
    many runs of a study, which only read it)."""
    from splitfed.config import check_against_data, check_model_size

    streams = RandomStreams(cfg.seed)
    device = resolve_device(cfg.engine.device)
    bundle = load_data(cfg, streams, device, cache=data_cache)
    server, parts = client_data(cfg, bundle, streams)
    pc = cfg.participation
    per_round = _sampled_per_round(cfg, len(parts))
    try:
        sampler = make_sampler(pc.mode, len(parts), [len(i) for i in parts],
                               clients_per_round=per_round, q=pc.q, weighting=pc.weighting)
    except ConfigError as e:
        raise ConfigError(f"participation.{e}") from None
    slots = per_round if pc.mode in ("uniform", "with_replacement") else len(parts)
    check_against_data(cfg, [len(i) for i in parts], slots,
                       server.samples_per_round if server is not None else None)
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            probe = build_model(cfg.model.name, bundle.input_shape, bundle.num_classes,
                                **cfg.model.options)
        size = sum(q.numel() for q in probe.parameters())
    except Exception:  # noqa: BLE001 - the real build below reports what is wrong
        size = 0
    chunk = cfg.engine.chunk_size or max(1, 320 // cfg.train.batch_size)
    check_model_size(cfg, size, min(chunk, max(1, slots or 1)))
    model, cut = _build_model(cfg, bundle, streams)
    model.to(device)
    _check_forward(cfg, model, bundle)
    _check_single_sample_batches(cfg, model, bundle, [len(i) for i in parts],
                                 server.samples_per_round if server is not None else None)
    clock = build_clock(cfg, len(parts), streams)
    never = clock.profiles.never_available()
    if cfg.rounds and never.all():
        raise ConfigError(f"clock.path: the trace makes every one of the {len(parts)} "
                          "clients unavailable for the whole run (available_until <= 0 or "
                          "<= available_from); give some client a window that ends after 0")
    ledger = Ledger(len(parts))
    return Environment(config=cfg, data=bundle, client_indices=parts, model=model, cut=cut,
                       sampler=sampler, transport=InProcessTransport(ledger, clock=clock),
                       ledger=ledger, streams=streams, device=device, server_data=server,
                       clock=clock)


def _sampled_per_round(cfg: RunConfig, num_clients: int) -> int | None:
    """Clients sampled per round: M, or ceil((1 + clock.over_select) M) capped at N."""
    pc, over = cfg.participation, cfg.clock.over_select
    if not over:
        return pc.clients_per_round
    if pc.mode != "uniform":
        raise ConfigError(f"clock.over_select: needs participation.mode uniform (M of N "
                          f"clients), got {pc.mode!r}; set clock.over_select=0")
    m = pc.clients_per_round
    if isinstance(m, int) and m >= 1:
        return min(num_clients, m + ceil_times(m, over))      # exact: splitfed.exact
    return m                                   # the sampler reports what is wrong


def build_clock(cfg: RunConfig, num_clients: int, streams: RandomStreams) -> VirtualClock:
    """The run's virtual clock; its profiles draw only from the ``clock`` stream."""
    rng = streams.numpy("clock")
    profiles = build_profiles(cfg.clock.profile, dict(cfg.clock.options), num_clients, rng)
    keep = cfg.participation.clients_per_round if cfg.clock.over_select else None
    return VirtualClock(profiles, rng, deadline=cfg.clock.deadline,
                        renormalise=cfg.participation.mode != "bernoulli", keep=keep)


def build_algorithm(cfg: RunConfig):
    """The configured algorithm with its options and the config's transforms."""
    cls = get_algorithm(cfg.algorithm.name)
    options = from_dict(cls.Options, cfg.algorithm.options, path="algorithm")
    return call_algorithm(cfg.algorithm.name, "its constructor", cls, options,
                          client_transforms=_transforms(cfg, "client_transforms"),
                          server_transforms=_transforms(cfg, "server_transforms"))


def check_algorithm_env(algorithm, env: Environment) -> None:
    """``algorithm.check(env)``: what the algorithm refuses of this run (a plugin's
    failure there is one line naming it, :func:`splitfed.origins.call_algorithm`),
    after the optimizer keys an algorithm with ``plain_steps`` would ignore
    (:func:`~splitfed.engine.algorithm.check_plain_steps`), then its gradient transforms'
    counts of samples and bytes (:func:`~splitfed.engine.loop.check_transform_hooks`)."""
    check_plain_steps(algorithm, env.config)
    call_algorithm(env.config.algorithm.name, "check", algorithm.check, env)
    check_transform_hooks(algorithm, env)


def _transforms(cfg: RunConfig, section: str) -> list:
    from splitfed.algorithms import TRANSFORMS
    from splitfed.engine.transforms import GradientTransform

    out = []
    for i, spec in enumerate(getattr(cfg.algorithm, section)):
        where = f"algorithm.{section}[{i}]"
        if not isinstance(spec, dict) or "name" not in spec:
            raise ConfigError(f"{where}: expected a mapping with a name, e.g. "
                              "{name: prox, mu: 0.01}")
        if not isinstance(spec["name"], str):
            raise ConfigError(f"{where}.name: expected a transform name (a string), got "
                              f"{spec['name']!r}")
        cls = TRANSFORMS.get(spec["name"])
        if cls is None:
            raise ConfigError(f"{where}.name: unknown transform {spec['name']!r}; "
                              f"available: {', '.join(sorted(TRANSFORMS))}")
        client = issubclass(cls, GradientTransform)
        if client != (section == "client_transforms"):
            other = "client_transforms" if client else "server_transforms"
            raise ConfigError(f"{where}.name: {spec['name']!r} is a "
                              f"{'gradient transform' if client else 'server step'}; "
                              f"list it under algorithm.{other}")
        opts = {k: v for k, v in spec.items() if k != "name"}
        out.append(cls(from_dict(cls.Options, opts, path=where)))
    return out


#: override keys left out of run directory names (they do not change the numbers, or
#: are shown otherwise: the algorithm's name)
_UNNAMED_KEYS = ("name", "out_dir", "progress", "checkpoint_every", "plugins",
                 "algorithm.name", "tracking")
#: the most characters the overrides take in a run directory name
MAX_OVERRIDE_CHARS = 60


def run_dir_name(cfg: RunConfig, overrides: list[str] | None = None) -> str:
    """The run directory name without its time: ``<name>-<algorithm>-<overrides>``.

    The algorithm is left out when it is already a word of the name
    (``fedavg_fmnist``); each ``key=value`` override is written as the key's last part
    and the value (``train.lr=0.05`` -> ``lr0.05``, ``partition.scheme=shard`` ->
    ``scheme_shard``, ``model.name=cnn`` -> ``cnn``, ``~partition.alpha`` ->
    ``no_alpha``; a key given twice counts once, with its last value), except keys that do
    not change the results (``out_dir``, ``progress``, ``checkpoint_every``, ``plugins``,
    ``tracking.*``) and ``algorithm.name``. Only letters, digits and ``._+-`` remain;
    past :data:`MAX_OVERRIDE_CHARS` characters the overrides are cut and a hash of them
    added, so the name stays short and one set of overrides always gives the same name.
    """
    words = [w for w in re.split(r"[-_.\s]+", cfg.name.lower()) if w]
    parts = [cfg.name]
    if cfg.algorithm.name.lower() not in words:
        parts.append(_safe(cfg.algorithm.name))
    given = _override_parts(overrides or [])
    if given:
        text = "-".join(given)
        if len(text) > MAX_OVERRIDE_CHARS:
            digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]
            text = text[:MAX_OVERRIDE_CHARS - 9].rstrip("-_.") + "-" + digest
        parts.append(text)
    return "-".join(p for p in parts if p)


def _safe(text: str) -> str:
    text = re.sub(r"[\[\]{}()'\"]", "", str(text))
    text = re.sub(r"[^A-Za-z0-9._+-]+", "_", text)
    return re.sub(r"_+", "_", text).strip("_")


def _override_parts(overrides: list[str]) -> list[str]:
    keys: dict[str, str | None] = {}
    for item in overrides:
        item = str(item).strip()
        if item.startswith("~"):
            key, value = item[1:].strip(), None
        elif "=" in item:
            key, value = (x.strip() for x in item.split("=", 1))
        else:
            continue
        if not key or any(key == k or key.startswith(k + ".") for k in _UNNAMED_KEYS):
            continue
        keys.pop(key, None)
        keys[key] = value
    lasts = [k.rsplit(".", 1)[-1] for k in keys]
    out = []
    for (key, value), last in zip(keys.items(), lasts):
        short = _safe(last if lasts.count(last) == 1 else key)
        if value is None:
            out.append(f"no_{short}")
            continue
        text = _safe(value) or "none"
        if last == "name" and lasts.count(last) == 1:
            out.append(text)
        elif text[0].isdigit() or text[0] in ".+-":
            out.append(f"{short}{text}")
        else:
            out.append(f"{short}_{text}")
    return out


#: the time in a run directory's name, as a dry run shows it (a run writes the time)
STAMP = "YYYYmmdd-HHMMSS"


def _read_only(path: Path) -> bool:
    """True when ``path`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_out_dir(cfg, overrides: list[str] | None = None) -> Path:
    """The run directory a run would create (``<out_dir>/<run_dir_name>-<time>``), after
    checking, without creating anything, that it could: the nearest existing ancestor of
    ``out_dir`` is a directory this process may write in, and no name on the way is too
    long. ConfigError otherwise, as the run would fail when it creates it."""
    out = Path(cfg.out_dir)
    base = f"{run_dir_name(cfg, overrides)}-{STAMP}"
    run_dir = out / base
    probe = Path(os.path.abspath(out))
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    problem, key = None, "out_dir"
    if not probe.is_dir():
        problem = f"{probe} is not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe}: " + ("read-only file system" if _read_only(probe)
                                  else "permission denied")
    else:
        try:
            longest = os.pathconf(probe, "PC_NAME_MAX")
        except (OSError, ValueError):
            longest = 255
        if any(len(os.fsencode(p)) > longest for p in out.parts if p != "/"):
            problem = f"a directory name of out_dir is longer than the {longest} bytes allowed"
        elif len(os.fsencode(f"{base}-99")) > longest:
            problem, key = (f"its name would be longer than the {longest} bytes allowed",
                            "name")
    if problem is not None:
        raise ConfigError(f"{key}: cannot create the run directory {short(str(run_dir))} "
                          f"({problem}); choose "
                          f"{'a shorter name' if key == 'name' else 'another out_dir'}")
    return run_dir


#: the most characters of a name or path an error message shows
SHOWN_CHARS = 60


def short(text: str, most: int = SHOWN_CHARS) -> str:
    """``text`` as an error message shows it: whole up to ``most`` characters, else its
    first ``most`` characters and its length (a message stays one short line)."""
    text = str(text)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def new_run_dir(cfg: RunConfig, overrides: list[str] | None = None) -> Path:
    """A new directory ``<out_dir>/<run_dir_name>-<YYYYmmdd-HHMMSS>[-k]``, created; what
    ``--dry-run`` checks (:func:`check_out_dir`: a name too long, an ``out_dir`` that
    cannot be written) is refused the same way first."""
    check_out_dir(cfg, overrides)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.out_dir) / f"{run_dir_name(cfg, overrides)}-{stamp}"
    run_dir, i = base, 1
    while True:
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:                 # another run of this second took it
            run_dir, i = Path(f"{base}-{i}"), i + 1
        except OSError as e:
            raise ConfigError(f"out_dir: cannot create the run directory "
                              f"{short(str(run_dir))} ({e.strerror or e}); choose another "
                              "out_dir") from None


def check_empty(run_dir: Path) -> None:
    """Refuse a ``run_dir`` that exists and holds anything but a lock file, is not a
    directory, or is a symbolic link to a missing path."""
    if not run_dir.exists():
        problem = "is a symbolic link to a missing path" if run_dir.is_symlink() else None
    elif not run_dir.is_dir():
        problem = "exists and is not a directory"
    elif any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        problem = "exists and is not empty"
    else:
        problem = None
    if problem:
        raise ConfigError(f"run directory {short(str(run_dir), 160)} {problem}; remove it "
                          "or choose another")


def lock_run_dir(run_dir: str | Path) -> DirLock:
    """Take the run directory's lock (one writer per run directory: ``.splitfed.lock``,
    an exclusive ``flock``), or raise :class:`ConfigError` naming the directory and the
    process that holds it. Hold it, as a context manager, for as long as the process
    writes into the directory; the kernel releases it when the process dies."""
    return DirLock.acquire(run_dir, "run directory",
                           hint="wait for it to end, or stop it (a run directory has one "
                                "writer at a time)", remedy="")


def write_summary(run_dir: Path, summary: dict, *, finished: bool = False) -> None:
    """Write ``run_dir/summary.json``. When the run had already ended (``finished``: a
    resume that ran no round), a whole summary of the same status is kept as it is: its
    provenance and wall time say which code made the run and how long that took (a
    study's reuse check reads them). A missing or damaged one is written again with
    ``provenance`` null: the code that made the run is not known here, and a study then
    reruns the run instead of reusing it."""
    path = run_dir / "summary.json"
    if finished:
        kept = read_json_object(path)
        if kept is not None and kept.get("status") == summary["status"]:
            return
        summary = {**summary, "provenance": None}
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")


def config_data(cfg: RunConfig) -> dict:
    """``cfg`` as plain data, as ``config.yaml`` holds it and a resume reads it back (the
    record each checkpoint keeps, :func:`splitfed.checkpoint.config_record`)."""
    return yaml_round_trip(to_dict(cfg))


def check_resume_config(run_dir: Path, ckpt: dict, cfg: RunConfig, *,
                        warn: bool = True) -> None:
    """Refuse to resume ``run_dir`` when its checkpoint was written under another config
    than ``cfg`` (its ``config.yaml``) in any key but those a resume may change
    (:data:`splitfed.checkpoint.FREE_KEYS`): :class:`~splitfed.errors.FormatError`
    naming the first key that differs and both values. A checkpoint written before
    checkpoints recorded their config is taken without this check (a warning says so
    when ``warn``)."""
    where = Path(run_dir) / CHECKPOINT
    if not check_config(ckpt, config_data(cfg), where) and warn:
        print(f"splitfed: warning: {where}: it records no config (written by an earlier "
              "splitfed), so config.yaml cannot be checked against it; the run is resumed "
              "under config.yaml as it is", file=sys.stderr, flush=True)


def write_config(cfg: RunConfig, path: Path) -> None:
    """``cfg`` as YAML to ``path``, atomically (:func:`~splitfed.files.atomic_write_text`)."""
    atomic_write_text(path, dump_text(to_dict(cfg), sort_keys=False))


#: every file a run writes in its directory (besides the lock and temp files; the
#: trackers' tracking.json and folders, splitfed.tracking)
RUN_FILES = ("config.yaml", "partition.txt", "metrics.jsonl", "summary.json", CHECKPOINT)
#: files earlier versions wrote: checked like the run's files, removed when a run resumes
LEGACY_FILES = ("metrics.csv",)


def check_run_files(run_dir: Path) -> None:
    """Raise :class:`~splitfed.errors.FormatError` naming the first of :data:`RUN_FILES`
    in ``run_dir`` that exists and is not a regular file (a directory, a pipe, a device,
    or a symbolic link, which splitfed never writes through), before anything is changed:
    otherwise the run would fail only after training, half-written."""
    from splitfed.tracking import TRACKING_FILE

    for name in (*RUN_FILES, TRACKING_FILE, *LEGACY_FILES):
        path = run_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise FormatError(f"{path}: cannot be examined ({e.strerror or e}); the run "
                              "directory is damaged, delete it to rerun the run") from None
        if stat.S_ISREG(mode):
            continue
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device")
        raise FormatError(f"{path} is {kind}, not a regular file; the run directory is "
                          "damaged or not splitfed's: delete it to rerun the run from the "
                          "start")


def run_experiment(cfg: RunConfig, *, write: bool = True,
                   run_dir: Path | None = None,
                   overrides: list[str] | None = None) -> RunResult:
    """Validate, build, run every round, write metrics and a summary; returns the result.

    ``run_dir``: write into this directory (created; it must be absent or empty) instead
    of a new timestamped ``<out_dir>/<name>-<algorithm>-<overrides>-<time>/``
    (:func:`run_dir_name`; ``overrides``: the command line's ``key=value`` items that
    made ``cfg``, named in the directory). Ignored when ``write`` is false.
    The run directory is locked (:func:`lock_run_dir`) while the run writes it. Ctrl-C
    raises :class:`~splitfed.errors.RunInterrupted` with the directory to resume (None
    when the run had not started: nothing is left behind then).
    """
    if write and run_dir is not None:
        run_dir = Path(run_dir)
        check_empty(run_dir)
    try:
        algorithm = build_algorithm(cfg)
        env = build_environment(cfg)
        check_algorithm_env(algorithm, env)
    except KeyboardInterrupt:
        raise RunInterrupted(None) from None
    if not write:
        return _execute(cfg, algorithm, env, None)
    if run_dir is None:
        check_out_dir(cfg, overrides)           # as --dry-run: before anything is written
    try:
        state = initial_state(algorithm, env)   # a failing init_state leaves nothing
    except KeyboardInterrupt:
        raise RunInterrupted(None) from None
    preflight(cfg)                              # the MLflow store, before the run directory
    created = run_dir is None or not run_dir.exists()
    if run_dir is None:
        run_dir = new_run_dir(cfg, overrides)
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"run directory {short(str(run_dir))}: cannot create it "
                              f"({e.strerror or e}); choose another") from None
    with lock_run_dir(run_dir):
        check_empty(run_dir)                   # again, now that no one else writes it
        check_run_files(run_dir)
        try:
            write_config(cfg, run_dir / "config.yaml")
            write_partition(run_dir, env)
        except KeyboardInterrupt:               # before the first round: leave nothing
            for p in run_dir.iterdir():
                if p.name != LOCK_NAME:
                    p.unlink()
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise RunInterrupted(None) from None
        return _execute(cfg, algorithm, env, run_dir, state=state, initial=True)


def write_partition(run_dir: Path, env: Environment, *, if_missing: bool = False) -> None:
    """``partition.txt``: each client's sample count and label histogram; with
    ``if_missing`` only where it is absent (a resumed run whose file was deleted)."""
    where = run_dir / "partition.txt"
    if if_missing and where.exists():
        return
    labels = env.data.train.y.cpu().numpy()
    atomic_write_text(where, partition_summary(env.client_indices, labels,
                                               env.data.num_classes) + "\n")


def _execute(cfg: RunConfig, algorithm, env: Environment, run_dir: Path | None, *,
             state: dict | None = None, start_round: int = 1,
             records: list[dict] | None = None, wall_offset: float = 0.0,
             resumed_from: list[int] | None = None, finished: str | None = None,
             started: dict | None = None, sinks: list | None = None,
             initial: bool = False) -> RunResult:
    """Run rounds ``start_round..`` (none when ``finished`` names the status of a run that
    already ended), checkpointing into ``run_dir``; write metrics and the summary.

    ``started``: the checkpoint's ``threads``, ``cpu_capability`` and ``resumed_threads``
    (a resumed run). ``sinks``: the trackers, opened by the caller (a resume opens them
    before it changes the run directory); else they are opened here. ``initial``:
    ``state`` is :func:`~splitfed.engine.loop.initial_state`'s (a new run). Ctrl-C raises
    :class:`~splitfed.errors.RunInterrupted`: the last checkpoint is whole (written
    atomically), ``metrics.jsonl`` holds whole records."""
    started = started or {"threads": torch.get_num_threads(),
                          "cpu_capability": cpu_capability(), "resumed_threads": []}
    # the code version (commit, digests of the package and the plugins), read as the run
    # starts: the code a process runs is what it imported, however the checkout changes
    # while it runs (git_commit and source_digest are read once per process)
    code = provenance()
    try:
        logger = MetricLogger(run_dir)
        logger.records = list(records or [])
        if sinks is not None:
            logger.sinks = sinks
        elif run_dir is not None and finished is None:
            try:
                logger.sinks = open_trackers(cfg, run_dir, start_round)
            except BaseException:
                logger.close("failed")
                raise
        t0 = time.perf_counter()
        checkpoint = None
        if run_dir is not None:
            checkpoint = Checkpointer(run_dir, env, logger, every=cfg.checkpoint_every,
                                      rounds=cfg.rounds, wall_offset=wall_offset,
                                      resumed_from=resumed_from,
                                      clock=lambda: time.perf_counter() - t0,
                                      threads=started["threads"],
                                      cpu=started["cpu_capability"],
                                      resumed_threads=started["resumed_threads"],
                                      config=config_data(cfg))
        status = "failed"
        try:
            if finished is None:
                state, status = run_rounds(algorithm, env, logger, state, start_round,
                                           checkpoint=checkpoint,
                                           progress_lines=run_dir is not None,
                                           initial=initial)
            else:
                status = finished
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            logger.close(status)
        wall = wall_offset + time.perf_counter() - t0
        result = RunResult(status, logger.records, run_dir, wall, state)
        if run_dir is not None:
            numbers = result.numbers
            summary = {"name": cfg.name, "algorithm": cfg.algorithm.name,
                       "dataset": cfg.data.name, "model": cfg.model.name, "status": status,
                       "rounds": numbers["rounds"],
                       "diverged_round": numbers["diverged_round"],
                       "final_test_acc": numbers["final_test_acc"],
                       "best_test_acc": numbers["best_test_acc"],
                       "wall_time_s": round(wall, 3),
                       "resumed_from": list(resumed_from or []),
                       "threads": started["threads"],
                       "cpu_capability": started["cpu_capability"],
                       "resumed_threads": list(started["resumed_threads"]),
                       "provenance": code}
            write_summary(run_dir, summary, finished=finished is not None)
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir) from None
    return result


@dataclass
class Resume:
    """A checked checkpoint, restored into a run's environment (:func:`open_resume`)."""

    checkpoint: dict
    state: dict | None          # the algorithm state, modules and optimizers loaded
    records: list[dict]         # metrics.jsonl up to the checkpoint

    @property
    def round(self) -> int:
        return self.checkpoint["round"]

    def finished(self, cfg: RunConfig) -> bool:
        return run_ended(self.checkpoint, cfg)

    def started(self, resuming: bool) -> dict:
        """The thread counts for :func:`_execute` (this process's added when resuming)."""
        ck = self.checkpoint
        more = [torch.get_num_threads()] if resuming else []
        return {"threads": ck["threads"], "cpu_capability": ck["cpu_capability"],
                "resumed_threads": list(ck["resumed_threads"]) + more}


def run_ended(ckpt: dict | None, cfg: RunConfig) -> bool:
    """The run of checkpoint ``ckpt`` had ended: it diverged, or it reached ``cfg.rounds``
    (a run that ended ``no_client_trained`` and is extended to more rounds goes on)."""
    return ckpt is not None and (ckpt["status"] in ENDS_EARLY or ckpt["round"] >= cfg.rounds)


def record_statuses(records: list[dict], cfg: RunConfig) -> tuple[tuple[str, ...], str]:
    """The statuses a finished run of ``cfg`` whose records are ``records`` can have, as
    the round loop (:func:`splitfed.engine.loop.run_rounds`) decides it, and what in the
    records says so: ``diverged`` when a record holds a non-finite loss or accuracy and
    the records end at that round (the run stops there); else, when the records reach
    the run's last round, ``no_client_trained`` when the algorithm trains clients and no
    round used one, else ``completed`` (either when the records do not say how many
    clients each round used, or the algorithm is not known in this process). None of
    them (an empty tuple) when the records say the run did not end."""
    last = last_value(records, "round")
    diverged = divergence(records)
    if diverged is not None:
        if diverged != last:
            return (), (f"a non-finite loss or accuracy at round {diverged} and records "
                        f"after it, to round {last}")
        return ("diverged",), f"a non-finite loss or accuracy at round {diverged}"
    if last != cfg.rounds:
        return (), (f"no divergence and its last round is {last}, not the run's last "
                    f"round {cfg.rounds}")
    rounds = [r for r in records if r.get("round", 0) > 0]
    used = [r.get("clients_used") for r in rounds]
    trained = next((r["round"] for r, n in zip(rounds, used) if _some(n)), None)
    if trained is not None:
        return ("completed",), f"no divergence and clients trained in round {trained}"
    trains = _trains_clients(cfg)
    if not rounds or trains is False:
        return ("completed",), "no divergence"
    if trains and all(is_finite_number(n) and n == 0 for n in used):
        return ("no_client_trained",), "no divergence and no client trained in any round"
    return ("completed", "no_client_trained"), "no divergence"


def _some(value) -> bool:
    """A finite number other than 0 (a round's ``clients_used`` when clients trained)."""
    return is_finite_number(value) and value != 0


def _trains_clients(cfg: RunConfig) -> bool | None:
    """Whether the run's algorithm trains clients (``federated``); None when it is not
    known here."""
    try:
        return bool(getattr(get_algorithm(cfg.algorithm.name), "federated", True))
    except SplitfedError:
        return None


def ended_without_checkpoint(run_dir: Path, cfg: RunConfig) -> RunResult | None:
    """The result of the run in ``run_dir`` when it ended but kept no checkpoint
    (``checkpoint_every: 0``): a whole ``summary.json`` with a finished status, and a
    ``metrics.jsonl`` that ends at the round the summary says and gives that status
    (:func:`record_statuses`). It is read from those files, which stay as they are; its
    ``state`` is empty (the model was not kept). None otherwise: the run starts again
    from round 0."""
    summary = read_json_object(run_dir / "summary.json")
    if summary is None or summary.get("status") not in FINISHED_STATUSES:
        return None
    try:
        records = read_records(run_dir / "metrics.jsonl")
    except (FormatError, OSError):
        return None
    if not records or last_value(records, "round") != summary.get("rounds"):
        return None
    if summary["status"] not in record_statuses(records, cfg)[0]:
        return None
    wall = summary.get("wall_time_s")
    return RunResult(summary["status"], records, run_dir,
                     float(wall) if is_finite_number(wall) else 0.0, {})


def tidy_for_resume(run_dir: Path, env: Environment) -> None:
    """What a resume does first in ``run_dir``, with or without a checkpoint: remove the
    temporary files a stopped run left, and write ``partition.txt`` if it is missing."""
    remove_stale_temp_files(run_dir)
    write_partition(run_dir, env, if_missing=True)


def clear_for_restart(run_dir: Path) -> None:
    """Remove what a run that kept no checkpoint left of its rounds (``metrics.jsonl``,
    ``summary.json``, an earlier version's csv), so that it starts again from round 0 in
    ``run_dir``: a resume without a checkpoint, ``config.yaml`` and ``partition.txt``
    kept."""
    for name in ("metrics.jsonl", "summary.json", *LEGACY_FILES):
        (run_dir / name).unlink(missing_ok=True)


def open_resume(run_dir: Path, cfg: RunConfig, algorithm, env: Environment
                ) -> Resume | None:
    """Load and check ``run_dir``'s checkpoint and the metrics records it counts, and
    restore it into ``env`` (None when there is no checkpoint). Changes no file: a bad
    checkpoint raises :class:`~splitfed.errors.FormatError` naming it, with the run
    directory as it was. The caller then cuts ``metrics.jsonl`` with
    :func:`~splitfed.checkpoint.truncate_metrics`, holding :func:`lock_run_dir`."""
    ckpt = load_checkpoint(run_dir, rounds=cfg.rounds)
    if ckpt is None:
        return None
    records = checkpoint_records(run_dir, ckpt, rounds=cfg.rounds)
    return _restore(run_dir, ckpt, records, algorithm, env)


def _restore(run_dir: Path, ckpt: dict, records: list[dict], algorithm, env) -> Resume:
    check_resume_config(run_dir, ckpt, env.config)   # the same run: the same config (a
    # changed key is named here, before the state's shapes would differ without a name)
    template = resume_template(algorithm, env, ckpt["state"])
    state = restore(env, ckpt, template, where=run_dir / CHECKPOINT)
    return Resume(ckpt, state, records)


def resume_template(algorithm, env, saved: dict) -> dict:
    """What a checkpoint's algorithm state ``saved`` must fit, and the objects it is
    loaded into: ``checkpoint_template(env, init_state(env), saved)`` (a plugin
    algorithm's failure in either is one line naming it)."""
    name = env.config.algorithm.name
    initial = call_algorithm(name, "init_state", algorithm.init_state, env)
    return call_algorithm(name, "checkpoint_template", algorithm.checkpoint_template, env,
                          initial, saved)


def resume_experiment(run_dir: str | Path) -> RunResult:
    """Continue the run in ``run_dir`` from its last checkpoint (``checkpoint.pt``),
    rebuilding it from the directory's ``config.yaml``; see :mod:`splitfed.checkpoint`.

    The config, the checkpoint and the metrics records are all checked before any file
    is changed; a checkpoint that is torn, foreign, of an earlier format or altered is
    refused (:class:`~splitfed.errors.FormatError` naming it), and loading it cannot
    execute code. The directory is locked while the run writes it (:func:`lock_run_dir`).
    Without a checkpoint the run starts again from round 0 in the same directory. A run
    that already ended (its checkpoint is at the last round, or it diverged; or, when it
    kept no checkpoint, its summary and records say so: :func:`ended_without_checkpoint`)
    is not run again: its result is returned. Raising ``rounds`` in ``config.yaml`` extends a
    finished run; any other change to ``config.yaml`` that changes the run's numbers is
    refused (:func:`check_resume_config`), as is a checkpoint of another run. The
    summary's ``resumed_from`` lists the rounds the run was resumed at.
    Resuming with another thread count (or CPU kernels) than the run was started with
    prints a warning: the results then differ from an uninterrupted run in the last bits.
    Ctrl-C raises :class:`~splitfed.errors.RunInterrupted`.
    """
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; give the directory "
                          "of a run (runs/<name>-<time>/)")
    try:
        with lock_run_dir(run_dir):
            check_run_files(run_dir)            # before anything is read or changed
            return _resume(run_dir, saved)
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir) from None


def _resume(run_dir: Path, saved: Path) -> RunResult:
    try:
        cfg = build_config(load_yaml(saved))
    except ConfigError as e:
        raise ConfigError(f"{saved}: {e}") from None
    ckpt = load_checkpoint(run_dir, rounds=cfg.rounds)  # checked before the data loads
    if ckpt is None:
        done = ended_without_checkpoint(run_dir, cfg)
        if done is not None:
            return done
    records = None if ckpt is None else checkpoint_records(run_dir, ckpt, rounds=cfg.rounds)
    ended = run_ended(ckpt, cfg)
    if not ended:
        preflight(cfg)                          # the MLflow store, without retries
    algorithm = build_algorithm(cfg)
    env = build_environment(cfg)
    resume = None                                         # every check; no file changed
    if ckpt is not None:
        resume = _restore(run_dir, ckpt, records, algorithm, env)
    start = 1 if ckpt is None else ckpt["round"] + 1
    sinks = None if ended else open_trackers(cfg, run_dir, start)  # before any change
    try:
        tidy_for_resume(run_dir, env)
        if resume is None:
            clear_for_restart(run_dir)
            common = {}
        else:
            kept = truncate_metrics(run_dir, ckpt["records"], ckpt["round"])
            for name in LEGACY_FILES:            # an earlier version's csv of the records
                (run_dir / name).unlink(missing_ok=True)
            common = {"state": resume.state, "records": [decode_record(r) for r in kept],
                      "wall_offset": ckpt["wall_time_s"]}
    except BaseException:
        for sink in sinks or []:
            sink.close("failed")
        raise
    if resume is None:
        return _execute(cfg, algorithm, env, run_dir, sinks=sinks)
    if ended:
        return _execute(cfg, algorithm, env, run_dir, **common,
                        resumed_from=list(ckpt["resumed_from"]), finished=ckpt["status"],
                        started=resume.started(False))
    for line in thread_warnings(ckpt):
        print(f"splitfed: warning: {run_dir}: {line}", file=sys.stderr, flush=True)
    return _execute(cfg, algorithm, env, run_dir, **common, start_round=start,
                    resumed_from=list(ckpt["resumed_from"]) + [ckpt["round"]],
                    started=resume.started(True), sinks=sinks)
