"""The cut layer: what split algorithms share.

A split algorithm keeps one global model state (the full model's ``state_dict``); the
client side is the first ``env.cut`` blocks, the server side the rest, and their keys
partition the model's keys. Everything that crosses the cut goes through the transport:
activations and labels up, cut-layer gradients down. Raw inputs never do.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitfed.models import split


@dataclass
class SplitModel:
    """The client and server templates of ``env.model`` at ``env.cut`` and their keys."""

    client: nn.Module
    server: nn.Module
    client_keys: list[str]
    server_keys: list[str]

    @classmethod
    def of(cls, env) -> SplitModel:
        client, server = split(env.model, env.cut)
        return cls(client, server, list(client.state_dict()), list(server.state_dict()))

    def client_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: full[k] for k in self.client_keys}

    def server_state(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: full[k] for k in self.server_keys}

    def client_module(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A trainable copy of the client side holding ``state``."""
        return _trainable_copy(self.client, state)

    def server_module(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A trainable copy of the server side holding ``state``."""
        return _trainable_copy(self.server, state)


def _trainable_copy(template: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    module = copy.deepcopy(template)
    module.load_state_dict(state)
    module.train()
    return module


def send_activations(env, ids: np.ndarray, acts: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upload per-client activations [C, B, ...] and labels [C, B]; the server's copies.

    The returned activations are a fresh autograd leaf (the server's own graph starts
    there) so the server can compute the cut-layer gradient.
    """
    h = env.transport.upload("activations", ids, acts)
    y = env.transport.upload("labels", ids, labels)
    return h.requires_grad_(True), y


def return_gradients(env, ids: np.ndarray, grads: torch.Tensor) -> torch.Tensor:
    """Download the cut-layer gradients [C, B, ...] to the clients."""
    return env.transport.download("activation_grads", ids, grads)


def per_client_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each client's batch: ``out`` [C, B, K], ``y`` [C, B] -> [C]."""
    c = out.shape[0]
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(c, -1).mean(1)


def participation_probability(env, ids: np.ndarray) -> np.ndarray:
    """q_n of each slot: the bernoulli probabilities, or 1 for the other modes."""
    q = getattr(env.sampler, "q", None)
    if q is None:
        return np.ones(len(ids))
    return np.asarray(q, dtype=np.float64)[np.asarray(ids)]


def sgd(module: nn.Module, env, saved: dict | None, lr: float | None = None
        ) -> torch.optim.SGD:
    """The server's optimizer (SPEC: server optimizer state persists across rounds)."""
    tr = env.config.train
    opt = torch.optim.SGD(module.parameters(), lr=tr.lr, momentum=tr.momentum,
                          weight_decay=tr.weight_decay)
    if saved is not None:
        opt.load_state_dict(saved)
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    return opt
