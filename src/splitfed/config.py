"""The run configuration: typed dataclasses, loaded from YAML, overridden by ``key=value``.

Sections whose options depend on a chosen component (``data``, ``partition``, ``model``,
``algorithm``, ``clock``) have a few typed fields of their own; any other key in them is an
option of the chosen data set / partition scheme / model / algorithm / clock profile and is
validated by that component against its own signature or options dataclass, with the
dotted key in the message. Every shipped config is loaded in a test.

The top-level ``plugins`` list names modules that register components of their own
(:mod:`splitfed.registry`); :func:`build_config` imports them before it validates the
rest, so a plugin's algorithm, model, data set, partitioner or clock profile is checked
like a built-in one.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from splitfed.configtools import DELETE, from_dict, load_yaml, merge, parse_overrides
from splitfed.errors import ConfigError
from splitfed.exact import ceil_times
from splitfed.limits import MAX_MODEL_PARAMS

CONFIG_DIR = Path(__file__).parent / "configs"

# Upper bounds of numeric keys: far above any real run, low enough that a mistyped value
# (1e18 steps, 10**30 rounds) is refused at once instead of hanging or exhausting memory.
# Keys that depend on the data (num_clients, batch_size, the samples a round trains on)
# are also checked against it when the run is built (splitfed.experiment).
MAX_ROUNDS = 10**7
MAX_CLIENTS = 10**6
MAX_BATCH_SIZE = 10**6
MAX_LOCAL_STEPS = 10**6
MAX_LOCAL_EPOCHS = 10**4
MAX_SAMPLES = 10**9
#: samples one round's cohort may train on (sum over its clients of K * batch_size): the
#: batch plans of a round hold 8 bytes per sample, so this keeps them under 400 MB
MAX_ROUND_SAMPLES = 5 * 10**7
MAX_OVER_SELECT = 100.0
#: the range of a seed (``seed``, a study's ``seeds``, ``splitfed sweep --seeds``): a
#: signed 64-bit integer, as the run's config.yaml and checkpoint keep it
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1


@dataclass
class DataConfig:
    name: str = field(default="fashion_mnist", metadata={"help": "data set (splitfed list)"})
    data_dir: str | None = field(default=None, metadata={"help": "directory of data files"})
    limit_train: int | None = field(default=None, metadata={
        "gt": 0, "le": MAX_SAMPLES, "help": "keep a random subset of this many training samples"})
    limit_test: int | None = field(default=None, metadata={
        "gt": 0, "le": MAX_SAMPLES, "help": "keep a random subset of this many test samples"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "data-set options (e.g. label_mode for cifar100, alpha/beta for synthetic)"})


@dataclass
class PartitionConfig:
    scheme: str = field(default="iid", metadata={
        "help": "iid | dirichlet | pathological | shard | natural"})
    num_clients: int = field(default=10, metadata={
        "ge": 1, "le": MAX_CLIENTS, "help": "N clients (at most the training samples)"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "scheme parameters, e.g. alpha, num_classes_per_partition"})


@dataclass
class ModelConfig:
    name: str = field(default="lenet5", metadata={"help": "model (splitfed list)"})
    cut: Any = field(default=None, metadata={
        "help": "client blocks: an int, a block name, or null for the model's default"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "model options (e.g. width)"})


@dataclass
class TrainConfig:
    batch_size: int = field(default=32, metadata={
        "ge": 1, "le": MAX_BATCH_SIZE,
        "help": "B samples per step (at most the training samples; a client holding fewer "
                "than B repeats samples within a batch)"})
    local_steps: int | None = field(default=None, metadata={
        "ge": 1, "le": MAX_LOCAL_STEPS,
        "help": "K local steps per round (exclusive with local_epochs)"})
    local_epochs: float | None = field(default=None, metadata={
        "gt": 0, "le": MAX_LOCAL_EPOCHS,
        "help": "E local epochs: K = ceil(ceil(D_n / batch_size) * E), exact in the "
                "decimal written (default 1)"})
    lr: float = field(default=0.01, metadata={"gt": 0, "help": "client learning rate"})
    momentum: float = field(default=0.0, metadata={
        "ge": 0, "lt": 1,
        "help": "SGD momentum of the clients' steps and of a server's training steps (as "
                "torch.optim.SGD, no dampening; the clients' buffers start fresh every "
                "round); refused by algorithms that step without an optimizer "
                "(musplitfed, gas)"})
    weight_decay: float = field(default=0.0, metadata={
        "ge": 0, "help": "L2 weight decay of the clients' and a server's training steps: "
                         "wd * p added to every gradient (as torch.optim.SGD; 0: none); "
                         "refused by algorithms that step without an optimizer "
                         "(musplitfed, gas)"})
    lr_decay: float = field(default=1.0, metadata={
        "gt": 0, "le": 1, "help": "the step sizes of client and server training steps "
                                 "(train.lr, algorithm.server_lr) are multiplied by this "
                                 "every round; global rates applied to the aggregate are "
                                 "not (paper 004 Sec. VI: 0.99)"})
    lr_min: float = field(default=0.0, metadata={
        "ge": 0, "help": "floor of the decayed learning rates (paper 004: 0.001)"})

    def __post_init__(self):
        if self.local_steps is None and self.local_epochs is None:
            self.local_epochs = 1.0
        elif self.local_steps is not None and self.local_epochs is not None:
            raise ConfigError("set only one of local_steps and local_epochs "
                              f"(got local_steps={self.local_steps}, "
                              f"local_epochs={self.local_epochs}); set the other to null, "
                              "e.g. train.local_epochs=null")


@dataclass
class ParticipationConfig:
    mode: Literal["full", "uniform", "with_replacement", "bernoulli"] = field(
        default="full", metadata={
            "help": "who takes part in a round: full (every client), uniform (M of N "
                    "without replacement), with_replacement (M i.i.d. uniform draws, paper "
                    "000), bernoulli (client n with probability q_n, weight a_n / q_n, "
                    "paper 002 eq. 3)"})
    clients_per_round: int | None = field(default=None, metadata={
        "ge": 1, "le": MAX_CLIENTS, "help": "M, for uniform and with_replacement"})
    q: Any = field(default=None, metadata={
        "help": "bernoulli participation probability: one number or a list per client"})
    weighting: Literal["data_size", "uniform"] = field(default="data_size", metadata={
        "help": "base aggregation weights a_n: data_size (D_n / sum_m D_m) or uniform "
                "(1 / N); participation.mode turns them into a round's weights"})


@dataclass
class EngineConfig:
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:0, ..."})
    chunk_size: int | None = field(default=None, metadata={
        "ge": 1, "le": MAX_CLIENTS,
        "help": "clients per batched call (null: about 320 samples per call in training, "
                "512 in MU-SplitFed's forward-only passes)"})
    eval_batch_size: int | None = field(default=None, metadata={
        "ge": 1, "le": MAX_BATCH_SIZE,
        "help": "test samples per evaluation call (null: 256 on a CPU, 2048 on a GPU; a "
                "value above the test set's size evaluates it in one call; the metrics depend "
                "on it only in the logits' last bits)"})


@dataclass
class AlgorithmConfig:
    name: str = field(default="fedavg", metadata={"help": "algorithm (splitfed list)"})
    client_transforms: list[dict[str, Any]] = field(default_factory=list, metadata={
        "help": "gradient transforms added to the clients' local steps, in order: "
                "[{name: prox, mu: 0.01}] (splitfed list)"})
    server_transforms: list[dict[str, Any]] = field(default_factory=list, metadata={
        "help": "server steps: one aggregating step (rate, momentum, fedadam, ...) that "
                "replaces the algorithm's, then steps that train further (server_train)"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "options of the algorithm (e.g. global_lr, tau for musplitfed); also "
                "given as keys of this section"})


@dataclass
class ServerDataConfig:
    """The server's own data for hybrid FL (paper 004): a pool, and D_s^t drawn from it."""

    fraction: float = field(default=0.01, metadata={
        "gt": 0, "lt": 1, "help": "server pool as a fraction of the training set "
                                  "(paper 004 Sec. VI: 0.01 for MNIST, 0.05 for CIFAR)"})
    min_per_class: int = field(default=10, metadata={
        "ge": 0, "le": MAX_SAMPLES,
        "help": "the pool holds at least this many samples per class on average "
                "(a floor for small data sets; no effect on MNIST or CIFAR)"})
    samples_per_round: int | None = field(default=None, metadata={
        "ge": 1, "le": MAX_SAMPLES,
        "help": "m_s: samples of D_s^t, drawn from the pool without replacement "
                "every round (null: the whole pool)"})
    full_batch: bool = field(default=False, metadata={
        "help": "server gradients (g_s and the E server steps) on the whole D_s^t"})
    shift_cosine: float | None = field(default=None, metadata={
        "gt": 0, "le": 1, "help": "class-distribution shift: cosine similarity of the "
                                  "pool's class distribution to the training set's "
                                  "(paper 004 Fig. 7: 0.95; null: IID)"})
    disjoint: bool = field(default=True, metadata={
        "help": "remove the pool from the training set before partitioning it"})
    always: bool = field(default=False, metadata={
        "help": "build the pool also for algorithms that use no server data, so that "
                "baselines (fedavg, scaffold) get the hybrid runs' client data (without it "
                "such an algorithm refuses other server_data values, which it would ignore)"})


