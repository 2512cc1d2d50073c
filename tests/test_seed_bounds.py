"""Seeds are bounded alike wherever they are given: a config's ``seed``, a study's
``seeds`` and ``splitfed sweep --seeds`` all take a signed 64-bit integer
(``MIN_SEED..MAX_SEED``, what a run's config.yaml and checkpoint keep). A seed beyond
that is refused with one ``splitfed: error:`` line naming the field and the range,
before anything is written; one at the bounds is accepted."""

from __future__ import annotations

import pytest

from splitfed.cli import main
from splitfed.config import MAX_SEED, MIN_SEED, build_config
from splitfed.errors import ConfigError
from splitfed.study import study_from_mapping
from splitfed.sweep import sweep_study

TOO_LARGE = 99999999999999999999999
OUT_OF_RANGE = [TOO_LARGE, MAX_SEED + 1, MIN_SEED - 1]
STUDY = """name: seeds
base: quick_digits
overrides: [rounds=1, progress=false]
grid: {{train.lr: [0.1, 0.2]}}
seeds: [{seeds}]
"""


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitfed: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_the_seed_key_uses_the_same_bounds():
    assert build_config({"seed": MAX_SEED}).seed == MAX_SEED
    assert build_config({"seed": MIN_SEED}).seed == MIN_SEED
    with pytest.raises(ConfigError, match=f"seed: must be <= {MAX_SEED}"):
        build_config({"seed": MAX_SEED + 1})


@pytest.mark.parametrize("seed", OUT_OF_RANGE)
def test_a_study_seed_out_of_range_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                         seed):
    study = tmp_path / "study.yaml"
    study.write_text(STUDY.format(seeds=f"0, {seed}"))
    out = tmp_path / "out"
    assert main(["study", str(study), "--out-dir", str(out)]) == 2
    line = one_error_line(capsys)
    assert "study.seeds[1]" in line and str(seed) in line, line
    assert f">= {MIN_SEED} and <= {MAX_SEED}" in line, line
    assert not out.exists()


def test_study_seeds_at_the_bounds_are_accepted(tmp_path):
    study = study_from_mapping({"name": "s", "base": "quick_digits", "overrides": ["rounds=1"],
                                "grid": {"train.lr": [0.1, 0.2]},
                                "seeds": [MIN_SEED, -1, MAX_SEED]}, out_dir=tmp_path / "out")
    assert sorted({r.config.seed for r in study.runs}) == [MIN_SEED, -1, MAX_SEED]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", OUT_OF_RANGE)
def test_a_sweep_seed_out_of_range_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                         seed):
    out = tmp_path / "out"
    code = main(["sweep", "quick_digits", "train.lr=0.1,0.2", "rounds=1",
                 "--seeds", f"0,{seed}", "--out-dir", str(out)])
    assert code == 2
    line = one_error_line(capsys)
    assert line == (f"splitfed: error: --seeds: seed {seed} is out of range; allowed: "
                    f"{MIN_SEED}..{MAX_SEED}")
    assert not out.exists()


def test_sweep_seeds_must_be_distinct_integers():
    with pytest.raises(ConfigError, match="--seeds: expected distinct seeds"):
        sweep_study("quick_digits", ["train.lr=0.1,0.2"], seeds=[1, 1])
    with pytest.raises(ConfigError, match="--seeds: expected integers"):
        sweep_study("quick_digits", ["train.lr=0.1,0.2"], seeds=[1.5])
    mapping = sweep_study("quick_digits", ["train.lr=0.1,0.2"], seeds=[MIN_SEED, MAX_SEED])
    assert mapping["seeds"] == [MIN_SEED, MAX_SEED]


def test_every_seed_of_the_range_has_its_own_streams():
    import numpy as np

    from splitfed.rng import _name_key, derive_seed

    for a, b in ((-1, MAX_SEED), (MIN_SEED, 0), (-5, 2**63 - 5)):
        assert derive_seed(a, "data") != derive_seed(b, "data"), (a, b)
    for seed in (0, 1, 12345, MAX_SEED):        # non-negative seeds: streams as before
        old = np.random.SeedSequence([seed & (2**63 - 1), _name_key("data")])
        assert derive_seed(seed, "data") == int(
            old.generate_state(1, dtype=np.uint64)[0] & np.uint64(2**63 - 1))
    assert all(0 <= derive_seed(s, "x") <= MAX_SEED for s in (MIN_SEED, -1, 0, MAX_SEED))


def test_a_seed_and_its_negation_have_their_own_streams():
    """A negative master seed enters as its two's complement, not as its magnitude: seeds
    -s and s (and so the runs of a study over both) draw different streams."""
    from splitfed.rng import derive_seed

    for s in (1, 5, 12345, MAX_SEED):
        for name in ("data", "partition", "init"):
            assert derive_seed(-s, name) != derive_seed(s, name), (s, name)
