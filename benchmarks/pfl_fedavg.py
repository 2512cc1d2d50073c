"""FedAvg on Apple's pfl-research simulator (``pfl``), on the benchmark workload (optional
variant).

The simulation needs only ``torch``, ``numpy`` and ``pfl`` (not splitfed), so it can run
under another interpreter: ``python -m benchmarks.pfl_fedavg --data W.pt --rounds R --out
T.json`` with the repository root on ``PYTHONPATH``. ``W.pt`` is written by
:meth:`benchmarks.workload.Workload.save`: the samples, one index list per user of the
population and the cohort size.

It is written as pfl's own PyTorch benchmarks (``benchmarks/image_classification/
pytorch/train.py`` in pfl-research) and its FLAIR tutorial write a FedAvg run:

- the users' data as a ``FederatedDataset.from_slices`` of ``(x, y)`` tensors per user,
  drawn by ``get_user_sampler('random', ...)`` (uniform, with replacement);
- the LeNet-5 of :func:`benchmarks.flower_fedavg.lenet5` with ``loss`` and ``metrics``
  methods attached (pfl's ``image_classification_loss`` / ``_metrics``), wrapped in a
  ``PyTorchModel`` with ``local_optimizer_create=torch.optim.SGD`` and a central
  ``torch.optim.SGD`` at learning rate 1 (FedAvg);
- ``SimulatedBackend`` (one process, no Horovod or multi-worker set-up) with the
  ``WeightByDatapoints`` postprocessor, so the average is weighted by samples;
- ``FederatedAveraging().run`` with ``NNAlgorithmParams`` (cohort size, no validation
  cohort) and ``NNTrainHyperParams`` (local learning rate, one local epoch, local batch
  size), so each user runs ``len(user) / batch`` SGD steps.

A round (pfl's "central iteration") is timed by a callback, from one
``after_central_iteration`` to the next (the first from ``on_train_begin``); round 1 is
the warm-up. pfl evaluates every sampled user before and after local training in the
iterations where ``iteration % evaluation_frequency == 0``; with ``evaluation_frequency``
set to the number of rounds that is iteration 0 only, the warm-up, so no timed round
evaluates.

:func:`run_pfl` runs it from the benchmark (standard library and torch only, so
``benchmarks.bench`` can import this module without pfl installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.flower_fedavg import lenet5
from benchmarks.peers import probe, run_script
from benchmarks.procstat import vm_hwm_mb

NAME = "pfl_fedavg"
LABEL = "FedAvg, pfl-research simulator (pfl)"


# ---------------------------------------------------------------- the pfl side


def _loss(self, inputs, targets, eval=False):  # noqa: A002 (pfl's keyword)
    """pfl's ``image_classification_loss``: mean cross-entropy in train or eval mode."""
    self.eval() if eval else self.train()
    return F.cross_entropy(self(inputs), targets.long())


@torch.no_grad()
def _metrics(self, inputs, targets, eval=True):  # noqa: A002 (pfl's keyword)
    """pfl's ``image_classification_metrics``: summed loss and accuracy, weighted by
    the number of samples."""
    from pfl.metrics import Weighted

    self.eval() if eval else self.train()
    logits = self(inputs)
    n = len(inputs)
    correct = (logits.argmax(-1) == targets.long()).float().sum().item()
    loss = F.cross_entropy(logits, targets.long(), reduction="sum").item()
    return {"loss": Weighted(loss, n), "accuracy": Weighted(correct, n)}


def pfl_lenet5(seed: int) -> torch.nn.Module:
    """The benchmark's LeNet-5 (same initial weights as the Flower variant) with the
    ``loss`` and ``metrics`` methods a pfl ``PyTorchModel`` requires."""
    import types

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = lenet5()
    model.loss = types.MethodType(_loss, model)
    model.metrics = types.MethodType(_metrics, model)
    return model


def federated_dataset(w: dict):
    """One pfl user per part of the workload, sampled uniformly at random."""
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler

    users_to_data = [(w["x"][idx], w["y"][idx]) for idx in w["parts"]]
    user_sampler = get_user_sampler("random", range(len(users_to_data)))
    return FederatedDataset.from_slices(users_to_data, user_sampler)