@dataclass
class ClockConfig:
    """Simulated time (splitfed.engine.clock; docs/clock.md). Any other key in this
    section is an option of the chosen profile (e.g. ``client_compute``, ``mean``,
    ``path``)."""

    profile: str = field(default="fixed", metadata={
        "help": "fixed | exponential | fedscale | trace (default: fixed speeds, clients "
                "1e9 MAC/s, uplink 1.25e6 B/s, downlink 5e6 B/s, server 1e11 MAC/s)"})
    deadline: float | None = field(default=None, metadata={
        "gt": 0, "help": "round deadline in simulated seconds: clients whose model "
                         "upload arrives later are dropped from the round (null: none; "
                         "not with participation.mode with_replacement)"})
    over_select: float = field(default=0.0, metadata={
        "ge": 0, "le": MAX_OVER_SELECT,
        "help": "over-selection (FedScale's over-commitment): sample "
                "ceil((1 + over_select) M) clients and keep the M the profiles "
                "predict to finish first (participation.mode uniform; 0: off)"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "profile parameters (speeds, distribution parameters, trace path)"})


@dataclass
class TrackingConfig:
    """Experiment trackers that receive every record of the run (splitfed.tracking,
    docs/results_data.md); ``metrics.jsonl`` is written either way. A tracker whose
    package is not installed is refused here, before anything is written."""

    tensorboard: bool = field(default=False, metadata={
        "help": "write TensorBoard event files into <run_dir>/tensorboard "
                "(pip install 'splitfed[tensorboard]')"})
    mlflow: bool = field(default=False, metadata={
        "help": "log the config, the records and the provenance to an MLflow run "
                "(pip install 'splitfed[mlflow]')"})
    mlflow_uri: str | None = field(default=None, metadata={
        "help": "MLflow tracking URI (null: a file store in <run_dir>/mlruns)"})
    experiment: str | None = field(default=None, metadata={
        "help": "MLflow experiment name (null: the run's name)"})

    def __post_init__(self):
        for key, value in (("mlflow_uri", self.mlflow_uri), ("experiment", self.experiment)):
            if value is not None and (not value.strip() or "\x00" in value):
                raise ConfigError(f"{key}: {value!r} is empty; give a value or null")
        from splitfed.tracking import check_installed

        check_installed(self)


