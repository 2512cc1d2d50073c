"""What a study's runs gave (:class:`RunOutcome`) and the study's result
(:class:`StudyResult`): shared by the runner and the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitfed.study.spec import Study


@dataclass
class RunOutcome:
    """What one study run gave: its records (fresh or reloaded) and where they are."""

    label: str
    seed: int
    run_dir: Path
    status: str
    records: list[dict]
    wall_time_s: float
    skipped: bool
    provenance: dict | None = None   # summary.json's: the code and machine that made it
    stale: str | None = None         # a reused run made by other code (keep_stale):
    #                                  "recorded with ..., now ..."
    note: str | None = None          # how its code was compared, when only partly


@dataclass
class StudyResult:
    study: Study
    dir: Path
    outcomes: list[RunOutcome]
    table: str
    summary: dict  # the content of results.json

    @property
    def completed(self) -> bool:
        return all(o.status == "completed" for o in self.outcomes)
