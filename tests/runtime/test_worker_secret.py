"""No part of the multi-process runtime runs with an empty key: a rank started by hand
without a secret refuses to start (one line saying how to give one) before it binds or
connects anything, the store's server and client refuse an empty secret, a secret of too
little variety is refused, ``splitfed launch`` still makes its own. The store lets at
most ``MAX_HANDSHAKES`` connections wait for their handshake and closes the others at
once; a rank so dropped retries."""

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from splitfed.errors import AuthError, ConfigError, SplitfedError
from splitfed.runtime import launch, secure, worker
from splitfed.runtime.secure import AuthStore, StoreServer

LIMIT_S = 120
SECRET = secure.new_secret()


@pytest.fixture
def nothing_binds(monkeypatch):
    """Fail the test if anything would start a store, bind or connect a socket."""
    def refuse(*a, **k):
        raise AssertionError("bound or connected something before refusing")
    monkeypatch.setattr(secure.StoreServer, "__init__", refuse)
    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv(secure.SECRET_ENV, raising=False)
    monkeypatch.delenv(launch.LAUNCHER_ENV, raising=False)
    monkeypatch.delenv(launch.STATUS_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_started_by_hand_without_a_secret_refuses_to_start(nothing_binds, capsys,
                                                                  monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    code = worker.main(["quick_digits", "--store", "127.0.0.1:29999"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"splitfed: error: rank {rank}: no shared secret"), err
    assert "$SPLITFED_SECRET" in err[0] and "--secret-file FILE" in err[0], err
    monkeypatch.setenv(secure.STORE_ENV, "127.0.0.1:29999")       # as launch would set it
    assert worker.main(["quick_digits"]) == 2
    assert "no shared secret" in capsys.readouterr().err


def test_the_worker_process_refuses_without_a_secret(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in (secure.SECRET_ENV, secure.STORE_ENV, launch.LAUNCHER_ENV)}
    env.update(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "splitfed.runtime.worker", "quick_digits",
                           "--store", f"127.0.0.1:{port}"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=LIMIT_S)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no shared secret" in lines[0] and "SPLITFED_SECRET" in lines[0], lines


@pytest.mark.parametrize("secret", [None, "", "   "])
def test_the_store_refuses_an_empty_secret(secret, monkeypatch):
    with pytest.raises(AuthError, match=r"no shared secret.*\$SPLITFED_SECRET"):
        StoreServer(secret)

    def refuse(*a, **k):
        raise AssertionError("connected without a secret")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(AuthError, match=r"no shared secret.*--secret-file"):
        AuthStore("127.0.0.1", 29999, secret)


@pytest.mark.parametrize("bad, distinct", [("a" * 32, 1), ("ab" * 20, 2),
                                           ("abcdefg" * 6, 7)])
def test_a_secret_of_too_little_variety_is_refused(tmp_path, bad, distinct):
    with pytest.raises(ConfigError) as info:
        secure.read_secret(None, {secure.SECRET_ENV: bad})
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("$SPLITFED_SECRET: "), msg
    assert f"only {distinct} distinct characters" in msg and "at least 8" in msg, msg
    path = tmp_path / "secret"
    path.write_text(bad + "\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=f"--secret-file {path}: .* only {distinct} "):
        secure.read_secret(str(path), {})


@pytest.mark.parametrize("inner", ["\x00", "\n", "\x7f", "\t"])
def test_a_secret_file_holding_a_control_character_is_one_error(tmp_path, inner):
    path = tmp_path / "secret"
    path.write_bytes((SECRET[:20] + inner + SECRET[20:] + "\n").encode())
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=rf"^--secret-file {path}: the secret holds a "
                                          r"control character \(a NUL byte, a line break\); "):
        secure.read_secret(str(path), {})


def test_good_secrets_are_accepted(tmp_path):
    assert secure.read_secret(None, {secure.SECRET_ENV: SECRET}) == SECRET
    eight = "abcdefgh" * 4
    assert secure.read_secret(None, {secure.SECRET_ENV: eight}) == eight
    assert secure.read_secret(None, {}) is None       # launch then makes one


def test_launch_makes_a_secret_the_ranks_accept():
    ranks, env = launch._setup()
    try:
        secret = env[secure.SECRET_ENV]
        assert ranks.secret == secret and ranks.server.secret == secret
        assert secure.read_secret(None, env) == secret
        host, port = ranks.server.address
        AuthStore(host, port, secret).set("k", b"v")
        assert ranks.server.data == {b"k": b"v"}
    finally:
        ranks.close()


def test_unauthenticated_connections_are_capped(monkeypatch):
    monkeypatch.setattr(secure, "MAX_HANDSHAKES", 4)
    server = StoreServer(SECRET)
    host, port = server.address
    idle = []
    try:
        # threads started from here on: the server's (a thread of an earlier test that
        # ends meanwhile would upset a count of all threads)
        before = set(threading.enumerate())

        def started():
            return sum(t not in before for t in threading.enumerate())
        for _ in range(4):                       # they connect and never answer
            s = socket.create_connection((host, port), timeout=10)
            assert s.recv(64).startswith(secure.MAGIC)      # each has its handshake
            idle.append(s)
        assert started() == 4
        for _ in range(20):                      # the others are closed at once
            with socket.create_connection((host, port), timeout=10) as s:
                try:
                    assert s.recv(64) == b""
                except ConnectionResetError:
                    pass
        assert server.dropped == 20
        assert started() == 4
        result = {}

        def join():                              # a rank that is dropped retries
            try:
                result["store"] = AuthStore(host, port, SECRET, connect_s=30)
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = e

        t = threading.Thread(target=join)
        t.start()
        time.sleep(0.5)
        assert "store" not in result and server.dropped > 20
        for s in idle:
            s.close()
        t.join(LIMIT_S)
        assert "error" not in result, result
        result["store"].set("k", b"v")
        assert server.data == {b"k": b"v"} and server.refused >= 4
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_handshake_sent_byte_by_byte_is_cut_at_the_handshake_limit(monkeypatch):
    # the limit is on the whole handshake: a peer that sends a byte now and then within
    # each read's timeout does not keep its slot longer
    monkeypatch.setattr(secure, "HANDSHAKE_S", 1.0)
    server = StoreServer(SECRET)
    host, port = server.address
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            assert s.recv(64).startswith(secure.MAGIC)
            start = time.monotonic()
            closed = False
            while time.monotonic() - start < 5 and not closed:
                try:
                    s.sendall(b"x")
                    time.sleep(0.3)
                except OSError:
                    closed = True
            if not closed:
                s.settimeout(1)
                try:
                    closed = s.recv(64) == b""
                except TimeoutError:                # still open
                    pass
                except OSError:                     # reset
                    closed = True
            assert closed and time.monotonic() - start < 3
    finally:
        server.close()


@pytest.mark.parametrize("rank, world", [("abc", "2"), ("5", "2"), ("2", "2"), ("-1", "2"),
                                         ("0", "x")])
def test_a_rank_and_world_size_that_cannot_be_are_refused_in_one_line(nothing_binds, capsys,
                                                                      monkeypatch, rank,
                                                                      world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert worker.main(["quick_digits", "--store", "127.0.0.1:29999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be integers with 0 <= RANK < WORLD_SIZE" in err[0], err


def test_a_store_port_in_use_is_refused_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^--store 127.0.0.1:{port}: cannot listen "
                                              r"there \(.*\); choose a free port"):
            StoreServer(SECRET, "127.0.0.1", port)


def _fake_store(mode: str):
    """A listener that is not the run's store: ``silent`` accepts and sends nothing,
    ``trickle`` sends a greeting's worth of bytes one every 0.2 s, ``greeting`` sends a
    store's greeting and then nothing. Returns the listening socket (close it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve():
        conns = []
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            conns.append(conn)
            try:
                if mode == "greeting":
                    conn.sendall(secure.MAGIC + b"n" * secure.NONCE)
                elif mode == "trickle":
                    threading.Thread(target=trickle, args=(conn,), daemon=True).start()
            except OSError:
                pass

    def trickle(conn):
        try:
            for byte in secure.MAGIC + b"n" * 200:
                conn.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize("mode", ["silent", "trickle", "greeting"])
def test_a_store_that_does_not_answer_in_time_is_a_timeout_within_the_client_timeout(
        monkeypatch, mode):
    # the limit is on the client's whole handshake, and no longer than the store's
    # timeout (a rank's --client-timeout); the error says it timed out, not that the
    # secret differs
    monkeypatch.setattr(secure, "HANDSHAKE_S", 5.0)
    listener = _fake_store(mode)
    host, port = listener.getsockname()
    try:
        start = time.monotonic()
        with pytest.raises(SplitfedError) as info:
            AuthStore(host, port, SECRET, timeout=timedelta(seconds=1.0))
        took = time.monotonic() - start
        assert took < 3.0, took
        msg = str(info.value)
        assert not isinstance(info.value, AuthError) and "secret" not in msg, msg
        assert msg == (f"the run's store at {host}:{port} did not complete its handshake "
                       "within 1 s (timed out); check that HOST:PORT is the run's store "
                       "(rank 0 hosts it with --store)")
    finally:
        listener.close()


def test_a_trickling_peer_cannot_stretch_the_clients_handshake(monkeypatch):
    monkeypatch.setattr(secure, "HANDSHAKE_S", 1.0)
    listener = _fake_store("trickle")
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as s:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                secure.client_handshake(s, SECRET)
            assert time.monotonic() - start < 2.0
        with socket.create_connection(listener.getsockname(), timeout=10) as s:
            start = time.monotonic()
            with pytest.raises(secure.HandshakeTimeout):
                secure.client_handshake(s, SECRET, timeout_s=0.5)
            assert time.monotonic() - start < 1.5
    finally:
        listener.close()


def test_a_store_with_another_secret_is_still_blamed_on_the_secret():
    server = StoreServer(secure.new_secret())
    host, port = server.address
    try:
        with pytest.raises(AuthError, match="the secret differs"):
            AuthStore(host, port, SECRET, timeout=timedelta(seconds=5.0))
    finally:
        server.close()


def test_a_secret_one_character_short_is_refused():
    """The length limit is exact: 31 distinct characters are refused, 32 accepted."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    short, enough = alphabet[:secure.MIN_SECRET - 1], alphabet[:secure.MIN_SECRET]
    with pytest.raises(ConfigError, match=f"has {secure.MIN_SECRET - 1} characters"):
        secure.read_secret(None, {secure.SECRET_ENV: short})
    assert secure.read_secret(None, {secure.SECRET_ENV: enough}) == enough


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o610, 0o604, 0o602, 0o601])
def test_a_secret_file_any_other_user_can_access_is_refused(tmp_path, mode):
    """Access by the group counts as much as access by everyone."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    with pytest.raises(ConfigError, match="other users can access it; chmod 600"):
        secure.read_secret(str(path), {})
    path.chmod(0o600)
    assert secure.read_secret(str(path), {}) == SECRET
    path.chmod(0o400)
    assert secure.read_secret(str(path), {}) == SECRET
