"""Experiment trackers: TensorBoard and MLflow receive every record of a run.

Enabled in the config's ``tracking`` section (:class:`splitfed.config.TrackingConfig`)::

    tracking:
      tensorboard: true      # event files in <run_dir>/tensorboard  (splitfed[tensorboard])
      mlflow: true           # an MLflow run                        (splitfed[mlflow])
      mlflow_uri: null       # null: a file store in <run_dir>/mlruns
      experiment: null       # MLflow experiment name; null: the run's name

``metrics.jsonl`` stays the record of the run; a tracker is a copy for the tools that
read these formats. Each is a *sink* of the run's :class:`~splitfed.metrics.MetricLogger`:

- every record's numbers (ints and floats; NaN and infinities too) are logged with the
  record's ``round`` as the step: TensorBoard scalars (``torch.utils.tensorboard``, stored
  as float32 by TensorBoard; ``bytes_up/model`` is the tag ``model`` in the group
  ``bytes_up``), MLflow metrics (float64; a ``/`` in a name becomes ``.``:
  ``bytes_up.model``, since MLflow's file store keeps each metric in a file named after
  it, and ``bytes_up`` is a metric too; other characters MLflow refuses become ``_``);
- MLflow also gets the flattened config as parameters (``train.lr``, ``partition.alpha``,
  ... :func:`splitfed.results.flatten_config`) and the provenance as tags
  (``splitfed.version``, ``splitfed.commit``, ..., and ``mlflow.source.git.commit``),
  the run directory's name as the run name, and at the end the run's status as the tag
  ``splitfed.status`` (and ``splitfed.diverged_round``); the MLflow run ends FINISHED
  when the run completed, KILLED when it was interrupted, FAILED otherwise;
- the sinks are closed when the run ends, however it ends (an error, Ctrl-C).

A resumed run continues its trackers: TensorBoard discards the events of the rounds after
the checkpoint (``purge_step``), and MLflow logs into the same run (its id is kept in
``<run_dir>/tracking.json``; MLflow cannot delete values, so the rounds between the
checkpoint and the interruption appear twice in its metric histories, with the same
values when the run is resumed with its thread count). A run resumed before its first
checkpoint starts again from round 0: its earlier MLflow run is deleted (MLflow keeps a
deleted run until ``mlflow gc``) and a new one is made.

A package that is not installed is refused when the config is validated
(:func:`check_installed`: ``pip install 'splitfed[tensorboard]'``, ``'splitfed[mlflow]'``),
before anything is written, and so is an ``mlflow_uri`` whose scheme names no MLflow store
(:func:`check_uri`). A run (``splitfed run``, ``splitfed launch``) then opens the store
of ``mlflow_uri`` before it creates the run directory (:func:`preflight`): a store that
cannot be opened or a server that cannot be reached is one error naming
``tracking.mlflow_uri``. A tracker that fails while the run goes on (a full disk, an
MLflow server that went away) prints one warning and is switched off; the run continues.

The default MLflow store is a local file store (``file:<run_dir>/mlruns``), which MLflow
3 keeps in maintenance mode behind the environment variable ``MLFLOW_ALLOW_FILE_STORE``:
splitfed sets it to ``true`` for such a store unless it is set. Read the store with
``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`` (the
``mlflow`` package), or give ``mlflow_uri`` (``sqlite:///...``, ``http://...``) to log
many runs into one store.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import re
import sys
import time
import urllib.parse
from pathlib import Path

from splitfed.errors import ConfigError, FormatError, SplitfedError
from splitfed.files import atomic_write, loads_json, read_regular

#: where a run keeps its MLflow run id (for a resume)
TRACKING_FILE = "tracking.json"
#: the largest tracking.json read back (it holds a URI and a run id)
MAX_TRACKING_BYTES = 1 << 16
#: TensorBoard's folder in a run directory
TENSORBOARD_DIR = "tensorboard"
#: the default MLflow file store in a run directory
MLRUNS_DIR = "mlruns"

#: tracker -> (the package it imports, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(tracking) -> None:
    """ConfigError naming the extra to install when an enabled tracker's package is
    missing, or the key when ``mlflow_uri`` has a scheme MLflow has no store for
    (:func:`check_uri`); called when the config is validated: nothing is written yet."""
    for key, (module, extra) in PACKAGES.items():
        if getattr(tracking, key) and not _installed(module):
            raise ConfigError(f"{key}=true needs the {module} package, which is not "
                              f"installed: pip install 'splitfed[{extra}]'")
    check_uri(tracking)


#: the schemes of MLflow's tracking stores (a database's may name a driver:
#: ``postgresql+psycopg2://``); packages add theirs through the entry-point group
#: :data:`STORE_ENTRY_POINTS`
STORE_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql",
                 "databricks", "databricks-uc", "uc")
STORE_ENTRY_POINTS = "mlflow.tracking_store"
#: the schemes of MLflow's database stores, and the packages they need beyond mlflow-skinny
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
DATABASE_MODULES = ("sqlalchemy", "alembic")


def uri_scheme(uri: str) -> str:
    """The scheme that picks MLflow's store for ``uri`` ("" for a path), lowercase,
    without a database driver (``+driver``)."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    return "" if len(scheme) == 1 else scheme.split("+", 1)[0]   # C:\... is a path


