"""The in-process transport hands tensors over by reference, but as a network hop would:
the receiving side starts a new autograd graph."""

import torch

from splitfed.transport.base import InProcessTransport
from splitfed.transport.ledger import Ledger


def test_the_in_process_transport_delivers_detached_tensors():
    """No gradient flows back into the sender's graph through what crossed, for a
    tensor payload and for a mapping alike; the values are unchanged."""
    w = torch.ones(2, 3, requires_grad=True)
    sent = w * 2.0
    transport = InProcessTransport(Ledger(2))
    got = transport.upload("activations", [0, 1], sent)
    mapped = transport.download("activation_grads", [0, 1], {"g": sent})
    for t in (got, mapped["g"]):
        assert t.grad_fn is None and not t.requires_grad
        assert torch.equal(t, sent.detach())
