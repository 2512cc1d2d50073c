"""The multi-process runtime is safe by default: what listens where, who may join, what
a rank accepts, the launcher's options, and the processes it leaves behind.

Network checks use loopback (127.0.0.0/8) only; a non-loopback ``--listen`` is checked to
be refused before anything binds. Real runs are bounded by timeouts.
"""

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import digits_config
from splitfed import cli
from splitfed.configtools import dump_yaml
from splitfed.errors import ConfigError
from splitfed.runtime import launch as launch_mod
from splitfed.runtime import secure
from splitfed.runtime.launch import descendants, spawn
from splitfed.runtime.secure import AuthError, AuthStore, StoreServer

HERE = Path(__file__).parent
ENV = {"OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
LIMIT_S = 240
SECRET = "s3cr3t-0123456789-abcdefghij-KLMNOPQRST"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != secure.SECRET_ENV}
    return {**env, **ENV, **extra}


def _slow_config(tmp_path, algorithm="fedavg", rounds=4, clients=4):
    """Full participation; about 0.3 s of real client compute delay per round (with
    ``--real-delays 1``)."""
    cfg = digits_config(name=algorithm, algorithm={"name": algorithm}, rounds=rounds,
                        partition={"scheme": "iid", "num_clients": clients},
                        clock={"profile": "fixed", "client_compute": 2e5},
                        out_dir=str(tmp_path / "runs"))
    path = tmp_path / f"{algorithm}.yaml"
    dump_yaml(cfg, path)
    return path, cfg


def _wait_for(cond, limit_s=LIMIT_S, procs=(), what="the condition"):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a process exited before {what}: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen within {limit_s} s")


def _rounds_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return -1
    rounds = [json.loads(x)["round"] for x in metrics.read_text().splitlines() if x.strip()]
    return rounds[-1] if rounds else -1


def _finish(procs, limit_s=LIMIT_S):
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the processes did not finish within {limit_s} s")
    return [p.returncode for p in procs]


# --------------------------------------------------------------------- sockets of a run


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pids) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state held by ``pids``."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in inodes:
                addr, port = f[1].split(":")
                out.append((_address(addr), int(port, 16)))
    return out


def _is_loopback(addr: str) -> bool:
    import ipaddress
    ip = ipaddress.ip_address(addr)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _launched_by(pid: int) -> list[int]:
    """Processes whose environment names ``pid`` as their launcher (the ranks)."""
    out = []
    needle = f"{launch_mod.LAUNCHER_ENV}={pid}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def _launch(path, run_dir, launcher, *extra, nproc=3, **popen):
    return subprocess.Popen([sys.executable, "-m", "splitfed", "launch", str(path),
                             "--nproc", str(nproc), "--launcher", launcher,
                             "--run-dir", str(run_dir), *extra],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_nothing_listens_beyond_loopback_during_a_real_run(tmp_path, launcher):
    path, _ = _slow_config(tmp_path, "sflv2", rounds=5)
    run_dir = tmp_path / "run"
    proc = _launch(path, run_dir, launcher, "--real-delays", "1")
    try:
        _wait_for(lambda: _rounds_done(run_dir) >= 1, procs=[proc], what="round 1")
        tree = [proc.pid, *descendants(proc.pid)]
        socks = listening(tree)
    finally:
        out, err = proc.communicate(timeout=LIMIT_S)
    assert proc.returncode == 0, err
    # the run's store (in the launcher) and gloo's listener of each of the 3 ranks
    assert len(socks) >= 4, socks
    assert all(_is_loopback(a) for a, _ in socks), socks
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


# --------------------------------------------------------------------- the store


def test_the_store_serves_the_secret_holders():
    server = StoreServer(SECRET)
    host, port = server.address
    try:
        a, b = AuthStore(host, port, SECRET), AuthStore(host, port, SECRET)
        a.set("k", b"v")
        assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "x"])
        assert a.add("n", 2) == 2 and b.add("n", 3) == 5
        assert a.compare_set("k", b"v", b"w") == b"w" and b.get("k") == b"w"
        assert a.num_keys() == 2 and a.delete_key("n") and not a.delete_key("n")
        b.wait(["k"])
        from datetime import timedelta
        with pytest.raises(Exception, match="did not appear"):
            b.wait(["absent"], timedelta(seconds=0.2))
    finally:
        server.close()


