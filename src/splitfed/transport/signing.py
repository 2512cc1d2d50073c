"""HMACs of the multi-process runtime's messages under the run's shared secret.

The store's channels (:mod:`splitfed.runtime.secure`) and the control messages between
ranks (:mod:`splitfed.transport.distributed`) sign with these; they live with the
transport so that it needs nothing from the runtime above it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from splitfed.errors import AuthError


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the concatenated parts."""
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def message_key(secret: str | None) -> bytes | None:
    """The key of the control messages' HMACs (None without a secret)."""
    return None if secret is None else mac(secret.encode("utf-8"), b"splitfed-messages")


def sign(key: bytes, sender: int, receiver: int, seq: int, body: bytes) -> bytes:
    """The tag of message number ``seq`` from ``sender`` to ``receiver``."""
    return mac(key, struct.pack(">iiQ", sender, receiver, seq), body)


def verify(key: bytes, sender: int, receiver: int, seq: int, body: bytes,
           tag: bytes) -> None:
    """Raise :class:`AuthError` unless ``tag`` is that message's tag (constant time)."""
    if not hmac.compare_digest(tag, sign(key, sender, receiver, seq, body)):
        raise AuthError(f"a control message from rank {sender} has a wrong HMAC (not from "
                        "this run's rank 0, or out of order); refused unread")
