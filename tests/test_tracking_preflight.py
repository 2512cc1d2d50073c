"""An MLflow store that a run cannot use is refused before anything is written: a URI
whose scheme names no MLflow store when the config is read (``splitfed run --dry-run``
too), a store that cannot be opened or a server that cannot be reached before the run
directory is created; each one line naming ``tracking.mlflow_uri``."""

from __future__ import annotations

import os
import socket
import time

import pytest
from helpers import digits_config

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.experiment import run_experiment
from splitfed.tracking import preflight

pytest.importorskip("mlflow")


def mlflow_config(tmp_path, uri, **over):
    return digits_config(rounds=1, out_dir=str(tmp_path / "runs"),
                         tracking={"mlflow": True, "mlflow_uri": uri}, **over)


@pytest.mark.parametrize("uri", ["foo://x", "s3://bucket/mlruns", "ftp:/x"])
def test_a_uri_without_an_mlflow_store_is_refused_when_the_config_is_read(tmp_path, uri):
    with pytest.raises(ConfigError, match=r"^tracking: mlflow_uri: .* no store; expected "
                                          r"a path or one of file:, http:"):
        mlflow_config(tmp_path, uri)


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "/tmp/mlruns", "mlruns",
                                 "sqlite:///x.db", "postgresql+psycopg2://h/db",
                                 "http://127.0.0.1:5000", "HTTPS://example.org", "databricks"])
def test_the_schemes_of_mlflow_stores_are_accepted(tmp_path, uri):
    assert mlflow_config(tmp_path, uri).tracking.mlflow_uri == uri


def test_the_uri_is_not_checked_while_mlflow_is_off(tmp_path):
    cfg = digits_config(tracking={"mlflow": False, "mlflow_uri": "foo://x"})
    assert cfg.tracking.mlflow_uri == "foo://x"


def test_dry_run_refuses_the_scheme_in_one_line(tmp_path, capsys):
    code = main(["run", "quick_digits", "rounds=1", "tracking.mlflow=true",
                 "tracking.mlflow_uri=foo://x", f"out_dir={tmp_path / 'runs'}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("splitfed: error: tracking: mlflow_uri: 'foo://x'")


def test_a_store_that_cannot_be_opened_is_refused_before_the_run_directory(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    cfg = mlflow_config(tmp_path, not_a_folder.as_uri())
    with pytest.raises(ConfigError, match=r"^tracking.mlflow_uri: cannot open the MLflow "
                                          r"store 'file://.*Not a directory"):
        run_experiment(cfg)
    assert not (tmp_path / "runs").exists()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_cannot_be_reached_is_refused_at_once(tmp_path, monkeypatch):
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    uri = f"http://127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        run_experiment(mlflow_config(tmp_path, uri))
    assert time.monotonic() - t0 < 60          # MLflow's own retries take minutes
    message = str(err.value)
    assert message.startswith(f"tracking.mlflow_uri: cannot open the MLflow store '{uri}'")
    assert "\n" not in message
    assert not (tmp_path / "runs").exists()
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ    # restored
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_a_store_that_opens_passes_and_the_run_logs_into_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "store"
    cfg = mlflow_config(tmp_path, store.as_uri())
    preflight(cfg)
    res = run_experiment(cfg)
    assert res.status == "completed" and (res.run_dir / "tracking.json").is_file()
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(tracking_uri=store.as_uri()).search_runs(
        [MlflowClient(tracking_uri=store.as_uri()).get_experiment_by_name("t").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["splitfed.status"] == "completed"


def test_the_default_store_in_the_run_directory_is_not_opened_beforehand(tmp_path):
    cfg = digits_config(out_dir=str(tmp_path / "runs"), tracking={"mlflow": True})
    preflight(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_sweep_opens_each_store_once_before_its_directory(tmp_path, capsys,
                                                             monkeypatch):
    import splitfed.tracking as tracking

    opened = []
    real = tracking.preflight

    def counting(cfg):
        opened.append(cfg.tracking.mlflow_uri)
        return real(cfg)

    monkeypatch.setattr(tracking, "preflight", counting)
    uri = f"http://127.0.0.1:{closed_port()}"
    code = main(["sweep", "quick_digits", "rounds=1", "train.lr=0.01,0.1,0.2",
                 "tracking.mlflow=true", f"tracking.mlflow_uri={uri}",
                 "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("splitfed: error: run 'train.lr=0.01': tracking.mlflow_uri: "
                          f"cannot open the MLflow store '{uri}'"), err
    assert opened == [uri]
    assert not (tmp_path / "out").exists()


def test_the_credentials_in_a_store_uri_stay_out_of_messages_and_provenance(tmp_path):
    from splitfed.provenance import provenance, redact

    assert redact("http://me:s3cret@h:5000/x and https://tok@h https://h/a@b") == (
        "http://***@h:5000/x and https://***@h https://h/a@b")
    uri = f"http://me:s3cret@127.0.0.1:{closed_port()}"
    with pytest.raises(ConfigError) as err:
        run_experiment(mlflow_config(tmp_path, uri))
    assert "s3cret" not in str(err.value) and "http://***@127.0.0.1:" in str(err.value)
    command = provenance(["splitfed", "run", "x", f"tracking.mlflow_uri={uri}"])["command"]
    assert command == f"splitfed run x tracking.mlflow_uri={redact(uri)}"


def test_a_database_store_without_sqlalchemy_names_what_to_install(tmp_path, monkeypatch):
    import splitfed.tracking as tracking

    monkeypatch.setattr(tracking, "_installed", lambda module: module != "sqlalchemy")
    with pytest.raises(ConfigError, match=r"^tracking.mlflow_uri: a sqlite: store needs "
                                          r"sqlalchemy, .*: pip install sqlalchemy \(or "
                                          r"the full mlflow package\)$"):
        run_experiment(mlflow_config(tmp_path, f"sqlite:///{tmp_path}/m.db"))
    assert not (tmp_path / "runs").exists()


def test_a_dry_run_asks_a_server_but_creates_no_file_store(tmp_path, capsys, monkeypatch):
    """``--dry-run`` checks what the run checks before it starts and writes nothing: a
    server that cannot be reached is the run's one line; a file store is not opened
    (opening creates it), and the run opens it."""
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "runs"
    uri = f"http://127.0.0.1:{closed_port()}"
    code = main(["run", "quick_digits", "rounds=1", f"out_dir={out}", "--dry-run",
                 "tracking.mlflow=true", f"tracking.mlflow_uri={uri}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("splitfed: error: tracking.mlflow_uri: cannot open the MLflow "
                          f"store '{uri}'"), err
    store = tmp_path / "store"
    for where in (store.as_uri(), f"sqlite:///{tmp_path / 'db.sqlite'}"):
        code = main(["run", "quick_digits", "rounds=1", f"out_dir={out}", "--dry-run",
                     "tracking.mlflow=true", f"tracking.mlflow_uri={where}"])
        assert code == 0 and f"an MLflow run at {where}" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