def test_a_peer_without_the_secret_reads_and_writes_nothing():
    server = StoreServer(SECRET)
    host, port = server.address
    try:
        AuthStore(host, port, SECRET).set("rank0/addr", b"secret-address")
        # the client library with another secret
        with pytest.raises(AuthError, match="secret differs"):
            AuthStore(host, port, "t" * 40)
        # no secret at all
        with pytest.raises(AuthError):
            AuthStore(host, port, None)
        # by hand: answer the challenge wrongly, then ask for the key anyway
        with socket.create_connection((host, port), timeout=10) as s:
            hello = s.recv(64)
            assert hello.startswith(secure.MAGIC) and len(hello) == len(secure.MAGIC) + 32
            request = struct.pack(">I", 5) + bytes([2]) + b"rank0/addr"
            try:
                s.sendall(os.urandom(64) + request)
                got = s.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                got = b""
            assert got == b""                      # closed: not a byte of any value
        # by hand: skip the handshake and send a framed SET at once
        with socket.create_connection((host, port), timeout=10) as s:
            s.recv(64)
            body = b"".join(struct.pack(">I", len(f)) + f
                            for f in (bytes([1]), b"evil", b"value"))
            try:
                frame = struct.pack(">I", len(body)) + body + b"\0" * 32
                s.sendall(frame * 2)             # as long as a handshake's answer
                assert s.recv(4096) == b""
            except (ConnectionResetError, BrokenPipeError):
                pass
        time.sleep(0.2)
        assert server.refused >= 3                         # None is refused before it connects
        assert set(server.data) == {b"rank0/addr"}         # nothing written
    finally:
        server.close()


def test_a_tampered_store_request_is_refused():
    server = StoreServer(SECRET)
    host, port = server.address
    try:
        store = AuthStore(host, port, SECRET)
        chan = store._chan
        real = chan.sock.sendall

        def flip(data):                  # a man in the middle changes one byte
            data = bytearray(data)
            data[6] ^= 1
            return real(bytes(data))

        chan.sock = _Flipper(chan.sock, flip)
        with pytest.raises((ConnectionError, OSError, AuthError)):
            store.set("k", b"v")
        assert b"k" not in server.data
    finally:
        server.close()


