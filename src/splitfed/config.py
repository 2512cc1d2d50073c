"""The run configuration: typed dataclasses, loaded from YAML, overridden by ``key=value``.

Sections whose options depend on a chosen component (``data``, ``partition``, ``model``,
``algorithm``, ``clock``) have a few typed fields of their own; any other key in them is an
option of the chosen data set / partition scheme / model / algorithm / clock profile and is
validated by that component against its own signature or options dataclass, with the
dotted key in the message. Every shipped config is loaded in a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from splitfed.configtools import from_dict, load_yaml, merge, parse_overrides
from splitfed.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class DataConfig:
    name: str = field(default="fashion_mnist", metadata={"help": "data set (splitfed list)"})
    data_dir: str | None = field(default=None, metadata={"help": "directory of data files"})
    limit_train: int | None = field(default=None, metadata={
        "gt": 0, "help": "keep a random subset of this many training samples"})
    limit_test: int | None = field(default=None, metadata={
        "gt": 0, "help": "keep a random subset of this many test samples"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "data-set options (e.g. label_mode for cifar100, alpha/beta for synthetic)"})


@dataclass
class PartitionConfig:
    scheme: str = field(default="iid", metadata={
        "help": "iid | dirichlet | pathological | shard | natural"})
    num_clients: int = field(default=10, metadata={"ge": 1})
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
    batch_size: int = field(default=32, metadata={"ge": 1})
    local_steps: int | None = field(default=None, metadata={
        "ge": 1, "help": "K local steps per round (exclusive with local_epochs)"})
    local_epochs: float | None = field(default=None, metadata={
        "gt": 0, "help": "E local epochs: K = ceil(D_n / batch_size) * E (default 1)"})
    lr: float = field(default=0.01, metadata={"gt": 0, "help": "client learning rate"})
    momentum: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    weight_decay: float = field(default=0.0, metadata={"ge": 0})
    lr_decay: float = field(default=1.0, metadata={
        "gt": 0, "le": 1, "help": "learning rates are multiplied by this every round "
                                 "(paper 004 Sec. VI: 0.99)"})
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
    mode: Literal["full", "uniform", "with_replacement", "bernoulli"] = "full"
    clients_per_round: int | None = field(default=None, metadata={
        "ge": 1, "help": "M, for uniform and with_replacement"})
    q: Any = field(default=None, metadata={
        "help": "bernoulli participation probability: one number or a list per client"})
    weighting: Literal["data_size", "uniform"] = "data_size"


@dataclass
class EngineConfig:
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:0, ..."})
    chunk_size: int | None = field(default=None, metadata={
        "ge": 1, "help": "clients per batched call (null: about 320 samples per call)"})
    eval_batch_size: int = field(default=1000, metadata={"ge": 1})


@dataclass
class AlgorithmConfig:
    name: str = field(default="fedavg", metadata={"help": "algorithm (splitfed list)"})
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerDataConfig:
    """The server's own data for hybrid FL (paper 004): a pool, and D_s^t drawn from it."""

    fraction: float = field(default=0.01, metadata={
        "gt": 0, "lt": 1, "help": "server pool as a fraction of the training set "
                                  "(paper 004 Sec. VI: 0.01 for MNIST, 0.05 for CIFAR)"})
    min_per_class: int = field(default=10, metadata={
        "ge": 0, "help": "the pool holds at least this many samples per class on average "
                         "(a floor for small data sets; no effect on MNIST or CIFAR)"})
    samples_per_round: int | None = field(default=None, metadata={
        "ge": 1, "help": "m_s: samples of D_s^t, drawn from the pool without replacement "
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
                "baselines (fedavg, scaffold) get the hybrid runs' client data"})


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
                         "upload arrives later are dropped from the round (null: none)"})
    over_select: float = field(default=0.0, metadata={
        "ge": 0, "help": "over-selection (FedScale's over-commitment): sample "
                         "ceil((1 + over_select) M) clients and keep the M the profiles "
                         "predict to finish first (participation.mode uniform; 0: off)"})
    options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "profile parameters (speeds, distribution parameters, trace path)"})


@dataclass
class RunConfig:
    name: str = field(default="run", metadata={"help": "run name (prefix of the run dir)"})
    seed: int = 0
    rounds: int = field(default=20, metadata={"ge": 0})
    eval_every: int = field(default=1, metadata={"ge": 1})
    checkpoint_every: int = field(default=10, metadata={
        "ge": 0, "help": "write checkpoint.pt every k rounds and at the last round, for "
                         "splitfed run --resume (0: no checkpoints)"})
    out_dir: str = "runs"
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

    def __post_init__(self):
        bad = [c for c in ("/", "\\", "\x00") if c in self.name]
        if not self.name.strip() or self.name in (".", "..") or bad:
            raise ConfigError(f"name: {self.name!r} must be a non-empty file name without "
                              "'/', '\\' or NUL (it prefixes the run directory; choose the "
                              "parent directory with out_dir)")
        if not self.out_dir or "\x00" in self.out_dir:
            raise ConfigError(f"out_dir: {self.out_dir!r} is not a usable directory path")


_OPEN_SECTIONS = {"data": DataConfig, "partition": PartitionConfig, "model": ModelConfig,
                  "algorithm": AlgorithmConfig, "clock": ClockConfig}


def _fold_options(raw: dict) -> dict:
    """Move unknown keys of open sections into their ``options`` mapping."""
    out = dict(raw)
    for section, cls in _OPEN_SECTIONS.items():
        body = out.get(section)
        if not isinstance(body, dict):
            continue
        known = {f.name for f in fields(cls)}
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


def build_config(raw: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    merged = merge(raw or {}, parse_overrides(overrides or []))
    return from_dict(RunConfig, _fold_options(merged))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or a shipped config name) and apply ``key=value`` overrides."""
    raw = load_yaml(resolve_config_path(path)) if path is not None else {}
    return build_config(raw, overrides)


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def flat_options(section: Any) -> dict:
    """The options of an open section, as the user wrote them (for error paths)."""
    return dict(section.options)