def make_round_timer():
    """A pfl callback that records the wall time of every central iteration and the
    number of samples it trained (pfl reports the users and their mean number of data
    points)."""
    from pfl.callback.base import TrainingProcessCallback
    from pfl.metrics import Metrics

    class RoundTimer(TrainingProcessCallback):
        def __init__(self):
            self.round_s: list[float] = []
            self.datapoints: list[float] = []
            self._lap = time.perf_counter()

        def on_train_begin(self, *, model):
            self._lap = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            now = time.perf_counter()
            self.round_s.append(now - self._lap)
            self._lap = now
            reported = aggregate_metrics.to_simple_dict()
            self.datapoints.append(reported["Train population | number of devices"]
                                   * reported["Train population | number of data points"])
            return False, Metrics()

    return RoundTimer()


def simulate(w: dict, rounds: int, seed: int | None = None) -> dict:
    """``rounds`` central iterations of pfl's FedAvg on the workload ``w``; round times."""
    import numpy as np
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    seed = w["seed"] if seed is None else seed
    torch.random.manual_seed(seed)
    np.random.seed(seed)

    pytorch_model = pfl_lenet5(w["seed"])
    params = [p for p in pytorch_model.parameters() if p.requires_grad]
    model = PyTorchModel(model=pytorch_model, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(params, 1.0))
    backend = SimulatedBackend(training_data=federated_dataset(w), val_data=None,
                               postprocessors=[WeightByDatapoints()])
    cohort = int(w.get("clients", len(w["parts"])))
    algorithm_params = NNAlgorithmParams(central_num_iterations=rounds,
                                         evaluation_frequency=rounds,
                                         train_cohort_size=cohort, val_cohort_size=0)
    model_train_params = NNTrainHyperParams(local_learning_rate=float(w["lr"]),
                                            local_num_epochs=1,
                                            local_batch_size=int(w["batch"]))
    timer = make_round_timer()
    t0 = time.perf_counter()
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend,
                             model=model, model_train_params=model_train_params,
                             callbacks=[timer])
    return {"round_s": timer.round_s, "datapoints": timer.datapoints,
            "total_s": time.perf_counter() - t0, "cohort": cohort,
            "population": len(w["parts"])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the first is warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import pfl.version

    w = torch.load(args.data)
    result = simulate(w, args.rounds)
    result.update({"pfl": pfl.version.__version__, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "peak_mb": vm_hwm_mb(),
                   "samples_per_round": result["cohort"] * int(w["local_steps"])
                   * int(w["batch"])})
    with open(args.out, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- the benchmark side


def pfl_python(python: str, threads: int = 1) -> tuple[str | None, str]:
    """``python`` if it can import pfl and torch, else None; and a description."""
    found, said = probe(python, "import pfl.version, torch; print(pfl.version.__version__)",
                        "install it in its own environment (torch first, then "
                        "'pfl[pytorch]')", threads)
    if found is None:
        return None, f"pfl is {said}"
    return python, f"pfl {said} ({python})"


def run_pfl(w, python: str, repeats: int, log, threads: int | None = None) -> dict:
    """pfl's FedAvg on the workload ``w`` (a :class:`benchmarks.workload.Workload`) in a
    subprocess of ``python``: one warm-up round, then ``repeats`` timed rounds, run at
    ``threads`` torch threads (default: this process's). The result has the fields of
    the benchmark's rows (``label``, ``round_s``, ``median_round_s``, ``samples_per_s``)
    or ``skipped`` / ``error``."""
    threads = threads or torch.get_num_threads()
    ok, why = pfl_python(python, threads)
    if ok is None:
        log(f"  {NAME}: skipped: {why}")
        return {"label": LABEL, "skipped": why}
    done = run_script(w, python, "benchmarks.pfl_fedavg",
                      ["--rounds", str(repeats + 1), "--threads", str(threads)], threads)
    if "error" in done:
        return {"label": LABEL, "error": done["error"]}
    res = done["result"]
    rounds = res["round_s"]
    log(f"  {NAME}: {len(rounds)} rounds in {done['wall_s']:.1f} s "
        f"(warm-up {rounds[0]:.2f} s)")
    timed = rounds[1:]
    med = statistics.median(timed)
    return {"label": LABEL, "round_s": [round(t, 4) for t in timed],
            "median_round_s": round(med, 4),
            "samples_per_s": round(w.samples_per_round / med, 1),
            "warmup_s": round(rounds[0], 4), "peak_mb": res["peak_mb"], "pfl": res["pfl"],
            "threads": res["threads"], "population": res["population"],
            "cohort": res["cohort"], "trained_per_round": res["datapoints"][1:],
            "note": "separate process (single-process SimulatedBackend); round 1 "
                    "(warm-up, the only one pfl evaluates in) not timed"}


if __name__ == "__main__":
    main()