class _Flipper:
    def __init__(self, sock, sendall):
        self._sock, self.sendall = sock, sendall

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_foreign_process_cannot_join_or_disturb_a_real_run(tmp_path):
    """While 3 ranks run, foreign connections to the run's store (wrong secret, no
    handshake) are refused and learn nothing; the run ends as the simulator's."""
    from splitfed.experiment import run_experiment

    path, cfg = _slow_config(tmp_path, "fedavg", rounds=4)
    run_dir = tmp_path / "run"
    procs = spawn(3, [str(path), "--run-dir", str(run_dir), "--real-delays", "1"], env=ENV)
    host, port = procs.server.address
    try:
        _wait_for(lambda: _rounds_done(run_dir) >= 1, procs=procs, what="round 1")
        keys = set(procs.server.data)
        for secret in ("x" * 40, None):
            with pytest.raises(AuthError):
                AuthStore(host, port, secret)
        with socket.create_connection((host, port), timeout=10) as s:
            s.recv(64)
            try:
                s.sendall(os.urandom(64))
                assert s.recv(4096) == b""
            except (ConnectionResetError, BrokenPipeError):
                pass
        assert set(procs.server.data) == keys
        assert _finish(procs) == [0, 0, 0]
        assert procs.server.refused >= 2                   # None is refused before it connects
    finally:
        procs.close()
    ref = run_experiment(cfg, write=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and not summary["lost_ranks"]
    assert summary["final_test_acc"] == ref.records[-1]["test_acc"]


# --------------------------------------------------------------------- messages


@pytest.mark.parametrize("mode,why", [("unsigned", "wrong HMAC"),
                                      ("signed", "not a splitfed data file")])
def test_a_pickled_control_message_is_refused_unread(tmp_path, mode, why):
    """Rank 0 is a forger: its first message to a real client rank is a pickle whose
    ``__reduce__`` would create a file. Without the secret's HMAC it is refused; with a
    valid HMAC the weights-only loader refuses it; the file is never created."""
    marker = tmp_path / "pwned"
    procs = spawn(2, ["--forge", mode, str(marker)], module="distributed_worker", env=ENV,
                  stderr=subprocess.PIPE, text=True)
    try:
        codes = _finish(procs, 120)
        err = procs[1].stderr.read()
    finally:
        procs.close()
    assert not marker.exists()
    assert codes[1] == 2, err
    assert "splitfed: error: rank 1: " in err and why in err
    assert "Traceback" not in err


def test_links_refuse_replayed_and_foreign_messages(monkeypatch):
    """The HMAC covers sender, receiver and the message's sequence number."""
    from splitfed.runtime.secure import message_key, sign
    from splitfed import safeio
    from splitfed.transport.distributed import Links

    key = message_key(SECRET)
    body = safeio.dumps({"stop": "completed"})
    tag = sign(key, 0, 1, 0, body)
    links = Links(1, 2, 5.0, secret=SECRET)
    queue = []
    monkeypatch.setattr(links, "_receive_control", lambda peer: queue.pop(0))

    def deliver(payload):
        queue.append(payload)
        return links.recv_object(0)

    assert deliver(body + tag) == {"stop": "completed"}
    with pytest.raises(AuthError):
        deliver(body + tag)                                  # replayed: sequence 0 again
    with pytest.raises(AuthError):
        deliver(body + sign(key, 0, 2, 1, body))             # meant for rank 2
    with pytest.raises(AuthError):
        deliver(body + sign(message_key("y" * 40), 0, 1, 1, body))   # another secret


# --------------------------------------------------------------------- options

BAD_OPTIONS = [
    (["--nproc", "1"], "--nproc"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "-3"], "--nproc"),
    (["--nproc", "100000"], "--nproc"),
    (["--timeout", "-5"], "--timeout"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--client-timeout", "0"], "--client-timeout"),
    (["--client-timeout", "-1"], "--client-timeout"),
    (["--client-timeout", "nan"], "--client-timeout"),
    (["--client-timeout", "1e300"], "--client-timeout"),   # overflows gloo's C int
    (["--timeout", "1e300"], "--timeout"),                 # overflows time_t
    (["--real-delays", "1e300"], "--real-delays"),
    (["--real-delays", "-1"], "--real-delays"),
    (["--real-delays", "nan"], "--real-delays"),
    (["--real-delays", "inf"], "--real-delays"),
    (["--listen", "not-an-address"], "--listen"),
    (["--listen", "::1"], "--listen"),
    (["--listen", "192.0.2.2"], "not a loopback address"),
    (["--listen", "10.11.12.13"], "not a loopback address"),
    (["--secret-file", "/nonexistent/secret"], "--secret-file"),
]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if anything would start a process or bind a socket."""
    def refuse(*a, **k):
        raise AssertionError("started something before refusing")
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(secure.StoreServer, "__init__", refuse)
    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.delenv(secure.SECRET_ENV, raising=False)


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("splitfed: error: "), err
    for n in needles:
        assert n in err[0], err


@pytest.mark.parametrize("args,needle", BAD_OPTIONS,
                         ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_launch_refuses_bad_options_before_starting_anything(nothing_starts, capsys, args,
                                                             needle):
    argv = ["launch", "quick_digits", "--nproc", "3", *args]
    _one_line_error(capsys, cli.main(argv), needle)


def test_the_run_options_take_their_limits():
    """--real-delays 0 (sleep for nothing) is a valid scale, as are the longest waits;
    just past a limit is refused."""
    def options(**over):
        return argparse.Namespace(**{"timeout": 60.0, "client_timeout": 1800.0,
                                     "real_delays": None, **over})

    launch_mod.check_run_options(options(real_delays=0.0))
    launch_mod.check_run_options(options(timeout=launch_mod.MAX_WAIT_S,
                                         client_timeout=launch_mod.MAX_WAIT_S,
                                         real_delays=launch_mod.MAX_WAIT_S))
    for key in ("timeout", "client_timeout", "real_delays"):
        with pytest.raises(ConfigError, match="<= 2.592e[+]06"):
            launch_mod.check_run_options(options(**{key: launch_mod.MAX_WAIT_S * 1.001}))


def test_launch_refuses_a_short_or_exposed_secret(nothing_starts, capsys, tmp_path,
                                                  monkeypatch):
    monkeypatch.setenv(secure.SECRET_ENV, "short")
    _one_line_error(capsys, cli.main(["launch", "quick_digits", "--nproc", "2"]),
                    "$SPLITFED_SECRET", "at least 32")
    monkeypatch.delenv(secure.SECRET_ENV)
    f = tmp_path / "secret"
    f.write_text("k" * 40)
    f.chmod(0o644)
    _one_line_error(capsys, cli.main(["launch", "quick_digits", "--nproc", "2",
                                      "--secret-file", str(f)]), "chmod 600")
    f.chmod(0o600)
    f.write_text("k" * 10)
    _one_line_error(capsys, cli.main(["launch", "quick_digits", "--nproc", "2",
                                      "--secret-file", str(f)]), "at least 32")


def test_launch_refuses_an_address_of_no_interface_here(nothing_starts, capsys,
                                                       monkeypatch):
    """With a secret a public --listen passes the checks, but an address that no
    interface of this machine holds is refused before anything binds."""
    monkeypatch.setenv(secure.SECRET_ENV, SECRET)
    _one_line_error(capsys, cli.main(["launch", "quick_digits", "--nproc", "2",
                                      "--listen", "10.11.12.13"]),
                    "no network interface of this machine has this address")


def test_launch_refuses_a_bad_config_before_starting_anything(nothing_starts, capsys,
                                                              tmp_path):
    path = tmp_path / "c.yaml"
    dump_yaml(digits_config(algorithm={"name": "fedclg_c"}), path)
    _one_line_error(capsys, cli.main(["launch", str(path), "--nproc", "2"]),
                    "does not run on the multi-process runtime")
    _one_line_error(capsys, cli.main(["launch", "quick_digits", "--nproc", "2",
                                      "train.lr=oops"]), "train.lr")
    _one_line_error(capsys, cli.main(["launch", "--resume", str(tmp_path / "none"),
                                      "--nproc", "2"]), "no config.yaml")


def test_a_worker_refuses_a_public_listen_address_without_a_secret(nothing_starts, capsys,
                                                                   monkeypatch):
    from splitfed.runtime import worker

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(launch_mod.LAUNCHER_ENV, raising=False)
    monkeypatch.delenv(launch_mod.STATUS_ENV, raising=False)
    code = worker.main(["quick_digits", "--listen", "192.0.2.2",
                        "--store", "192.0.2.2:29999"])
    _one_line_error(capsys, code, "not a loopback address")
    code = worker.main(["quick_digits", "--timeout", "-5", "--store", "127.0.0.1:29999"])
    _one_line_error(capsys, code, "--timeout")
    monkeypatch.delenv(secure.STORE_ENV, raising=False)
    _one_line_error(capsys, worker.main(["quick_digits"]), "--store HOST:PORT")


def test_secrets_and_addresses():
    assert secure.parse_address("localhost") == "127.0.0.1"
    assert secure.interface_of("127.0.0.1") == "lo"
    assert secure.read_secret(None, {}) is None
    assert secure.read_secret(None, {secure.SECRET_ENV: SECRET}) == SECRET
    with pytest.raises(ConfigError):
        secure.require_secret("192.0.2.2", None)
    secure.require_secret("192.0.2.2", SECRET)
    secure.require_secret("127.0.0.5", None)
    for bad in ("host", "host:0", "host:70000", ":80"):
        with pytest.raises(ConfigError):
            secure.parse_endpoint(bad)
    assert len(secure.new_secret()) == 64


# --------------------------------------------------------------------- processes


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_killing_the_launcher_kills_every_rank(tmp_path, launcher):
    path, _ = _slow_config(tmp_path, "fedavg", rounds=40)
    run_dir = tmp_path / "run"
    proc = _launch(path, run_dir, launcher, "--real-delays", "1")
    try:
        _wait_for(lambda: _rounds_done(run_dir) >= 2, procs=[proc], what="round 2")
        assert len(_launched_by(proc.pid)) >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        _wait_for(lambda: not _launched_by(proc.pid), limit_s=15, what="all ranks gone")
        size = (run_dir / "metrics.jsonl").stat().st_size
        time.sleep(3)
        assert (run_dir / "metrics.jsonl").stat().st_size == size
        assert _rounds_done(run_dir) < 40
    finally:
        for pid in _launched_by(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_ctrl_c_stops_every_rank_with_one_line_and_status_130(tmp_path, launcher):
    path, _ = _slow_config(tmp_path, "fedavg", rounds=40)
    run_dir = tmp_path / "run"
    proc = _launch(path, run_dir, launcher, "--real-delays", "1")
    try:
        _wait_for(lambda: _rounds_done(run_dir) >= 1, procs=[proc], what="round 1")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("splitfed: interrupted"), err
        _wait_for(lambda: not _launched_by(proc.pid), limit_s=15, what="all ranks gone")
    finally:
        for pid in _launched_by(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def test_a_rank_error_under_torchrun_is_one_line_and_status_2(tmp_path):
    path, _ = _slow_config(tmp_path, "fedavg", rounds=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "something").write_text("x")             # rank 0 refuses a full run dir
    proc = _launch(path, run_dir, "torchrun", nproc=2)
    out, err = proc.communicate(timeout=LIMIT_S)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), err


@pytest.mark.parametrize("when,status", [("start", "no_client_trained"),
                                         ("round 2", "clients_lost")])
def test_a_run_that_loses_every_client_rank_does_not_complete(tmp_path, when, status):
    path, _ = _slow_config(tmp_path, "fedavg", rounds=6)
    run_dir = tmp_path / "run"
    procs = spawn(3, [str(path), "--run-dir", str(run_dir), "--real-delays", "1",
                      "--timeout", "10"], env=ENV, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    try:
        if when == "start":      # the clients received the config, and train no round
            _wait_for(lambda: (run_dir / "config.yaml").is_file(), procs=procs,
                      what="the run's start")
        else:
            _wait_for(lambda: _rounds_done(run_dir) >= 2, procs=procs, what="round 2")
        for p in procs[1:]:
            p.send_signal(signal.SIGKILL)
        codes = _finish(procs)
        out = procs[0].stdout.read()
    finally:
        procs.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status and sorted(summary["lost_ranks"]) == ["1", "2"]
    assert codes[0] == 3 and f"status {status}" in out


def test_ranks_started_by_hand_meet_at_rank_0s_store_with_a_secret_file(tmp_path):
    """The several-host way (``--store HOST:PORT``, ``--secret-file``), on loopback: rank
    0 hosts the store; a rank with another secret is refused."""
    path, _ = _slow_config(tmp_path, "fedavg", rounds=1)
    secret = tmp_path / "secret"
    secret.write_text(secure.new_secret() + "\n")
    secret.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--store", f"127.0.0.1:{port}", "--listen", "127.0.0.1",
              "--secret-file", str(secret), "--client-timeout", "60"]
    argv = [sys.executable, "-m", "splitfed.runtime.worker"]
    env = {**_env(), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen(argv + [str(path), "--run-dir", str(tmp_path / "run"),
                                      *common], env={**env, "RANK": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    wrong = {**env, "RANK": "1", secure.SECRET_ENV: secure.new_secret()}
    intruder = subprocess.run(argv + common[:4] + ["--client-timeout", "60"], env=wrong,
                              capture_output=True, text=True, timeout=LIMIT_S)
    assert intruder.returncode == 2 and "refused this process" in intruder.stderr
    procs.append(subprocess.Popen(argv + common, env={**env, "RANK": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert _finish(procs) == [0, 0], [p.stderr.read() for p in procs]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"


# --------------------------------------------------------------------- the store's framing


def test_the_store_listens_on_loopback_unless_told_otherwise():
    server = StoreServer(SECRET)
    try:
        assert server.address[0] == "127.0.0.1"
        bound = [addr for addr, port in listening([os.getpid()])
                 if port == server.address[1]]
        assert bound and all(_is_loopback(addr) for addr in bound)
    finally:
        server.close()


_KEY = b"k" * 32


def _frame(body: bytes, label: bytes, seq: int, key: bytes = _KEY) -> bytes:
    """A store message as :class:`secure._Channel` frames it: length, body, HMAC over the
    direction's label, the sequence number and the body."""
    tag = secure._mac(key, label, struct.pack(">Q", seq), body)
    return struct.pack(">I", len(body)) + body + tag


def _server_channel():
    """The server's end of an established connection, and the raw peer socket."""
    peer, mine = socket.socketpair()
    mine.settimeout(5)
    return secure._Channel(mine, _KEY, b"S"), peer


def test_a_store_message_must_carry_its_own_hmac():
    """Each message's HMAC covers the direction, its sequence number and its body: a
    changed tag, a replayed message, and the server's own message sent back to it are
    all refused."""
    chan, peer = _server_channel()
    try:
        peer.sendall(_frame(b"first", b"C", 0))
        assert chan.recv() == b"first"
        bad = bytearray(_frame(b"second", b"C", 1))
        bad[-1] ^= 1
        peer.sendall(bytes(bad))
        with pytest.raises(AuthError, match="wrong HMAC"):
            chan.recv()
        peer.sendall(_frame(b"first", b"C", 0))          # a replay of message 0
        with pytest.raises(AuthError, match="wrong HMAC"):
            chan.recv()
        peer.sendall(_frame(b"second", b"S", 1))         # reflected: the server's label
        with pytest.raises(AuthError, match="wrong HMAC"):
            chan.recv()
        peer.sendall(_frame(b"second", b"C", 1))         # the next one in order passes
        assert chan.recv() == b"second"
    finally:
        chan.sock.close()
        peer.close()


def test_a_store_message_over_the_size_limit_is_refused_before_its_body():
    chan, peer = _server_channel()
    try:
        peer.sendall(struct.pack(">I", secure.MAX_FRAME + 1))
        with pytest.raises(AuthError, match="over the limit"):
            chan.recv()                                  # no body is waited for
    finally:
        chan.sock.close()
        peer.close()


def test_a_store_that_cannot_prove_the_secret_is_refused():
    """The client checks the store's answer too: a listener that greets like a store but
    does not know the secret (it answers 32 random bytes) is refused."""
    mine, fake = socket.socketpair()

    def impostor():
        fake.sendall(secure.MAGIC + os.urandom(secure.NONCE))
        secure._recv_exact(fake, secure.NONCE + secure.TAG)
        fake.sendall(os.urandom(secure.TAG))

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthError, match="did not prove"):
            secure.client_handshake(mine, SECRET, timeout_s=5)
    finally:
        thread.join(5)
        mine.close()
        fake.close()


def test_compare_set_of_an_absent_key_sets_it_only_when_nothing_is_expected():
    """As torch's stores: an absent key is set when the expected value is empty, else
    left absent (the expected value comes back)."""
    server = StoreServer(SECRET)
    host, port = server.address
    try:
        store = AuthStore(host, port, SECRET)
        assert store.compare_set("absent", b"x", b"y") == b"x"
        assert not store.check(["absent"])
        assert store.compare_set("new", b"", b"v") == b"v" and store.get("new") == b"v"
        assert store.compare_set("new", b"other", b"w") == b"v"     # not what was there
        assert store.get("new") == b"v"
    finally:
        server.close()