def check_uri(tracking) -> None:
    """ConfigError naming ``mlflow_uri`` (``tracking: mlflow_uri`` once the config's
    validation prefixes its section) when MLflow is on and the URI's scheme is none of
    its stores' (:data:`STORE_SCHEMES`, and those of installed packages)."""
    uri = tracking.mlflow_uri
    if not tracking.mlflow or uri is None:
        return
    scheme = uri_scheme(uri)
    if scheme in ("", *STORE_SCHEMES):
        return
    from importlib.metadata import entry_points

    extra = sorted({e.name for e in entry_points(group=STORE_ENTRY_POINTS)})
    if scheme in extra:
        return
    raise ConfigError(f"mlflow_uri: {_redact(uri)!r} has the scheme {scheme!r}, for which "
                      f"MLflow has no store; expected a path or one of "
                      f"{', '.join(f'{s}:' for s in (*STORE_SCHEMES, *extra))}")


def preflight(cfg) -> None:
    """Open the MLflow store that ``cfg.tracking.mlflow_uri`` names, as the run will, and
    raise ConfigError naming the key when it cannot be opened or reached; called before
    the run directory is created (the default store, in the run directory, is not
    checked). A server is asked once, without MLflow's retries (``MLFLOW_HTTP_REQUEST_*``
    given in the environment are kept)."""
    uri = cfg.tracking.mlflow_uri
    if not cfg.tracking.mlflow or uri is None:
        return
    if _file_store(uri):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    missing = [m for m in DATABASE_MODULES if not _installed(m)]
    if uri_scheme(uri) in DATABASE_SCHEMES and missing:
        raise ConfigError(f"tracking.mlflow_uri: a {uri_scheme(uri)}: store needs "
                          f"{' and '.join(missing)}, which the mlflow-skinny of "
                          f"'splitfed[mlflow]' leaves out: pip install "
                          f"{' '.join(missing)} (or the full mlflow package)")
    limits = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    saved = {k: os.environ.get(k) for k in limits}
    try:
        for key, value in limits.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).get_experiment_by_name(
            cfg.tracking.experiment or cfg.name)
    except Exception as e:  # noqa: BLE001 - whatever the store raises: one line
        raise ConfigError(f"tracking.mlflow_uri: cannot open the MLflow store "
                          f"{_redact(uri)!r}: {_redact(_first_line(e))}") from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


def remote_store(cfg) -> bool:
    """Whether ``cfg`` logs to MLflow in a store that opening leaves as it was: a URI
    that is neither a file store nor a database (:data:`DATABASE_SCHEMES`). ``--dry-run``,
    which writes nothing, opens only those (:func:`preflight`); a file store is created
    when it is opened, and an SQLite store's database file too."""
    uri = cfg.tracking.mlflow_uri
    return bool(cfg.tracking.mlflow and uri is not None and not _file_store(uri)
                and uri_scheme(uri) not in DATABASE_SCHEMES)


def _file_store(uri: str) -> bool:
    return uri_scheme(uri) in ("", "file")


