"""``--run-dir`` that cannot be created: the launcher refuses it in one line naming
``--run-dir`` (exit status 2) before any rank starts, and so does rank 0 when it cannot
create it after all; a long name is cut in the message as every error message cuts it."""

from pathlib import Path

import pytest

from splitfed.cli import main
from splitfed.errors import ConfigError
from splitfed.runtime import launch


def test_a_run_dir_that_cannot_be_created_is_refused_before_any_rank(capsys, no_ranks):
    code = main(["launch", "quick_digits", "--nproc", "2", "rounds=1", "--run-dir",
                 "/proc/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("splitfed: error: "), err
    assert "/proc/x" in err
    assert not Path("/proc/x").exists()


def test_rank_0_refuses_a_run_dir_it_cannot_create_in_one_line():
    from splitfed.runtime.session import make_run_dir

    with pytest.raises(ConfigError, match=r"^--run-dir: cannot create the run directory "
                                          r"/proc/x \(.+\); choose another --run-dir$"):
        make_run_dir(Path("/proc/x"))


def test_checking_a_run_dir_creates_nothing(tmp_path):
    run_dir = tmp_path / "a" / "b" / "run"
    launch.check_run_dir_creatable(run_dir)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="^--run-dir: cannot create the run directory"):
        launch.check_run_dir_creatable(tmp_path / "file" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_long_run_dir_is_cut_in_the_message(tmp_path, capsys, no_ranks):
    long = str(tmp_path / ("x" * 300))
    code = main(["launch", "quick_digits", "--nproc", "2", "rounds=1", "--run-dir", long])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert long not in err and f"({len(long)} characters)" in err, err
    assert len(err) < 250, err
