"""Shared test helpers: small configs on scikit-learn's digits (real data, no files), and
floating-point bounds derived from the arithmetic (:func:`float_tolerance`)."""

import dataclasses
import math

import torch

from splitfed.config import build_config


def digits_config(**over):
    """A tiny digits run; ``section__field=value`` sets one field, ``section=...`` a whole
    section."""
    raw = {"name": "t", "rounds": 2, "progress": False, "seed": 3,
           "algorithm": {"name": "fedavg"},
           "data": {"name": "digits"},
           "partition": {"scheme": "iid", "num_clients": 3},
           "model": {"name": "mlp", "hidden": [32]},
           "train": {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.1},
           "participation": {"mode": "full"}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[section] = value
    return build_config(raw)


# -- floating-point tolerances derived from the arithmetic ---------------------------------

def float_tolerance(ref32, ref64, *, dtype=None, magnitude=None, terms=1, factor=8.0):
    """The largest deviation from ``ref64`` that a result of ``dtype`` may show.

    The rule. Two float32 computations of the same quantity (another kernel set, another
    order of a reduction, a batched instead of a per-sample kernel) differ by rounding
    error, and how large that error is depends on the conditioning of the problem, not on
    a constant. The reference is therefore computed twice, in float32 (``ref32``) and in
    float64 (``ref64``) from the same float32-representable inputs; ``max|ref32 - ref64|``
    is the float32 reference's own error, i.e. this problem's conditioning in units of
    float32 epsilon. The tested result, computed differently in the same precision, may
    deviate from ``ref64`` by

        factor * (max|ref32 - ref64| + eps32 * sqrt(terms) * magnitude)   (float32 results)

    ``factor`` (default 8) covers another kernel's rounding being a few times larger than
    the reference's. The floor covers a reference that happens to round better than the
    tested kernel (a blocked or pairwise sum against a sequential one): ``magnitude``
    (default ``max|ref64|``) is the size of the quantities, ``terms`` the length of the
    reductions that produce the result (rounding errors of an n-term sum grow like
    sqrt(n) times eps; e.g. a weight gradient sums over the batch and spatial positions).
    For a result of another ``dtype`` the same conditioning is scaled by that dtype's
    epsilon: a float64 result may deviate by
    ``factor * eps64 * (max|ref32 - ref64| / eps32 + sqrt(terms) * magnitude)``.

    A real bug (a wrong client's parameters, a missing term) moves a result by an amount
    of the order of ``magnitude``, far beyond this bound, so the bound still fails on it.
    For a float32 result the bound is only as good as the two references: they must agree
    to ``1e-3 * magnitude`` (thousands of float32 epsilons), else the float32 reference is
    not the float64 one rounded (a test bug, e.g. inputs shared and modified in place) or
    the problem is too ill-conditioned to compare in float32 (rounding moves activations
    across ReLU kinks), and the helper fails rather than pass anything. A float64 result
    needs no such check: its bound, scaled by eps64 / eps32 ~ 2e-9, stays tight.
    Comparisons of the same computation run twice are not tolerance tests: they stay
    exact (``torch.equal``).
    """
    ref64, ref32 = _finite_pair(ref32, ref64)
    eps32 = torch.finfo(torch.float32).eps
    eps = torch.finfo(dtype or torch.float32).eps
    if magnitude is None:
        magnitude = ref64.abs().max().item() if ref64.numel() else 0.0
    ref_err = (ref32 - ref64).abs().max().item() if ref64.numel() else 0.0
    if eps >= eps32:  # a float32 result: the references must agree (see above)
        assert not ref_err > 1e-3 * magnitude, (
            f"the float32 reference is off its float64 twin by {ref_err:.3g} (magnitude "
            f"{magnitude:.3g}): not the same computation, or too ill-conditioned for float32")
    return factor * eps * (ref_err / eps32 + math.sqrt(terms) * magnitude)


def assert_float_close(got, ref32, ref64, *, magnitude=None, terms=1, factor=8.0, what=""):
    """``got`` (float32 or float64) equals the reference within :func:`float_tolerance`:
    ``max|got - ref64|`` is compared with the bound derived from ``max|ref32 - ref64|``.
    Where ``ref64`` is not finite, ``got`` must be the same infinity (or NaN)."""
    assert got.shape == ref64.shape, (what, tuple(got.shape), tuple(ref64.shape))
    got64 = got.detach().to(torch.float64)
    want = ref64.detach().to(torch.float64)
    bad = ~torch.isfinite(want)
    assert torch.equal(got64[bad].nan_to_num(), want[bad].nan_to_num()) and torch.equal(
        got64[bad].isnan(), want[bad].isnan()), f"{what}: non-finite values differ"
    bound = float_tolerance(ref32, ref64, dtype=got.dtype, magnitude=magnitude, terms=terms,
                            factor=factor)
    dev = (got64[~bad] - want[~bad]).abs().max().item() if (~bad).any() else 0.0
    want, ref32 = _finite_pair(ref32, ref64)
    ref_err = (ref32 - want).abs().max().item() if want.numel() else 0.0
    assert dev <= bound, (f"{what}: max|got - ref64| = {dev:.3g} > bound {bound:.3g} "
                          f"(float32 reference error {ref_err:.3g}, dtype {got.dtype})")


def bounds_away(other, ref32, ref64, *, terms=1):
    """How many bounds of :func:`float_tolerance` the dict of tensors ``other`` lies from
    the float64 reference ``ref64``, at its farthest entry: an alternative a test must
    tell apart (a missing term, another algorithm) lies many bounds away (say > 100), far
    beyond rounding."""
    return max((other[k].detach().double() - ref64[k]).abs().max().item()
               / float_tolerance(ref32[k], ref64[k], terms=terms) for k in ref64)


def _finite_pair(ref32, ref64):
    """Both references in float64, on the entries where ``ref64`` is finite."""
    ref64 = ref64.detach().to(torch.float64)
    keep = torch.isfinite(ref64)
    return ref64[keep], ref32.detach().to(torch.float64)[keep]


def reference_local_sgd(model, x, y, plan, lr):
    """A copy of ``model`` trained by plain ``torch.optim.SGD`` on the batches of ``plan``
    (rows of ``x``, ``y``); its state dict: the per-client loop the executor replaces."""
    import copy

    import torch.nn.functional as F

    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for rows in plan:
        opt.zero_grad()
        F.cross_entropy(m(x[rows]), y[rows]).backward()
        opt.step()
    return m.state_dict()


def assert_clients_match_loop(got, model, x, y, plans, lr, name=""):
    """Each client's trained state ``got[slot]`` (on the CPU) equals the per-client loop
    (:func:`reference_local_sgd` on ``plans[slot]``) within :func:`float_tolerance` of
    its float32 and float64 runs; integer buffers exactly."""
    import copy

    model32, model64 = copy.deepcopy(model).float(), copy.deepcopy(model).double()
    for s in range(len(plans)):
        plan = torch.from_numpy(plans[s])
        want32 = reference_local_sgd(model32, x.float(), y, plan, lr)
        want64 = reference_local_sgd(model64, x.double(), y, plan, lr)
        for k, v in want64.items():
            if not v.is_floating_point():
                assert torch.equal(got[s][k], v), (name, s, k)
                continue
            # weight gradients sum over the batch and the input positions
            assert_float_close(got[s][k], want32[k], v, terms=4 * x[0].numel(),
                               what=f"{name} client {s} {k}")


def interrupt_round(monkeypatch, name: str, stop: int) -> None:
    """Ctrl-C in the middle of round ``stop`` of the next run of algorithm ``name``."""
    from splitfed.algorithms import get_algorithm

    cls = get_algorithm(name)
    original = cls.round

    def round_(self, env, state, t, cohort):
        if t == stop:
            raise KeyboardInterrupt
        return original(self, env, state, t, cohort)

    monkeypatch.setattr(cls, "round", round_)


def assert_same_run(a, b):
    """Two run results (``run_experiment``) with bit-identical models and the same
    records, apart from the wall-clock ``round_time_s`` (centralized training keeps a
    module instead of a model state)."""
    def model(result):
        state = result.state
        return state["model"] if "model" in state else state["module"].state_dict()
    ma, mb = model(a), model(b)
    assert ma.keys() == mb.keys()
    for k, v in ma.items():
        assert torch.equal(mb[k], v), k

    def strip(records):
        return [{k: v for k, v in r.items() if k != "round_time_s"} for r in records]
    assert strip(a.records) == strip(b.records)


def bn_mlp():
    """A small split MLP for digits with BatchNorm buffers (running statistics and the
    integer counter), cut after its first block; seeded."""
    from collections import OrderedDict

    from splitfed.models import BlockModel

    torch.manual_seed(0)
    blocks = OrderedDict(
        fc1=torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16),
                                torch.nn.BatchNorm1d(16), torch.nn.ReLU()),
        out=torch.nn.Linear(16, 10))
    return BlockModel(blocks, name="bn_mlp", cut_descriptions={1: "after fc1"},
                      default_cut=1)


