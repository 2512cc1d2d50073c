"""Who may join a run: the shared secret, the authenticated rendezvous store, addresses.

The ranks of a run meet through a key-value store (gloo writes each rank's address
there and reads its peers'). torch's TCPStore has no authentication and listens on
every interface, so the runtime uses its own store instead:

- :class:`StoreServer`: a small TCP server (a thread of ``splitfed launch``, or of rank 0
  when the ranks are started by hand) bound to one address, loopback by default.
- :class:`AuthStore`: a :class:`torch.distributed.Store` that talks to it; passed to
  ``init_process_group(store=...)``.

Every connection starts with a mutual HMAC-SHA256 challenge-response over the run's
secret: the server sends a random nonce, the client answers with its own nonce and
``HMAC(secret, "client" | both nonces)``; the server checks it (constant time) and only
then answers ``HMAC(secret, "server" | both nonces)``, which the client checks. A peer
without the secret gets nothing but the server's nonce and is disconnected: it reads no
key and writes none. After the handshake every request and reply carries an HMAC under a
key derived from the secret and both nonces, with a sequence number (no replay, no
injection into the connection). Requests are a fixed binary framing (no pickle).

Secrets: ``splitfed launch`` makes a random one per run unless ``SPLITFED_SECRET`` or
``--secret-file`` gives one; the ranks receive it in their environment. A secret given by
the user must have at least :data:`MIN_SECRET` characters, of which at least
:data:`MIN_DISTINCT` distinct ones. There is no run without a secret: the store (server
and client) and a rank started by hand refuse to start without one, whatever the
address (an empty key would let any local process join the run).

A peer that connects has :data:`HANDSHAKE_S` seconds to prove the secret, and a client
has as long for the whole of its side (no longer than its store timeout, a rank's
``--client-timeout``): a peer that sends its bytes slowly does not stretch either; at most
:data:`MAX_HANDSHAKES` connections wait for their handshake at a time, and the server
closes any connection beyond them at once (a client retries while it may connect).
"""

from __future__ import annotations

import fcntl
import hmac
import ipaddress
import os
import secrets as _secrets
import socket
import stat
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from splitfed.errors import AuthError, ConfigError, SplitfedError
from splitfed.transport.signing import mac as _mac
from splitfed.transport.signing import message_key, sign, verify  # noqa: F401 (re-exported)

#: environment variables the ranks read
SECRET_ENV = "SPLITFED_SECRET"
STORE_ENV = "SPLITFED_STORE"
LISTEN_ENV = "SPLITFED_LISTEN"
#: fewest characters of a user's secret (defined with the run options, which must not
#: import torch: ``splitfed`` answers a bad option before torch loads)
from splitfed.runtime.options import MIN_SECRET  # noqa: E402
#: fewest distinct characters of a user's secret (32 repeats of one character is no secret)
MIN_DISTINCT = 8
MAGIC = b"SFST1"
NONCE = 32
TAG = 32
MAX_FRAME = 64 << 20
HANDSHAKE_S = 10.0
#: most connections the store lets wait for their handshake at a time
MAX_HANDSHAKES = 64
#: how to give a secret (the end of the errors that ask for one)
SECRET_HINT = (f"set ${SECRET_ENV} or give --secret-file FILE (the same secret on every "
               f"rank, at least {MIN_SECRET} characters, e.g. from: openssl rand -hex 32); "
               "splitfed launch makes one itself")


# --------------------------------------------------------------------- secrets/addresses


def new_secret() -> str:
    """A random secret for one run (64 hex characters)."""
    return _secrets.token_hex(32)


#: the largest secret file read (a secret is a line of some dozens of characters)
MAX_SECRET_BYTES = 64 << 10


