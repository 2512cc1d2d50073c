"""studies/paper001/llm_report.py reads both formats of llm_tau_cut.py's results (the
curves alone, and the curves with each run's provenance) and says which code made them,
in a study table's provenance line."""

import importlib.util
import json
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[2] / "studies" / "paper001"


def report(results_dir):
    spec = importlib.util.spec_from_file_location("paper001_llm_report",
                                                  STUDIES / "llm_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RESULTS = results_dir
    return module


CURVES = {"1,2,0": [[0, 0.5], [5, 0.86], [10, 0.9]], "1,2,1": [[0, 0.5], [5, 0.6], [10, 0.87]]}


def test_the_first_format_reads_and_says_it_has_no_provenance(tmp_path):
    (tmp_path / "paper001_llm_tau_cut.json").write_text(json.dumps(CURVES))
    text = report(tmp_path).tau_cut_table(0.85, final=False, plot=False)
    assert ("Provenance: splitfed unknown, commit unknown, torch unknown, unknown threads, "
            "CPU unknown; 2 run(s) recorded no provenance.") in text
    assert "| 1 | 8 (5, 10) |" in text               # mean of rounds 5 and 10


def test_runs_with_provenance_name_their_code(tmp_path):
    made = {"splitfed": "0.1.0", "commit": "abc123", "source": "d1", "dirty": True,
            "torch": "2.13.0", "threads": 1, "cpu_capability": "AVX2"}
    (tmp_path / "paper001_llm_tau_cut.json").write_text(json.dumps(
        {"runs": CURVES, "provenance": {"1,2,0": made}}))
    text = report(tmp_path).tau_cut_table(0.85, final=False, plot=False)
    assert ("Provenance: splitfed 0.1.0, commit abc123 (uncommitted changes), source d1, "
            "torch 2.13.0, 1 threads, CPU AVX2; 1 run(s) recorded no provenance.") in text
    assert "| 1 | 8 (5, 10) |" in text
