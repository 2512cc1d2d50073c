"""SFL-V1 and SFL-V2 with ``algorithm.recipe: released_code`` in the multi-process runtime
give the simulator's parameters and bytes (as tests/runtime/test_distributed.py checks
for the default recipe)."""

from tests.runtime.test_distributed import _config, runtime_equals_simulator

TRAIN = {"batch_size": 8, "local_steps": 2, "local_epochs": None, "lr": 0.1,
         "momentum": 0.9, "weight_decay": 0.01}


def test_released_code_recipe_equals_the_simulator(tmp_path):
    cfgs = [_config(f"{name}_released", {"name": name, "recipe": "released_code"},
                    tmp_path, rounds=2, train=TRAIN) for name in ("sflv1", "sflv2")]
    runtime_equals_simulator(cfgs, tmp_path)