def read_secret(secret_file: str | None = None, env: dict | None = None) -> str | None:
    """The secret from ``secret_file`` (if given) or ``$SPLITFED_SECRET``; None if
    neither. Raises :class:`ConfigError` for a missing, unreadable, group/world-readable
    or short secret, one holding a control character (the ranks get it through their
    environment, which holds no NUL), or one of fewer than :data:`MIN_DISTINCT` distinct
    characters."""
    env = os.environ if env is None else env
    if secret_file is not None:
        from splitfed.safeio import read_regular

        path = Path(secret_file)
        try:
            mode = path.stat().st_mode
            text = read_regular(path, f"--secret-file {secret_file}", MAX_SECRET_BYTES,
                                error=ConfigError,
                                hint="give a file holding the secret").decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--secret-file {secret_file}: cannot read it ({e})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"--secret-file {secret_file}: other users can access it; "
                              f"chmod 600 {secret_file}")
        secret, where = text.strip(), f"--secret-file {secret_file}"
    elif env.get(SECRET_ENV) is not None:
        secret, where = env[SECRET_ENV].strip(), f"${SECRET_ENV}"
    else:
        return None
    if any(ord(c) < 32 or ord(c) == 127 for c in secret):    # it travels in environment
        raise ConfigError(f"{where}: the secret holds a control character (a NUL byte, a "
                          "line break); give one line of printable text (e.g. from: "
                          "openssl rand -hex 32)")
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"{where}: the secret has {len(secret)} characters; give at least "
                          f"{MIN_SECRET} (e.g. from: openssl rand -hex 32)")
    distinct = len(set(secret))
    if distinct < MIN_DISTINCT:
        raise ConfigError(f"{where}: the secret has only {distinct} distinct characters; "
                          f"give one with at least {MIN_DISTINCT} (e.g. from: openssl rand "
                          "-hex 32)")
    return secret


def parse_address(text: str, what: str = "--listen") -> str:
    """An IPv4 address (a literal, or a name that resolves to one) as a string."""
    text = str(text).strip()
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        pass
    if text == "localhost":
        return "127.0.0.1"
    raise ConfigError(f"{what}: expected an IPv4 address such as 127.0.0.1 or 10.0.0.5, "
                      f"got {text!r}")


def parse_endpoint(text: str, what: str = "--store") -> tuple[str, int]:
    """``HOST:PORT`` (HOST an IPv4 address or a host name) as ``(host, port)``."""
    host, sep, port = str(text).strip().rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        port_n = -1
    if not sep or not host or not 0 < port_n < 65536:
        raise ConfigError(f"{what}: expected HOST:PORT (port 1-65535), got {text!r}")
    return host, port_n


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def require_secret(listen: str, secret: str | None) -> None:
    """Refuse to bind a non-loopback address without a secret (before binding)."""
    if secret is None and not is_loopback(listen):
        raise ConfigError(f"--listen {listen} is not a loopback address: other machines "
                          f"could join the run; give a shared secret with --secret-file "
                          f"FILE or ${SECRET_ENV} (at least {MIN_SECRET} characters)")


_SIOCGIFADDR = 0x8915


def interface_of(addr: str) -> str:
    """The name of the network interface that holds the IPv4 address ``addr`` (gloo
    binds to an interface: ``GLOO_SOCKET_IFNAME``)."""
    if is_loopback(addr):
        names = [n for _, n in socket.if_nameindex()]
        return "lo" if "lo" in names else _find_interface("127.0.0.1", names)
    return _find_interface(addr, [n for _, n in socket.if_nameindex()])


