"""The CUDA path (``engine.device=cuda``), on a machine with a GPU; skipped elsewhere.

- every registered algorithm passes the conformance checks of :mod:`splitfed.testing` with
  its data, models and batched executor on the GPU (it learns, is deterministic for a
  seed, respects participation, and its ledger equals the bytes moved);
- the algorithms without random draws that depend on the device or the dtype end two
  rounds on the GPU at the parameters of the same run on the CPU, within the float32
  bound of :func:`helpers.float_tolerance` (a CPU float32 and a CPU float64 run as the
  two references), and charge exactly the same bytes;
- the batched client executor (convolutions included) and evaluation's forward pass
  agree with plain float32 / float64 references on the CPU;
- a run stopped after a checkpoint and resumed on the GPU ends bit for bit where the
  uninterrupted run does.

TF32 (on by default for cuDNN convolutions on recent GPUs) is switched off here: with it a
convolution rounds its inputs to 10 mantissa bits and no float32 bound applies.
"""

import copy

import numpy as np
import pytest
import torch

from splitfed import experiment, testing
from splitfed.algorithms import ALGORITHMS
from splitfed.config import build_config
from splitfed.engine.evaluate import forward_eval
from splitfed.engine.executor import ClientExecutor
from splitfed.models import build_model

from helpers import assert_clients_match_loop, assert_float_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = {"engine": {"device": "cuda"}}
NAMES = sorted(ALGORITHMS)
#: not compared with a CPU run parameter by parameter: MU-SplitFed and GAS draw their
#: perturbation directions from generators whose streams depend on the device or the
#: dtype, CSE-FSL and FedLoRA build their auxiliary head and adapters from the default
#: dtype's random stream (so the float64 reference starts elsewhere), and ``centralized``
#: keeps a module rather than a state dict. The conformance checks still run them on the
#: GPU.
NOT_COMPARED = {"musplitfed", "gas", "csefsl", "fedlora", "centralized"}


@pytest.fixture(autouse=True)
def _full_float32():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("name", NAMES)
def test_conformance_on_cuda(name):
    from test_conformance import LEARN_OVERRIDES

    assert testing.check_algorithm(name, overrides=LEARN_OVERRIDES.get(name), base=CUDA)


def _run(raw, *, float64=False):
    """Two rounds of ``raw``; ``float64``: on the CPU with the data and the model (built in
    float32, so from the same random numbers) in float64 and float64 as the default dtype."""
    cfg = build_config(raw)
    if not float64:
        env, records, state, _ = testing._run(cfg)
        return records, state["model"]
    load = experiment.load_data

    def load64(cfg, streams, device):
        bundle = load(cfg, streams, device)
        for split in (bundle.train, bundle.test):
            split.x = split.x.double()
        return bundle

    build = experiment._build_model

    def build64(cfg, bundle, streams):          # built in float32, then in float64
        model, cut = build(cfg, bundle, streams)
        return model.double(), cut

    old = torch.get_default_dtype()
    try:
        experiment.load_data, experiment._build_model = load64, build64
        algorithm, env = testing._build(cfg)
        torch.set_default_dtype(torch.float64)
        _, records, state, _ = testing._run(cfg, env, algorithm)
    finally:
        torch.set_default_dtype(old)
        experiment.load_data, experiment._build_model = load, build
    return records, state["model"]


def _bytes(records):
    return [{k: v for k, v in r.items() if "bytes" in k} for r in records]


@pytest.mark.parametrize("name", [n for n in NAMES if n not in NOT_COMPARED])
def test_two_rounds_on_cuda_match_the_cpu_run(name):
    raw = testing.base_config(name)
    raw["rounds"] = 2
    rec32, ref32 = _run(raw)
    _, ref64 = _run(raw, float64=True)
    rec, got = _run(testing._merge(raw, CUDA))
    assert _bytes(rec) == _bytes(rec32)
    assert got.keys() == ref32.keys()
    batch, features = raw["train"]["batch_size"], 64          # digits: 8 x 8 inputs
    for k, v in got.items():
        assert v.device.type == "cuda", k
        if not v.is_floating_point():
            assert torch.equal(v.cpu(), ref32[k]), k
            continue
        # weight gradients sum over a batch and the inputs; 8 local steps, 2 rounds
        assert_float_close(v.cpu(), ref32[k], ref64[k], terms=batch * features * 16,
                           what=f"{name} {k}")


@pytest.mark.parametrize("name,shape", [("lenet5", (1, 28, 28)), ("mlp", (1, 8, 8))])
def test_executor_on_cuda_matches_cpu_references(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    n = 60
    x, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
    parts = [np.arange(0, 20), np.arange(20, 35), np.arange(35, 60)]
    ex = ClientExecutor(copy.deepcopy(model).cuda(), x.cuda(), y.cuda(), parts, batch_size=4,
                        chunk_size=2)
    ids, steps = np.array([2, 0, 1]), np.array([3, 5, 2])
    start = {k: v.cuda() for k, v in model.state_dict().items()}
    plans = ex.plans(ids, steps, np.random.default_rng(1))
    got = {}
    for r in ex.train(start, ids, steps, lr=0.05, rng=np.random.default_rng(1)):
        for j, s in enumerate(r.slots):
            got[int(s)] = {k: v[j].cpu() for k, v in r.state.items()}
    assert_clients_match_loop(got, model, x, y, plans, 0.05, name)


@pytest.mark.parametrize("name,shape,opts", [("lenet5", (1, 28, 28), {}),
                                             ("alexnet", (1, 28, 28), {"width": 0.0625}),
                                             ("resnet18", (3, 32, 32), {"width": 8})])
def test_evaluation_forward_on_cuda_matches_cpu_references(name, shape, opts):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **opts).eval()
    x = torch.randn(33, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = forward_eval(copy.deepcopy(model).cuda(), x.cuda()).cpu()
        ref32 = model(x)
        ref64 = copy.deepcopy(model).double()(x.double())
    assert_float_close(got, ref32, ref64, terms=x[0].numel(), what=name)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "sl", "sflv2", "gas", "musplitfed"])
def test_resume_on_cuda_is_bit_identical(tmp_path, monkeypatch, name):
    # the checkpoint is read onto the CPU; the state must go back to the GPU (the model,
    # the controls, the server optimizer, GAS's buffered activations) or stay on the CPU
    # (GAS's class statistics), and the run go on as if never stopped
    from helpers import digits_config
    from test_checkpoint import MOVING, SPLIT, check_resume

    over = {} if name in ("fedavg", "scaffold") else SPLIT
    cfg = digits_config(algorithm={"name": name}, rounds=6, checkpoint_every=2,
                        engine={"device": "cuda"}, **over, **MOVING)
    check_resume(tmp_path, monkeypatch, cfg, 3)
