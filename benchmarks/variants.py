"""The benchmark's variants: one object per way of training the workload.

A variant is built by ``VARIANTS[name](workload)``; ``setup()`` prepares it (outside the
timings) and ``round()`` runs one round of ``C * K * batch`` samples (what is timed).
Evaluation never runs.

- ``central_b32``: centralized SGD at batch 32, ``K * C`` steps (plain ``nn.Module`` and
  ``torch.optim.SGD``);
- ``central_big`` / ``central_big_cl``: centralized SGD at batch ``32 * C``, K steps, in
  NCHW / channels_last layout; the faster of the two is "the limit";
- ``peer_loop``: FedAvg written as most FL frameworks write it: a deep copy of the global
  model and a fresh ``torch.optim.SGD`` per client, ``zero_grad``/``backward``/``step``,
  then a weighted average of the clients' ``state_dict`` s;
- ``splitfed_*``: splitfed's algorithms, built from a config with ``build_environment``
  and ``build_algorithm`` exactly as ``splitfed run`` builds them; a round is
  ``algo.round(env, state, t, cohort)`` as in :func:`splitfed.engine.loop.run_rounds`
  (MU-SplitFed: K such rounds, one zeroth-order step each, :class:`SplitfedMU`).

With a population larger than the cohort (``Workload(population=P)``, P > C) a round
still trains ``C * K * batch`` samples: the centralized variants draw that many of the
``P * K * batch`` samples, the peer loop trains a random cohort of C of the P users,
and splitfed partitions the samples among P clients and samples C of them per round
(``participation.mode=uniform``). ``samples`` is what the last round trained.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benchmarks.workload import DATASET_NAME, Workload, register
from splitfed.config import build_config
from splitfed.experiment import build_algorithm, build_environment


class Variant:
    label = ""

    def __init__(self, w: Workload):
        self.w = w
        self.samples = 0

    def setup(self) -> None:
        pass

    def round(self) -> None:
        raise NotImplementedError


class CentralB32(Variant):
    label = "centralized, batch 32 (K*C steps)"

    def setup(self):
        self.model = self.w.model().train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.w.lr)
        self.gen = torch.Generator().manual_seed(self.w.seed)

    def batches(self, size):
        perm = torch.randperm(len(self.w.y), generator=self.gen)
        return perm[:self.w.samples_per_round].view(-1, size)

    def step(self, rows, channels_last=False):
        x = self.w.x[rows]
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), self.w.y[rows])
        loss.backward()
        self.opt.step()

    def round(self):
        self.samples = 0
        for rows in self.batches(self.w.batch):
            self.step(rows)
            self.samples += len(rows)


class CentralBig(CentralB32):
    label = "centralized, batch 32*C, NCHW (K steps)"
    channels_last = False

    def setup(self):
        super().setup()
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)

    def round(self):
        self.samples = 0
        for rows in self.batches(self.w.batch * self.w.clients):
            self.step(rows, self.channels_last)
            self.samples += len(rows)


class CentralBigCL(CentralBig):
    label = "centralized, batch 32*C, channels_last (K steps)"
    channels_last = True


class PeerLoop(Variant):
    label = "FedAvg, per-client loop (peer style)"

    def setup(self):
        self.model = self.w.model().train()
        self.gen = torch.Generator().manual_seed(self.w.seed)
        self.parts = [torch.from_numpy(p) for p in self.w.parts]

    def cohort(self) -> list[torch.Tensor]:
        """Every user when the population is the cohort, else C of them at random."""
        if self.w.population == self.w.clients:
            return self.parts
        chosen = torch.randperm(self.w.population, generator=self.gen)[:self.w.clients]
        return [self.parts[i] for i in chosen.tolist()]

    def round(self):
        w, states, sizes = self.w, [], []
        self.samples = 0
        for idx in self.cohort():
            local = copy.deepcopy(self.model)
            opt = torch.optim.SGD(local.parameters(), lr=w.lr)
            order = idx[torch.randperm(len(idx), generator=self.gen)]
            for k in range(w.local_steps):
                rows = order[k * w.batch:(k + 1) * w.batch]
                opt.zero_grad()
                loss = F.cross_entropy(local(w.x[rows]), w.y[rows])
                loss.backward()
                opt.step()
                self.samples += len(rows)
            states.append(local.state_dict())
            sizes.append(len(idx))
        total = float(sum(sizes))
        avg = {}
        for key, ref in self.model.state_dict().items():
            if ref.is_floating_point():
                avg[key] = sum(s[key] * (n / total) for s, n in zip(states, sizes))
            else:
                avg[key] = states[0][key]
        self.model.load_state_dict(avg)


class Splitfed(Variant):
    algorithm = ""

    def overrides(self) -> list[str]:
        w = self.w
        if w.population > w.clients:
            participation = ["participation.mode=uniform",
                             f"participation.clients_per_round={w.clients}"]
        else:
            participation = ["participation.mode=full"]
        return [f"algorithm.name={self.algorithm}", f"data.name={DATASET_NAME}",
                "partition.scheme=iid", f"partition.num_clients={w.population}",
                *participation, f"train.batch_size={w.batch}",
                f"train.local_steps={w.local_steps}", "train.local_epochs=null",
                f"train.lr={w.lr}", f"seed={w.seed}", "progress=false",
                f"model.name={w.model_name}", f"engine.device={w.device}",
                *(f"model.{k}={v}" for k, v in w.model_options.items())]

    def setup(self):
        register(self.w)
        cfg = build_config({}, self.overrides())
        self.env = build_environment(cfg)
        self.algo = build_algorithm(cfg)
        self.state = self.algo.init_state(self.env)
        self.t = 0

    def round(self):
        """One round as :func:`splitfed.engine.loop.run_rounds` runs it, minus evaluation
        and logging (the virtual clock, where the engine has one, is opened and closed)."""
        env = self.env
        self.t += 1
        env.ledger.round = self.t
        clock = getattr(env, "clock", None)
        cohort = env.sampler.sample(env.streams.numpy("participation"))
        if clock is not None:
            cohort = clock.begin_round(cohort)
        result = self.algo.round(env, self.state, self.t, cohort)
        self.state = result.state
        self.samples = result.samples
        if clock is not None:
            clock.end_round()


class SplitfedMU(Splitfed):
    """MU-SplitFed (paper 001) takes one zeroth-order step per client per round, so one
    benchmark round is K algorithm rounds: the same ``C * K * 32`` samples as the other
    variants. Its arithmetic differs: three client forwards and 2 tau + 2 server forwards
    per sample (tau = 2, Table 6), no backward pass."""

    algorithm = "musplitfed"
    label = "splitfed MU-SplitFed (ZO, tau 2; K rounds of 1 step)"

    def round(self):
        samples = 0
        for _ in range(self.w.local_steps):
            super().round()
            samples += self.samples
        self.samples = samples


def _splitfed(name: str, label: str) -> type[Splitfed]:
    return type(f"Splitfed_{name}", (Splitfed,), {"algorithm": name, "label": label})


VARIANTS: dict[str, type[Variant]] = {
    "central_b32": CentralB32,
    "central_big": CentralBig,
    "central_big_cl": CentralBigCL,
    "peer_loop": PeerLoop,
    "splitfed_fedavg": _splitfed("fedavg", "splitfed FedAvg"),
    "splitfed_sflv1": _splitfed("sflv1", "splitfed SFL-V1"),
    "splitfed_sflv2": _splitfed("sflv2", "splitfed SFL-V2"),
    "splitfed_sl": _splitfed("sl", "splitfed SL (sequential)"),
    "splitfed_musplitfed": SplitfedMU,
}
