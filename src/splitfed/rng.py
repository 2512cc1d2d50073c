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
    """A 63-bit seed for the stream ``name`` under master ``seed`` (stable across runs)."""
    ss = np.random.SeedSequence([int(seed) & (2**63 - 1), _name_key(name)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] & np.uint64(2**63 - 1))


#: the stream name of torch's process-wide default generator (dropout, and any code that
#: draws without a generator), once :meth:`RandomStreams.seed_global` has seeded it
GLOBAL = "global"


class RandomStreams:
    """Named, independent random streams derived from one master seed.

    Dropout layers draw from torch's process-wide default generator, which no stream
    owns: :meth:`seed_global` seeds it from the master seed (stream name ``global``)
    and from then on :meth:`state` carries it (and each CUDA device's), so a resumed
    run draws what the uninterrupted one would have."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._global = False
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

    @property
    def global_seeded(self) -> bool:
        """Whether torch's default generator is one of the streams (seeded or restored)."""
        return self._global

    def seed_global(self) -> None:
        """Seed torch's default generators (CPU and every CUDA device) from the master
        seed; :meth:`state` then carries them."""
        torch.manual_seed(derive_seed(self.seed, GLOBAL))
        self._global = True

    def state(self) -> dict:
        """Everything needed to continue every stream exactly (for checkpoints)."""
        gens = {k: g.get_state() for k, g in self._torch.items()}
        if self._global:
            gens[GLOBAL] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for i, s in enumerate(torch.cuda.get_rng_state_all()):
                    gens[f"{GLOBAL}_cuda{i}"] = s
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
            if k == GLOBAL:
                torch.set_rng_state(s)
                self._global = True
            elif k.startswith(f"{GLOBAL}_cuda"):
                i = int(k[len(GLOBAL) + 5:])
                if torch.cuda.is_available() and i < torch.cuda.device_count():
                    torch.cuda.set_rng_state(s, i)
            else:
                self.torch(k).set_state(s)