def register_images(monkeypatch, name: str) -> None:
    """Register data set ``name`` for this test: 96 training and 40 test 1x28x28 images
    whose top rows are exactly 0, as Fashion-MNIST's background (ties in every pooling
    window there), 10 classes; seeded."""
    from splitfed.data import DATASETS
    from splitfed.data.datasets import ArrayDataset, DataBundle

    g = torch.Generator().manual_seed(0)

    def make(n):
        x = torch.randn(n, 1, 28, 28, generator=g).clamp_min(0)
        x[:, :, :8] = 0.0
        return ArrayDataset(x, torch.randint(0, 10, (n,), generator=g))

    bundle = DataBundle(name=name, train=make(96), test=make(40), num_classes=10,
                        input_shape=(1, 28, 28))
    monkeypatch.setitem(DATASETS, name, lambda data_dir, rng: bundle)


def dry_run(tmp_path, capsys, overrides):
    """``splitfed run quick_digits overrides --dry-run``: (exit status, stderr); nothing
    may be written either way, and no traceback printed."""
    from splitfed.cli import main

    out = tmp_path / "runs"
    code = main(["run", "quick_digits", "progress=false", f"out_dir={out}", *overrides,
                 "--dry-run"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not out.exists()
    return code, err


@dataclasses.dataclass
class ModeOptions:
    """Options of a test plugin component that misbehaves in the given ``mode``."""

    mode: str = "ok"


def plugin_run(**changes):
    """A 2-round in-memory run of the conformance checks' config (``splitfed.testing.
    base_config``), each given section updated (a section the config lacks is added)."""
    from splitfed.experiment import run_experiment
    from splitfed.testing import base_config

    raw = base_config()
    raw.update(rounds=2)
    for key, value in changes.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return run_experiment(build_config(raw), write=False)


def copy_run(src, dst):
    """A copy of run directory ``src`` (its files) at ``dst``, created; returns ``dst``."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst
