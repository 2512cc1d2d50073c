"""studies/paper001/image_report.py: the tables that docs/results/paper001.md quotes, from
run directories written here by hand."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "studies" / "paper001" / "image_report.py"


def report():
    spec = importlib.util.spec_from_file_location("paper001_image_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(root: Path, name: str, accs, *, diverged_at=None):
    """A run directory evaluated every 100 rounds (1.5 simulated s a round); a diverged
    one ends with a non-finite training loss at round ``diverged_at``."""
    d = root / "runs" / name
    d.mkdir(parents=True)
    lines = [{"round": 100 * i, "sim_time_s": 150.0 * i, "test_acc": a, "test_loss": 2.0 - a}
             for i, a in enumerate(accs)]
    if diverged_at:
        lines.append({"round": diverged_at, "sim_time_s": 1.5 * diverged_at,
                      "train_loss": float("nan")})
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    status = "diverged" if diverged_at else "completed"
    (d / "summary.json").write_text(json.dumps({
        "status": status, "rounds": 100 * (len(accs) - 1), "diverged_round": diverged_at}))


def test_labels_as_the_docs_write_them():
    r = report()
    assert r.pretty("mu-splitfed-tau-4-eta_s-tau") == "MU-SplitFed tau = 4, eta_s / tau"
    assert r.pretty("tau-4-eta_s-tau") == "tau = 4, eta_s / tau"
    assert r.pretty("vanilla-tau-1") == "vanilla (tau = 1)"
    assert r.pretty("mu-splitfed-model.cut-2-algorithm.tau-4") == "MU-SplitFed Lc = 2, tau = 4"


def test_table_per_label_over_seeds(tmp_path):
    r = report()
    r.RESULTS = tmp_path
    study = tmp_path / "paper001_table1_scaled"
    write_run(study, "gas-s0", [0.1, 0.4, 0.6])
    write_run(study, "gas-s1", [0.1, 0.5, 0.7])
    write_run(study, "mu-splitfed-tau-4-s0", [0.1, 0.45], diverged_at=150)
    (study / "runs" / "vanilla-tau-1-s0").mkdir()          # unfinished: no summary.json
    rows = r.table("paper001_table1_scaled",
                   ["gas", "vanilla-tau-1", "mu-splitfed-tau-4"]).splitlines()[2:]
    assert len(rows) == 2
    gas = rows[0].split(" | ")
    assert gas[0] == "| GAS" and gas[1] == "0,1"
    assert gas[2] == "0.650 (0.600, 0.700)"                  # final accuracy
    assert gas[5] == "150 (200, 100)"                        # first round at >= 0.5
    assert gas[6] == "225 (300, 150)"                        # its simulated seconds
    tau4 = rows[1].split(" | ")
    assert tau4[0] == "| MU-SplitFed tau = 4" and tau4[5] == "-"
    assert tau4[-1] == "seed 0: 150 |"
