"""How tensors travel between clients and servers, and the ledger that counts them.

Algorithms never move tensors themselves: they hand them to a :class:`Transport`, which
records every transfer in the :class:`Ledger` and delivers the payload. The in-process
transport delivers by reference; a multi-process one can implement the same interface.
"""

from splitfed.transport.base import DOWN, KINDS, UP, InProcessTransport, Transport, payload_bytes
from splitfed.transport.ledger import Ledger

__all__ = ["DOWN", "KINDS", "UP", "InProcessTransport", "Ledger", "Transport", "payload_bytes"]
