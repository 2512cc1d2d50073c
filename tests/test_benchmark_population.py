"""The benchmark workload with a population larger than the cohort: every variant still
trains ``clients * K * batch`` samples per round (no timing assertions)."""

import importlib.util
import sys
import time

import numpy as np
import pytest
import torch

from benchmarks.pfl_fedavg import LABEL as PFL_LABEL
from benchmarks.pfl_fedavg import run_pfl
from benchmarks.variants import VARIANTS
from benchmarks.workload import Workload

POPULATION, CLIENTS, K, BATCH = 20, 5, 1, 8


@pytest.fixture(scope="module")
def workload():
    return Workload(CLIENTS, K, BATCH, population=POPULATION)


def test_population_workload_holds_every_user(workload, tmp_path):
    assert workload.samples_per_round == CLIENTS * K * BATCH
    assert len(workload.y) == len(workload.x) == POPULATION * K * BATCH
    assert len(workload.parts) == POPULATION
    assert all(len(p) == K * BATCH for p in workload.parts)
    assert sorted(np.concatenate(workload.parts).tolist()) == list(range(len(workload.y)))
    assert workload.describe()["population"] == POPULATION
    workload.save(tmp_path / "w.pt")
    saved = torch.load(tmp_path / "w.pt")
    assert saved["population"] == POPULATION and saved["clients"] == CLIENTS
    assert len(saved["parts"]) == POPULATION


def test_population_defaults_to_the_cohort():
    w = Workload(4, 2, BATCH)
    assert w.population == 4 and len(w.parts) == 4 and len(w.y) == w.samples_per_round
    with pytest.raises(ValueError):
        Workload(4, 1, BATCH, population=3)


@pytest.mark.parametrize("name", ["peer_loop", *(n for n in VARIANTS if n.startswith("splitfed"))])
def test_population_round_trains_one_cohort(workload, name):
    v = VARIANTS[name](workload)
    v.setup()
    v.round()
    t0 = time.perf_counter()
    v.round()
    elapsed = time.perf_counter() - t0
    assert v.samples == CLIENTS * K * BATCH
    assert workload.samples_per_round / elapsed > 0


def test_population_splitfed_samples_a_cohort_of_the_population(workload):
    v = VARIANTS["splitfed_fedavg"](workload)
    v.setup()
    assert v.env.num_clients == POPULATION
    cohort = v.env.sampler.sample(np.random.default_rng(0))
    assert len(set(cohort.ids.tolist())) == CLIENTS
    assert all(0 <= i < POPULATION for i in cohort.ids.tolist())


def test_population_peer_loop_draws_cohorts(workload):
    v = VARIANTS["peer_loop"](workload)
    v.setup()
    cohorts = [[p.tolist() for p in v.cohort()] for _ in range(3)]
    for c in cohorts:
        assert len(c) == CLIENTS and all(u in [p.tolist() for p in v.parts] for u in c)
    assert cohorts[0] != cohorts[1] or cohorts[1] != cohorts[2]


def test_run_pfl_runs_or_says_why(workload):
    """pfl lives in its own environment; without it the row is skipped with a reason."""
    res = run_pfl(workload, sys.executable, 1, lambda msg: None, threads=1)
    assert res["label"] == PFL_LABEL
    if importlib.util.find_spec("pfl") is None:
        assert "pfl" in res["skipped"]
    else:
        assert "error" not in res, res.get("error")
        assert res["samples_per_s"] > 0
        assert res["trained_per_round"] == [CLIENTS * K * BATCH]