@dataclass
class RunConfig:
    name: str = field(default="run", metadata={"help": "run name (prefix of the run dir)"})
    seed: int = field(default=0, metadata={
        "ge": MIN_SEED, "le": MAX_SEED, "help": "master seed of every random stream"})
    rounds: int = field(default=20, metadata={
        "ge": 0, "le": MAX_ROUNDS,
        "help": "T communication rounds (0: only the initial model is evaluated, as "
                "round 0)"})
    eval_every: int = field(default=1, metadata={
        "ge": 1, "le": MAX_ROUNDS,
        "help": "evaluate the global model on the test set every k rounds (round 0 and "
                "the last round always are)"})
    eval_last: int = field(default=0, metadata={
        "ge": 0, "le": MAX_ROUNDS,
        "help": "also evaluate every round of the last N rounds (0: only every eval_every "
                "rounds), e.g. for a study's average_last (paper 003 Tables 7-9 average "
                "the test accuracy over the last 10% of the rounds)"})
    checkpoint_every: int = field(default=10, metadata={
        "ge": 0, "le": MAX_ROUNDS,
        "help": "write checkpoint.pt every k rounds and at the last round, for "
                "splitfed run --resume (0: no checkpoints)"})
    out_dir: str = field(default="runs", metadata={
        "help": "directory in which every run creates its own run directory (named "
                "after the run's name, algorithm, overrides and start time)"})
    plugins: list[str] = field(default_factory=list, metadata={
        "help": "plugin modules (names, from the Python environment) imported before "
                "the config is validated; "
                "they register algorithms, models, data sets, partitioners and clock "
                "profiles (docs/extending.md)"})
    progress: bool = field(default=True, metadata={"help": "progress bar on the console"})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server_data: ServerDataConfig = field(default_factory=ServerDataConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        bad = [c for c in ("/", "\\") if c in self.name]
        control = any(ord(c) < 32 or ord(c) == 127 for c in self.name)
        if not self.name.strip() or self.name in (".", "..") or bad or control:
            raise ConfigError(f"name: {self.name!r} must be a non-empty file name without "
                              "'/', '\\' or control characters (newline, tab, NUL; it "
                              "prefixes the run directory; choose the parent directory with "
                              "out_dir)")
        if not self.out_dir or "\x00" in self.out_dir:
            raise ConfigError(f"out_dir: {self.out_dir!r} is not a usable directory path")
        if self.clock.deadline is not None and self.participation.mode == "with_replacement":
            raise ConfigError(
                "clock.deadline: not with participation.mode with_replacement (a client "
                "drawn twice is one device, late or not by its last upload, which the "
                "round learns only after its first slots were aggregated); set "
                "clock.deadline=null or participation.mode uniform")


_OPEN_SECTIONS = {"data": DataConfig, "partition": PartitionConfig, "model": ModelConfig,
                  "algorithm": AlgorithmConfig, "clock": ClockConfig}


@functools.cache
def _field_names(section: str) -> frozenset[str]:
    """The names of an open section's own fields (``name``, ``options``, ...): the keys
    that are not the component's options."""
    return frozenset(f.name for f in fields(_OPEN_SECTIONS[section]))


def merge_config(base: dict, override: dict) -> dict:
    """Deep-merge two config mappings (:func:`splitfed.configtools.merge`) where an option
    of an open section is one key whether it is written flat (``partition.alpha``) or
    under the section's ``options`` (``partition.options.alpha``).

    Each side is brought to the flat spelling first, so the later source wins whichever
    spelling either used; one source giving both spellings different values is refused.
    ``~section.options`` or ``section.options=null`` (an override removing the options)
    removes every option."""
    base, override = _lift_options(base), _lift_options(override)
    for section in _OPEN_SECTIONS:
        body, there = override.get(section), base.get(section)
        if (isinstance(body, dict) and "options" in body
                and (body["options"] is DELETE or body["options"] is None)
                and isinstance(there, dict)):
            known = _field_names(section)
            override = {**override, section: {k: v for k, v in body.items()
                                              if k != "options"}}
            base = {**base, section: {k: v for k, v in there.items() if k in known}}
    return merge(base, override)


def keys_overlap(a: str, b: str) -> bool:
    """Whether dotted keys ``a`` and ``b`` set a common value: equal, one inside the other,
    or one option spelled flat and under its section's ``options``."""
    x, y = _option_key(a), _option_key(b)
    if x == y or x.startswith(y + ".") or y.startswith(x + "."):
        return True
    return _all_options(x, y) or _all_options(y, x)


def key_covers(outer: str, key: str) -> bool:
    """Whether setting dotted key ``outer`` sets all of what setting ``key`` sets: ``key``
    is ``outer`` or inside it (an option spelled flat or under its section's ``options``;
    ``section.options`` holds every option of the section)."""
    x, y = _option_key(key), _option_key(outer)
    return x == y or x.startswith(y + ".") or _all_options(y, x)


def _option_key(key: str) -> str:
    """``section.options.name...`` as ``section.name...`` for an open section."""
    section, _, rest = key.partition(".")
    if section in _OPEN_SECTIONS and rest.startswith("options."):
        return f"{section}.{rest[len('options.'):]}"
    return key


def _all_options(whole: str, key: str) -> bool:
    """Whether ``whole`` is ``section.options`` and ``key`` one of that section's options."""
    section, _, rest = whole.partition(".")
    if section not in _OPEN_SECTIONS or rest != "options":
        return False
    other, _, name = key.partition(".")
    return other == section and name.split(".")[0] not in _field_names(section)


def _lift_options(raw: Any) -> Any:
    """``raw`` with the ``options`` mapping of each open section moved to flat keys."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for section in _OPEN_SECTIONS:
        body = out.get(section)
        if not isinstance(body, dict) or not isinstance(body.get("options"), dict):
            continue
        known = _field_names(section)
        flat = {k: v for k, v in body.items() if k != "options"}
        for key, value in body["options"].items():
            if key in known:
                raise ConfigError(
                    f"{section}.options.{key}: {key!r} is a key of the {section} section, "
                    f"not an option of its component; write {section}.{key}")
            if key in flat and flat[key] != value:
                raise ConfigError(
                    f"{section}.{key}: given twice, as {section}.{key} ({flat[key]!r}) and "
                    f"{section}.options.{key} ({value!r}); give it once")
            flat[key] = value
        out[section] = flat
    return out


def _fold_options(raw: dict) -> dict:
    """Move unknown keys of open sections into their ``options`` mapping."""
    out = dict(raw)
    for section in _OPEN_SECTIONS:
        body = out.get(section)
        if not isinstance(body, dict):
            continue
        known = _field_names(section)
        given = body.get("options")
        if given is not None and not isinstance(given, dict):
            raise ConfigError(f"{section}.options: expected a mapping of option names to "
                              f"values, got {given!r}")
        opts = dict(given or {})
        folded = {k: v for k, v in body.items() if k in known}
        opts.update({k: v for k, v in body.items() if k not in known})
        folded["options"] = opts
        out[section] = folded
    return out


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``splitfed list``)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a shipped config; "
                      f"shipped configs: {names}")


def build_config(raw: dict | None = None, overrides: list[str] | None = None, *,
                 plugins: list[str] | None = None) -> RunConfig:
    """The config of ``raw`` (a mapping, as YAML gives it) with ``key=value`` overrides.

    The plugins are imported first (:mod:`splitfed.registry`): the entry points of the
    group ``splitfed.plugins``, then the config's ``plugins`` and ``plugins`` given here
    (the command line's ``--plugin``), which are added to the config's list; so the
    components they register are known when the config is validated."""
    merged = merge_config(raw or {}, parse_overrides(overrides or []))
    return from_dict(RunConfig, _fold_options(_with_plugins(merged, plugins)))


def _with_plugins(merged, extra: list[str] | None):
    """Import the plugins of ``merged`` and ``extra``; ``merged`` with the full list."""
    from splitfed.registry import load_entry_points, load_plugins

    load_entry_points()
    if not isinstance(merged, dict):
        return merged
    given = merged.get("plugins")
    if given is None:
        given = []
    if not isinstance(given, list) or not all(isinstance(p, str) for p in given):
        return merged                           # from_dict reports the type
    if not given and not extra:
        return merged
    try:
        specs = load_plugins([*given, *(extra or [])])
    except ConfigError as e:
        message = str(e)
        raise type(e)(message if message.startswith("plugins: ") else f"plugins: {message}"
                      ) from None
    return {**merged, "plugins": list(dict.fromkeys(specs))}


def load_config(path: str | Path | None, overrides: list[str] | None = None, *,
                plugins: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or a shipped config name) and apply ``key=value`` overrides;
    ``plugins`` are imported first and added to the config's (see :func:`build_config`)."""
    raw = load_yaml(resolve_config_path(path)) if path is not None else {}
    return build_config(raw, overrides, plugins=plugins)


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def flat_options(section: Any) -> dict:
    """The options of an open section, as the user wrote them (for error paths)."""
    return dict(section.options)


# ------------------------------------------------------------- checks against the data


def check_against_data(cfg: RunConfig, data_sizes, slots: int,
                       server_rows: int | None = None) -> None:
    """Refuse keys that do not fit the data (ConfigError naming the key and the range).

    ``data_sizes``: the clients' sample counts; ``slots``: the most cohort slots one
    round samples (N for full and bernoulli participation, M otherwise); ``server_rows``:
    the samples of the server's D_s^t when the algorithm trains on server data.

    - ``train.batch_size`` is at most the training samples the clients hold (a client
      with fewer than B samples repeats samples within a batch, as documented in
      :mod:`splitfed.engine.batches`);
    - the samples one round trains on (the ``slots`` largest K_n * B, and the server's
      steps * B_s) are at most :data:`MAX_ROUND_SAMPLES`: every round's batch plans are
      held in memory at once;
    - a given ``algorithm.server_batch_size`` B_s (or that of a ``server_train`` step in
      ``algorithm.server_transforms``) is at most the ``server_rows`` samples of D_s^t, as
      B is at most the clients' samples (null takes ``train.batch_size``, which may exceed
      them: a batch then repeats samples);
    - without server data (``server_rows`` None: the algorithm trains on none and
      ``server_data.always`` is off) the ``server_data`` section keeps its defaults: a
      value set there would be ignored.
    """
    if server_rows is None:
        _check_server_data_unused(cfg)
    sizes = [int(n) for n in data_sizes]
    total = sum(sizes)
    tr = cfg.train
    if tr.batch_size > total:
        raise ConfigError(f"train.batch_size: {tr.batch_size} exceeds the {total} training "
                          f"samples of the clients; allowed: 1..{total}")
    per_client = sorted((_steps(n, tr.batch_size, tr.local_steps, tr.local_epochs)
                         * tr.batch_size for n in sizes), reverse=True)
    if cfg.participation.mode == "with_replacement":
        work = per_client[0] * slots
    else:
        work = sum(per_client[:max(1, slots)])
    if work > MAX_ROUND_SAMPLES:
        key = "train.local_steps" if tr.local_steps is not None else "train.local_epochs"
        raise ConfigError(f"{key}: a round would train on {work} samples (steps x "
                          f"train.batch_size={tr.batch_size} over {slots} sampled clients), "
                          f"more than the {MAX_ROUND_SAMPLES} allowed; lower {key}, "
                          "train.batch_size or the clients per round")
    if server_rows is None:
        return
    opts = cfg.algorithm.options
    batch = opts.get("server_batch_size") or tr.batch_size
    if isinstance(batch, int) and batch > MAX_ROUND_SAMPLES:
        return                                  # the algorithm's options report it
    steps = opts.get("server_steps")
    if steps is None:
        epochs = opts.get("server_epochs")
        epochs = 1.0 if epochs is None else epochs
        if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or epochs <= 0:
            return
        steps = _steps(server_rows, batch, None, epochs)
    if isinstance(steps, int) and steps * batch > MAX_ROUND_SAMPLES:
        raise ConfigError(f"algorithm.server_steps: the server would train on {steps * batch} "
                          f"samples a round ({steps} steps x {batch}), more than the "
                          f"{MAX_ROUND_SAMPLES} allowed; lower algorithm.server_steps, "
                          "algorithm.server_epochs or algorithm.server_batch_size")
    _check_server_batch_size(cfg, server_rows)


def server_batch_sizes(cfg: RunConfig) -> list[tuple[str, Any]]:
    """The server batch sizes B_s the config gives, as ``(key, value)``: the algorithm's
    ``server_batch_size`` and that of each ``server_train`` step in
    ``algorithm.server_transforms`` (None where not given)."""
    given = [("algorithm.server_batch_size", cfg.algorithm.options.get("server_batch_size"))]
    for i, spec in enumerate(cfg.algorithm.server_transforms):
        if isinstance(spec, dict) and spec.get("name") == "server_train":
            given.append((f"algorithm.server_transforms[{i}].server_batch_size",
                          spec.get("server_batch_size")))
    return given


def _check_server_batch_size(cfg: RunConfig, server_rows: int) -> None:
    """A given B_s is at most the samples of D_s^t (:func:`check_against_data`)."""
    for key, batch in server_batch_sizes(cfg):
        if isinstance(batch, int) and not isinstance(batch, bool) and batch > server_rows:
            raise ConfigError(f"{key}: {batch} exceeds the {server_rows} samples of the "
                              "server's D_s^t (server_data.samples_per_round, or the whole "
                              f"pool); allowed: 1..{server_rows}")


def _check_server_data_unused(cfg: RunConfig) -> None:
    """Refuse a ``server_data`` value that differs from its default when no server pool
    is built (the algorithm trains on no server data and ``always`` is off): it would be
    ignored without a word."""
    default = ServerDataConfig()
    changed = [f.name for f in fields(ServerDataConfig)
               if getattr(cfg.server_data, f.name) != getattr(default, f.name)]
    if not changed:
        return
    given = ", ".join(f"server_data.{k}={getattr(cfg.server_data, k)!r}" for k in changed)
    users = ", ".join(server_data_algorithms()) or "none"
    raise ConfigError(f"server_data: {cfg.algorithm.name} trains on no server data, so "
                      f"{given} would be ignored; the algorithms that do: {users} (or a "
                      "server_train step in algorithm.server_transforms); set "
                      "server_data.always=true to carve the server's pool anyway (baselines "
                      "with the hybrid runs' client data), or remove the server_data keys")


def server_data_algorithms() -> list[str]:
    """The registered algorithms that train on the server's own data (with their
    default options and no transforms of the config), sorted."""
    from splitfed.algorithms import ALGORITHMS

    out = []
    for name, cls in ALGORITHMS.items():
        try:
            if cls().needs_server_data:
                out.append(name)
        except Exception:  # noqa: BLE001, S112 - a plugin algorithm that needs options
            continue
    return sorted(out)


def machine_memory() -> int | None:
    """Bytes of physical memory of this machine (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def check_model_size(cfg: RunConfig, params: int, copies: int) -> None:
    """Refuse a model of ``params`` parameters that is absurd (more than
    :data:`MAX_MODEL_PARAMS`) or would not fit this machine's memory: the global model and
    its ``copies`` stacked client copies, each with its gradient (float32)."""
    given = ", ".join(f"model.{k}={v!r}" for k, v in cfg.model.options.items())
    what = f"{cfg.model.name} would have {params} parameters" + (f" ({given})" if given
                                                                 else "")
    if params > MAX_MODEL_PARAMS:
        raise ConfigError(f"model.options: {what}, more than the {MAX_MODEL_PARAMS} "
                          "allowed; choose smaller widths")
    memory = machine_memory()
    need = params * 4 * (2 + 2 * max(1, copies))
    if memory is not None and need > memory:
        raise ConfigError(f"model.options: {what}; with {copies} client copies per batched "
                          f"call it needs about {need / 2**30:.1f} GiB, more than the "
                          f"{memory / 2**30:.1f} GiB of memory of this machine; choose smaller "
                          "widths or a smaller engine.chunk_size")


def _steps(size: int, batch: int, steps: int | None, epochs: float | None) -> int:
    """K of a client holding ``size`` samples (as splitfed.engine.batches computes it)."""
    if steps is not None:
        return int(steps)
    return max(1, ceil_times(math.ceil(size / batch), epochs))
