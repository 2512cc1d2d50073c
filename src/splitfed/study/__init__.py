"""Studies: a set of configured runs, run once each, summarised in a table and plots.

A study file (YAML) names a base config, overrides applied to every run, and the runs:
an explicit list of labelled variants and/or a grid (cartesian product of key -> values);
with both, every explicit run is combined with every grid point. Each variant is repeated
for every seed. ``splitfed study STUDY.yaml`` (or :func:`run_study`) then

1. builds and validates every run's config before any run starts: the schema, then
   everything a run builds before it writes (data, partition, model and cut, sampler,
   algorithm checks), so a typo or an impossible value in the last run fails at once,
   naming the run, before anything is written;
2. runs each one with :func:`~splitfed.experiment.run_experiment` (in this process, or
   side by side in worker processes or on a Dask cluster: :mod:`~splitfed.study.parallel`)
   into the deterministic directory ``<study dir>/runs/<slug of label>-s<seed>/`` (the
   study directory is ``runs/studies/<name>/`` unless ``out_dir`` says otherwise); a
   directory that already holds a finished run of the identical config made by the same
   code (splitfed version and git commit, from its ``summary.json`` provenance) is
   reused (its metrics are reloaded), so an interrupted study resumes where it stopped;
   a finished run made by other code is stale: rerun, or kept and marked when asked; a
   run that fails does not stop the others;
3. holds an exclusive lock on the study directory (:mod:`splitfed.locking`) from the
   first write to the last: a second process on the same study is refused at once;
4. once every run has finished, writes ``results.md`` (a table: final and best test
   accuracy, rounds to a target accuracy, bytes up and down, wall time; mean +- sample
   std over seeds; a diverged run reads ``diverged at round N``; a provenance line),
   ``results.json`` (the same numbers, exact bytes, per-run curves and provenance) and
   ``accuracy_vs_<axis>.png``;
5. when asked, publishes the results (never the runs) to a results page directory such
   as ``docs/results`` (:func:`publish`).

The modules, one job each: :mod:`~splitfed.study.spec` (the file format and validation),
:mod:`~splitfed.study.reuse` (which run directories are reused),
:mod:`~splitfed.study.runner` (checking, locking, running),
:mod:`~splitfed.study.parallel` (runs side by side: worker processes, Dask),
:mod:`~splitfed.study.analysis` (the numbers of a run),
:mod:`~splitfed.study.report` (results.json, results.md, publishing) and
:mod:`~splitfed.study.plots`. The file format is described in ``docs/studies.md``.
"""

from splitfed.experiment import resume_experiment, run_experiment
from splitfed.metrics import read_records
from splitfed.study.spec import (
    DEFAULT_OUT_DIR,
    RunSpec,
    Study,
    StudyRun,
    StudySpec,
    Variant,
    load_study,
    lookup,
    preflight,
    slugify,
    study_from_mapping,
    value_text,
)
from splitfed.study.reuse import (
    FINISHED,
    RunDirState,
    code_version,
    compare_code,
    config_hash,
    config_identity,
    run_dir_state,
)
from splitfed.study.analysis import (
    curve,
    diverged_round,
    rounds_to_target,
    run_numbers,
    sim_time,
    summarize,
    time_to_target,
)
from splitfed.study.plots import write_plots
from splitfed.study.report import (
    markdown_table,
    provenance_line,
    provenance_summary,
    publish,
    recorded_provenance,
    results_markdown,
    results_summary,
    write_results,
)
from splitfed.study.parallel import PointResult, PointTask, run_point
from splitfed.study.runner import (
    PreparedStudy,
    RunOutcome,
    RunsFailed,
    StudyResult,
    check_runs,
    execute_study,
    open_study,
    run_study,
)

__all__ = [
    "DEFAULT_OUT_DIR", "FINISHED", "PointResult", "PointTask", "PreparedStudy",
    "RunDirState", "RunOutcome", "RunSpec", "RunsFailed", "Study", "StudyResult",
    "StudyRun", "StudySpec", "Variant", "check_runs", "code_version", "compare_code",
    "config_hash", "config_identity", "curve", "diverged_round", "execute_study",
    "load_study", "lookup", "markdown_table", "open_study", "preflight", "provenance_line",
    "provenance_summary", "publish", "read_records", "recorded_provenance",
    "results_markdown", "results_summary",
    "resume_experiment", "rounds_to_target", "run_dir_state", "run_experiment",
    "run_numbers", "run_point", "run_study", "sim_time", "slugify", "study_from_mapping",
    "summarize", "time_to_target", "value_text", "write_plots", "write_results",
]
