"""One seed drives everything.

A run derives independent, named random streams from its master seed once, at start-up:
``streams = RandomStreams(seed)``; ``streams.numpy("partition")`` and
``streams.torch("init")`` always return the same stream for the same name and seed.
Code never reseeds inside loops: it draws from the stream it was handed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the stream ``name`` under master ``seed`` (stable across runs).
    Every master seed of the config's range (-2^63..2^63-1) gives its own streams: a
    negative one enters as its 64-bit two's complement (2^64 + seed), above every
    non-negative one."""
    ss = np.random.SeedSequence([int(seed) % 2**64, _name_key(name)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] & np.uint64(2**63 - 1))


#: the stream name of torch's process-wide default generator (dropout, and any code that
#: draws without a generator), which :meth:`RandomStreams.seed_global` seeds every round
GLOBAL = "global"


class RandomStreams:
    """Named, independent random streams derived from one master seed.

    Dropout layers draw from torch's process-wide default generator, which no stream
    owns: :meth:`seed_global` seeds it at the start of each round from the master seed
    and the round, so it needs no state in a checkpoint: a resumed run, and every rank
    of a launched one, draw in a round what an uninterrupted run draws."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._np: dict[str, np.random.Generator] = {}
        self._torch: dict[str, torch.Generator] = {}

    def numpy(self, name: str) -> np.random.Generator:
        if name not in self._np:
            self._np[name] = np.random.default_rng(derive_seed(self.seed, name))
        return self._np[name]

    def torch(self, name: str) -> torch.Generator:
        if name not in self._torch:
            g = torch.Generator()
            g.manual_seed(derive_seed(self.seed, name))
            self._torch[name] = g
        return self._torch[name]

    def seed_global(self, t: int) -> None:
        """Seed torch's default generators (CPU and every CUDA device) for round ``t``
        from the master seed (stream ``global/t``): what the round draws from them does
        not depend on earlier rounds, nor on what this process drew before."""
        torch.manual_seed(derive_seed(self.seed, f"{GLOBAL}/{int(t)}"))

    def state(self) -> dict:
        """Everything needed to continue every stream exactly (for checkpoints)."""
        gens = {k: g.get_state() for k, g in self._torch.items()}
        return {
            "seed": self.seed,
            "numpy": {k: g.bit_generator.state for k, g in self._np.items()},
            "torch": gens,
        }

    def load_state(self, state: dict) -> None:
        self.seed = int(state["seed"])
        for k, s in state["numpy"].items():
            self.numpy(k).bit_generator.state = s
        for k, s in state["torch"].items():
            if k != GLOBAL and not k.startswith(f"{GLOBAL}_cuda"):   # (earlier versions
                self.torch(k).set_state(s)          # saved torch's default generators)