def _redact(text: str) -> str:
    """``text`` without the credentials of the URIs in it
    (:func:`splitfed.provenance.redact`): error messages and MLflow's params show the
    store, not its password (give that in ``MLFLOW_TRACKING_PASSWORD`` or
    ``MLFLOW_TRACKING_TOKEN`` rather than in the URI)."""
    from splitfed.provenance import redact

    return redact(text)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def enabled(cfg) -> bool:
    t = cfg.tracking
    return bool(t.tensorboard or t.mlflow)


def open_trackers(cfg, run_dir: str | Path, start_round: int = 1) -> list:
    """The sinks of ``cfg.tracking`` for a run writing ``run_dir`` whose next record is
    of round ``start_round`` (1: a new run, which logs round 0 first). Empty when no
    tracker is enabled."""
    if not enabled(cfg):
        return []
    run_dir = Path(run_dir)
    sinks: list = []
    try:
        if cfg.tracking.tensorboard:
            sinks.append(TensorBoardSink(run_dir, start_round))
        if cfg.tracking.mlflow:
            sinks.append(MLflowSink(cfg, run_dir, start_round))
    except BaseException:
        for sink in sinks:
            sink.close("failed")
        raise
    return sinks


def discard_recorded_run(run_dir: str | Path) -> None:
    """Delete the MLflow run that ``run_dir/tracking.json`` records when its store lies
    outside ``run_dir``: a study clears the directory of a run interrupted before its
    first checkpoint and runs it again from round 0, and the interrupted attempt's run
    would stay in a shared store beside the new one (a store inside the directory goes
    with it). MLflow keeps a deleted run until ``mlflow gc``. A store that cannot be
    reached is left as it is."""
    run_dir = Path(run_dir)
    try:
        saved = loads_json(read_regular(run_dir / TRACKING_FILE, TRACKING_FILE,
                                        MAX_TRACKING_BYTES))["mlflow"]
        uri, run_id = saved["uri"], saved["run_id"]
    except (OSError, ValueError, KeyError, TypeError, FormatError):
        return
    if not isinstance(uri, str) or not isinstance(run_id, str) or uri == (
            run_dir.resolve() / MLRUNS_DIR).as_uri() or not _installed("mlflow"):
        return
    try:
        if _file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).delete_run(run_id)
    except Exception as e:  # noqa: BLE001 - gone already, or the store is away
        print(f"splitfed: warning: mlflow: the run {run_id[:40]} of the interrupted attempt "
              f"stays in {_redact(uri)!r} ({_redact(_first_line(e))})", file=sys.stderr,
              flush=True)


def numeric(record: dict) -> dict[str, float]:
    """The record's numbers (ints and floats, not bools), ``round`` left out."""
    return {k: float(v) for k, v in record.items()
            if k != "round" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


def _check_folder(path: Path) -> None:
    """Refuse a tracker folder that is a link or not a folder (never written through)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise FormatError(f"{path} is {'a symbolic link' if path.is_symlink() else 'a file'}"
                          ", not a folder; the run directory is damaged or not splitfed's: "
                          "delete it to rerun the run")


def _warn(name: str, e: BaseException) -> None:
    print(f"splitfed: warning: {name}: {_first_line(e)}; {name} tracking is off for the rest of "
          "this run (metrics.jsonl has every record)", file=sys.stderr, flush=True)


class _Sink:
    """A tracker that switches itself off, with one warning, when it fails mid-run."""

    name = "tracker"

    def __init__(self):
        self.failed = False
        self.diverged_round: int | None = None

    def log(self, record: dict) -> None:
        if self.failed:
            return
        if self.diverged_round is None and _diverged(record):
            self.diverged_round = int(record["round"])
        try:
            self._log(int(record["round"]), numeric(record))
        except Exception as e:  # noqa: BLE001 - the run goes on without this tracker
            self.failed = True
            _warn(self.name, e)

    def close(self, status: str) -> None:
        try:
            self._close(status)
        except Exception as e:  # noqa: BLE001 - the run's own files are written already
            if not self.failed:
                _warn(self.name, e)
            self.failed = True

    def _log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self, status: str) -> None:
        raise NotImplementedError


def _diverged(record: dict) -> bool:
    from splitfed.metrics import divergence

    return divergence([record]) is not None


class TensorBoardSink(_Sink):
    """Scalars into ``<run_dir>/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``);
    a resumed run purges the events from ``start_round`` on."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, start_round: int = 1):
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / TENSORBOARD_DIR
        _check_folder(self.log_dir)
        again = self.log_dir.is_dir() and any(self.log_dir.iterdir())
        purge = (start_round if start_round > 1 else 0) if again else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def _log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def _close(self, status: str) -> None:
        self.writer.close()


