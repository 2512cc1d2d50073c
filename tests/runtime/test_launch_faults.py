"""How ``splitfed launch`` ends: what a launch leaves in the temporary directory.

Real launches are bounded by timeouts.
"""

import os
import subprocess
import sys
from pathlib import Path

from splitfed.runtime import secure

HERE = Path(__file__).parent
LIMIT_S = 120


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != secure.SECRET_ENV}
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def test_a_torchrun_launch_leaves_nothing_in_the_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "splitfed", "launch", "quick_digits",
                           "--nproc", "2", "rounds=1", "progress=false",
                           "--run-dir", str(tmp_path / "run")],
                          env=_env(TMPDIR=str(tmp)), capture_output=True, text=True,
                          timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir()) == []
