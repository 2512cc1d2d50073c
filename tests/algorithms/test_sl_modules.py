"""SL reuses its trainable client and server modules from round to round (a copy of the
global model is loaded into them in place): no round's result may share their tensors,
and a new environment gets modules of its own."""

import torch

from splitfed.experiment import build_algorithm, build_environment
from tests.helpers import digits_config


def _round(algo, env, state, t):
    env.ledger.round = t
    cohort = env.clock.begin_round(env.sampler.sample(env.streams.numpy("participation")))
    result = algo.round(env, state, t, cohort)
    env.clock.end_round()
    return result.state


def test_a_round_result_is_not_changed_by_the_next_round():
    cfg = digits_config(algorithm={"name": "sl"}, model={"name": "mlp", "hidden": [32, 16],
                                                         "cut": 1})
    env, algo = build_environment(cfg), build_algorithm(cfg)
    first = _round(algo, env, algo.init_state(env), 1)
    snapshot = {k: v.clone() for k, v in first["model"].items()}
    second = _round(algo, env, first, 2)
    for k, v in first["model"].items():
        assert torch.equal(v, snapshot[k]), k
        assert v.data_ptr() != second["model"][k].data_ptr()
    _, client, server = algo._modules(env, second["model"])
    module_ptrs = {t.data_ptr() for m in (client, server) for t in m.state_dict().values()}
    assert not module_ptrs & {t.data_ptr() for t in second["model"].values()}


def test_another_environment_gets_its_own_modules():
    cfg = digits_config(algorithm={"name": "sl"}, model={"name": "mlp", "hidden": [32, 16],
                                                         "cut": 1})
    algo = build_algorithm(cfg)
    env_a, env_b = build_environment(cfg), build_environment(cfg)
    _, client_a, _ = algo._modules(env_a, algo.init_state(env_a)["model"])
    _, client_b, _ = algo._modules(env_b, algo.init_state(env_b)["model"])
    assert client_a is not client_b