class MLflowSink(_Sink):
    """An MLflow run (``mlflow.tracking.MlflowClient``): the flattened config as params,
    the provenance as tags, every record's numbers as metrics at step ``round``."""

    name = "mlflow"
    BATCH = 100                               # MLflow's limit of params per call

    def __init__(self, cfg, run_dir: Path, start_round: int = 1):
        super().__init__()
        self.run_dir = run_dir
        self.uri = cfg.tracking.mlflow_uri or (run_dir.resolve() / MLRUNS_DIR).as_uri()
        if _file_store(self.uri):
            if cfg.tracking.mlflow_uri is None:
                _check_folder(run_dir / MLRUNS_DIR)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            earlier = self._recorded_run()
            self.run_id = None
            if earlier is not None and start_round > 1:       # resumed: log into it
                self.client.update_run(earlier, status="RUNNING")
                self.run_id = earlier
            elif earlier is not None:     # started again from round 0: the old run goes
                self.client.delete_run(earlier)
            if self.run_id is None:
                self.run_id = self._new_run(cfg)
        except SplitfedError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the store raises: one line
            raise ConfigError(f"tracking.mlflow_uri: cannot open the MLflow store "
                              f"{_redact(self.uri)!r}: {_redact(_first_line(e))}"
                              ) from None

    def _recorded_run(self) -> str | None:
        """The MLflow run of an earlier session of this run (``tracking.json``) when it
        is in this store."""
        try:
            saved = loads_json(read_regular(self.run_dir / TRACKING_FILE, TRACKING_FILE,
                                            MAX_TRACKING_BYTES))
            run_id = saved["mlflow"]["run_id"] if saved["mlflow"]["uri"] == self.uri else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if run_id is None:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - gone (another store, deleted): a new run
            return None
        return run_id

    def _new_run(self, cfg) -> str:
        from mlflow.entities import Param

        from splitfed.configtools import to_dict
        from splitfed.provenance import provenance
        from splitfed.results import flatten_config

        name = cfg.tracking.experiment or cfg.name
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(name)
            except Exception:  # noqa: BLE001 - made meanwhile by another process
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        prov = provenance()
        tags = {"mlflow.runName": self.run_dir.name,
                "splitfed.run_dir": str(self.run_dir.resolve()),
                **{f"splitfed.{'version' if k == 'splitfed' else k}": str(v)
                   for k, v in prov.items() if v is not None}}
        if prov.get("commit"):
            tags["mlflow.source.git.commit"] = prov["commit"]
        run = self.client.create_run(experiment_id, tags=tags, run_name=self.run_dir.name)
        run_id = run.info.run_id
        params = [Param(mlflow_key(k), _redact(_param_text(v)))
                  for k, v in flatten_config(to_dict(cfg)).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(run_id, params=params[i:i + self.BATCH])
        text = json.dumps({"mlflow": {"uri": self.uri, "run_id": run_id,
                                      "experiment_id": experiment_id}}, indent=2) + "\n"

        atomic_write(self.run_dir / TRACKING_FILE, lambda fh: fh.write(text.encode("utf-8")))
        return run_id

    def _log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):          # MLflow's limit per call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def _close(self, status: str) -> None:
        self.client.set_tag(self.run_id, "splitfed.status", status)
        if self.diverged_round is not None:
            self.client.set_tag(self.run_id, "splitfed.diverged_round",
                                str(self.diverged_round))
        end = {"completed": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=end)


def mlflow_key(key: str) -> str:
    """A record field's name as an MLflow metric name: ``/`` -> ``.``, characters other
    than letters, digits, ``_-. `` -> ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", key.replace("/", "."))


def _param_text(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