def _find_interface(addr: str, names: list[str]) -> str:
    want = socket.inet_aton(addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if raw[20:24] == want:
                return name
    raise ConfigError(f"--listen {addr}: no network interface of this machine has this "
                      "address")


# --------------------------------------------------------------------- framing


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``; with ``deadline`` (a ``time.monotonic()`` value) all of
    them by then, however slowly a peer sends them (TimeoutError otherwise)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer took too long")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        buf += chunk
    return bytes(buf)


class _Channel:
    """One authenticated connection: framed messages with an HMAC and a sequence number
    per direction."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes):
        self.sock, self.key = sock, key
        self.out_label = side
        self.in_label = b"S" if side == b"C" else b"C"
        self.out_seq = self.in_seq = 0

    def send(self, body: bytes) -> None:
        tag = _mac(self.key, self.out_label, struct.pack(">Q", self.out_seq), body)
        self.out_seq += 1
        self.sock.sendall(struct.pack(">I", len(body)) + body + tag)

    def recv(self) -> bytes:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise AuthError(f"a store message of {n} bytes is over the limit")
        body = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, TAG)
        want = _mac(self.key, self.in_label, struct.pack(">Q", self.in_seq), body)
        if not hmac.compare_digest(tag, want):
            raise AuthError("a store message has a wrong HMAC")
        self.in_seq += 1
        return body


def require_key(secret: str | None, who: str) -> None:
    """Raise :class:`AuthError` (one line, saying how to give one) when ``secret`` is
    None or empty: nothing of the store runs with an empty key."""
    if secret is None or not str(secret).strip():
        raise AuthError(f"{who}: no shared secret; the run's store never runs without one: "
                        f"{SECRET_HINT}")


def _secret_bytes(secret: str | None) -> bytes:
    require_key(secret, "the run's store")
    return secret.encode("utf-8")


class _NoGreeting(ConnectionError):
    """The store closed the connection before its greeting (too many handshakes)."""


class HandshakeTimeout(TimeoutError):
    """The peer did not complete its part of the handshake in time."""


def _begin_handshake(sock: socket.socket, secret: str | None,
                     timeout_s: float | None) -> tuple[bytes, float]:
    """The key and the deadline (a ``time.monotonic()`` value) of a handshake that must
    end within ``timeout_s`` seconds (:data:`HANDSHAKE_S`): the limit is on the whole
    handshake, not on each read, so a peer that sends a byte now and then does not
    stretch it."""
    key = _secret_bytes(secret)
    timeout_s = HANDSHAKE_S if timeout_s is None else float(timeout_s)
    sock.settimeout(timeout_s)
    return key, time.monotonic() + timeout_s


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    """:func:`_recv_exact` by ``deadline``; :class:`HandshakeTimeout` past it."""
    try:
        return _recv_exact(sock, n, deadline)
    except TimeoutError as e:           # the deadline, or the socket's own timeout
        raise HandshakeTimeout(str(e) or "timed out") from None


def server_handshake(sock: socket.socket, secret: str | None,
                     timeout_s: float | None = None) -> _Channel:
    key, deadline = _begin_handshake(sock, secret, timeout_s)
    ns = os.urandom(NONCE)
    sock.sendall(MAGIC + ns)
    reply = _read(sock, NONCE + TAG, deadline)
    nc, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"client", ns, nc)):
        raise AuthError("a peer did not prove the run's secret")
    sock.sendall(_mac(key, b"server", ns, nc))
    sock.settimeout(None)
    return _Channel(sock, _mac(key, b"session", ns, nc), b"S")


def client_handshake(sock: socket.socket, secret: str | None,
                     timeout_s: float | None = None) -> _Channel:
    """The client's side of the handshake, whole within ``timeout_s`` seconds
    (:data:`HANDSHAKE_S`; :class:`HandshakeTimeout` past it)."""
    key, deadline = _begin_handshake(sock, secret, timeout_s)
    try:
        head = _read(sock, len(MAGIC) + NONCE, deadline)
    except ConnectionError:
        raise _NoGreeting("the store closed the connection before its greeting") from None
    if head[:len(MAGIC)] != MAGIC:
        raise AuthError("the store is not a splitfed store")
    ns, nc = head[len(MAGIC):], os.urandom(NONCE)
    sock.sendall(nc + _mac(key, b"client", ns, nc))
    try:
        proof = _read(sock, TAG, deadline)
    except ConnectionError:
        raise AuthError("the store refused this process: the secret differs "
                        f"(${SECRET_ENV} / --secret-file)") from None
    if not hmac.compare_digest(proof, _mac(key, b"server", ns, nc)):
        raise AuthError("the store did not prove the run's secret")
    sock.settimeout(None)
    return _Channel(sock, _mac(key, b"session", ns, nc), b"C")


# --------------------------------------------------------------------- store protocol

_SET, _GET, _ADD, _CHECK, _CAS, _DEL, _NUM, _WAIT = range(1, 9)
_OK, _TIMEOUT, _MISSING = 0, 1, 2


def _pack(*fields: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from(">I", data, i)
        i += 4
        if i + n > len(data):
            raise AuthError("a malformed store message")
        out.append(data[i:i + n])
        i += n
    return out


class StoreServer:
    """The run's key-value store (module doc), served by daemon threads."""

    def __init__(self, secret: str | None, host: str = "127.0.0.1", port: int = 0,
                 sock: socket.socket | None = None):
        require_key(secret, "the run's store")
        self.secret = secret
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                raise ConfigError(f"--store {host}:{port}: cannot listen there "
                                  f"({e.strerror or e}); choose a free port") from None
        sock.listen(128)
        self.sock = sock
        self.address = sock.getsockname()[:2]
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.refused = 0
        self.dropped = 0            # connections closed at once: MAX_HANDSHAKES were waiting
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True,
                         name="splitfed-store").start()

    @property
    def endpoint(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                with self.cond:                 # MAX_HANDSHAKES peers have yet to prove
                    self.dropped += 1           # the secret: no thread for this one
                try:
                    conn.close()
                except OSError:
                    pass
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except RuntimeError:                # no thread to be had: drop the connection
                self._handshakes.release()
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                try:
                    chan = server_handshake(conn, self.secret)
                except (AuthError, ConnectionError, OSError):
                    with self.cond:
                        self.refused += 1
                    return
                finally:
                    self._handshakes.release()
                while True:
                    chan.send(self._handle(_unpack(chan.recv())))
        except Exception:  # noqa: BLE001 - a bad request or a closed peer: drop the link
            return

    def _wait_for(self, keys: list[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
        return True

    def _handle(self, req: list[bytes]) -> bytes:
        op, args = req[0][0], req[1:]
        d = self.data
        if op == _SET:
            with self.cond:
                d[args[0]] = args[1]
                self.cond.notify_all()
            return _pack(bytes([_OK]))
        if op in (_GET, _WAIT):
            timeout_s = struct.unpack(">d", args[0])[0]
            keys = args[1:]
            if not self._wait_for(keys, timeout_s):
                return _pack(bytes([_TIMEOUT]))
            with self.cond:
                return _pack(bytes([_OK]), d[keys[0]] if op == _GET else b"")
        if op == _ADD:
            with self.cond:
                value = int(d.get(args[0], b"0")) + struct.unpack(">q", args[1])[0]
                d[args[0]] = str(value).encode()
                self.cond.notify_all()
            return _pack(bytes([_OK]), struct.pack(">q", value))
        if op == _CHECK:
            with self.cond:
                return _pack(bytes([_OK if all(k in d for k in args) else _MISSING]))
        if op == _CAS:
            key, expected, desired = args
            with self.cond:
                cur = d.get(key)
                if (cur is None and expected == b"") or cur == expected:
                    d[key] = desired
                    self.cond.notify_all()
                    cur = desired
                return _pack(bytes([_OK]), expected if cur is None else cur)
        if op == _DEL:
            with self.cond:
                return _pack(bytes([_OK if d.pop(args[0], None) is not None else _MISSING]))
        if op == _NUM:
            with self.cond:
                return _pack(bytes([_OK]), struct.pack(">q", len(d)))
        raise AuthError(f"unknown store request {op}")


def _key(k) -> bytes:
    return k.encode("utf-8") if isinstance(k, str) else bytes(k)


class AuthStore(dist.Store):
    """A :class:`torch.distributed.Store` on a :class:`StoreServer` (module doc)."""

    def __init__(self, host: str, port: int, secret: str | None,
                 timeout: timedelta = timedelta(seconds=300), connect_s: float = 60.0):
        super().__init__()
        require_key(secret, f"the run's store at {host}:{port}")
        self._timeout = timeout
        self._lock = threading.Lock()
        # reaching the store and its handshake end within connect_s seconds, and within
        # the store's timeout (a rank's --client-timeout) when that is shorter
        wait_s = min(float(connect_s), self._seconds(None))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock = socket.create_connection((host, port),
                                                timeout=self._limit(deadline))
            except OSError as e:
                if time.monotonic() > deadline:
                    raise SplitfedError(f"cannot reach the run's store at {host}:{port} "
                                        f"({e})") from None
                time.sleep(0.1)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            limit = self._limit(deadline)
            try:
                self._chan = client_handshake(sock, secret, limit)
                break
            except _NoGreeting:
                sock.close()
                if time.monotonic() > deadline:     # it kept dropping us: too busy
                    raise SplitfedError(f"the run's store at {host}:{port} closed every "
                                        "connection before its greeting for "
                                        f"{wait_s:g} s (it has {MAX_HANDSHAKES} "
                                        "connections waiting for their handshake); try "
                                        "again") from None
                time.sleep(0.1)
            except HandshakeTimeout:
                sock.close()
                raise SplitfedError(f"the run's store at {host}:{port} did not complete "
                                    f"its handshake within {wait_s:g} s (timed out); check "
                                    "that HOST:PORT is the run's store (rank 0 hosts it "
                                    "with --store)") from None
            except (ConnectionError, OSError) as e:
                sock.close()
                raise AuthError(f"the run's store at {host}:{port} refused this process "
                                f"({e}); the secret differs") from None
            except AuthError:
                sock.close()
                raise

    @staticmethod
    def _limit(deadline: float) -> float:
        """Seconds for one connection or handshake: :data:`HANDSHAKE_S`, and no later
        than ``deadline`` (a tenth of a second at least)."""
        return round(max(0.1, min(HANDSHAKE_S, deadline - time.monotonic())), 3)

    def _call(self, op: int, *args: bytes) -> list[bytes]:
        with self._lock:
            self._chan.send(_pack(bytes([op]), *args))
            reply = _unpack(self._chan.recv())
        return reply

    def _seconds(self, timeout) -> float:
        t = self._timeout if timeout is None else timeout
        s = t.total_seconds() if isinstance(t, timedelta) else float(t)
        return 365 * 86400.0 if s <= 0 else s

    def set(self, key, value) -> None:
        self._call(_SET, _key(key), _key(value))

    def get(self, key) -> bytes:
        s = self._seconds(None)
        reply = self._call(_GET, struct.pack(">d", s), _key(key))
        if reply[0][0] != _OK:
            raise dist.DistStoreError(f"the run's store: key {key!r} did not appear "
                                      f"within {s:g} s")
        return reply[1]

    def add(self, key, value: int) -> int:
        return struct.unpack(">q", self._call(_ADD, _key(key),
                                              struct.pack(">q", int(value)))[1])[0]

    def check(self, keys) -> bool:
        return self._call(_CHECK, *[_key(k) for k in keys])[0][0] == _OK

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(_CAS, _key(key), _key(expected), _key(desired))[1]

    def delete_key(self, key) -> bool:
        return self._call(_DEL, _key(key))[0][0] == _OK

    def num_keys(self) -> int:
        return struct.unpack(">q", self._call(_NUM)[1])[0]

    def wait(self, keys, timeout=None) -> None:
        s = self._seconds(timeout)
        reply = self._call(_WAIT, struct.pack(">d", s), *[_key(k) for k in keys])
        if reply[0][0] != _OK:
            raise dist.DistStoreError(f"the run's store: keys {list(keys)!r} did not "
                                      f"appear within {s:g} s")

    def set_timeout(self, timeout) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout
