"""The numbers of a run, from its metrics records (``metrics.jsonl``, read with
:func:`splitfed.metrics.read_records`): accuracies and the round it diverged at (by
:func:`splitfed.metrics.record_summary`, the one definition every command uses), rounds
and simulated time to a target, byte totals, the mean accuracy over the last rounds, the
curve the plots draw; and mean +- sample std over seeds."""

from __future__ import annotations

import statistics
from typing import Any

from splitfed import metrics


def _num(value: Any) -> float | None:
    """A finite number as a float; None for anything else (NaN, infinities, text)."""
    if not metrics.is_finite_number(value):
        return None
    return float(value)


def _before_divergence(records: list[dict]) -> list[dict]:
    """The records before the round the run diverged at (all when it did not), as for
    ``best_test_acc`` (:func:`splitfed.metrics.record_summary`)."""
    return metrics.before_divergence(records, metrics.diverged_round(records))


def rounds_to_target(records: list[dict], target: float) -> int | None:
    """The first round whose test accuracy is >= ``target``, among the rounds before a
    divergence; None if never reached."""
    for r in _before_divergence(records):
        acc = _num(r.get("test_acc"))
        if acc is not None and acc >= target:
            return int(r["round"])
    return None


def time_to_target(records: list[dict], target: float) -> float | None:
    """Simulated seconds (``sim_time_s``, cumulative) at the first evaluation whose test
    accuracy is >= ``target``, among the rounds before a divergence; None if never reached
    or not recorded."""
    for r in _before_divergence(records):
        acc = _num(r.get("test_acc"))
        if acc is not None and acc >= target:
            return 0.0 if r.get("round", 0) == 0 else _num(r.get("sim_time_s"))
    return None


def sim_time(records: list[dict]) -> float | None:
    """The run's simulated time in seconds: the last ``sim_time_s`` (cumulative, the
    virtual clock's, docs/clock.md) recorded; None when no record has one."""
    for r in reversed(records):
        value = _num(r.get("sim_time_s"))
        if value is not None:
            return value
    return None


def diverged_round(records: list[dict], status: str | None = None) -> int | None:
    """The round the run diverged at, None when it did not: the one definition of
    :func:`splitfed.metrics.record_summary` (the first round with a non-finite training
    loss, test loss or test accuracy; the last round of a run whose ``status`` says
    ``diverged`` when no record shows one)."""
    return metrics.record_summary(records, status)["diverged_round"]


def curve(records: list[dict], status: str | None = None) -> dict:
    """Evaluated rounds with test accuracy, cumulative bytes (up + down) and time. Given
    the run's ``status``: of a run that diverged (that status, or a non-finite record),
    the rounds before the divergence only (as ``splitfed plot`` draws it and the best
    accuracy counts them); without it, every evaluated round.

    Time sums ``sim_round_s`` (a round's simulated duration) when every training round
    records it, else the measured ``round_time_s``; it is kept to 12 significant digits
    (a fixed number of decimals turned nanosecond rounds into zeros).
    """
    rounds = [r for r in records if r.get("round", 0) > 0]
    sim = bool(rounds) and all(_num(r.get("sim_round_s")) is not None for r in rounds)
    time_key = "sim_round_s" if sim else "round_time_s"
    out: dict = {"round": [], "test_acc": [], "bytes": [], "time_s": [],
                 "time_kind": "simulated" if sim else "wall"}
    total_bytes, total_time = 0, 0.0
    kept = records if status is None else metrics.before_divergence(
        records, diverged_round(records, status))
    for r in kept:
        total_bytes += int(_num(r.get("bytes_up")) or 0) + int(_num(r.get("bytes_down")) or 0)
        total_time += _num(r.get(time_key)) or 0.0
        acc = _num(r.get("test_acc"))
        if acc is not None:
            out["round"].append(int(r["round"]))
            out["test_acc"].append(acc)
            out["bytes"].append(total_bytes)
            out["time_s"].append(float(f"{total_time:.12g}"))   # 12 significant digits
    return out


def run_numbers(records: list[dict], target: float | None,
                status: str | None = None) -> dict:
    """Final and best test accuracy, the round it diverged at, rounds (and simulated
    seconds) to target, total bytes by direction and kind, simulated time.

    Accuracies follow :func:`splitfed.metrics.record_summary`: a diverged run has no
    final accuracy (None here: JSON tables stay strict JSON; ``diverged_round`` says
    where it diverged) and its best is the best evaluated before it diverged."""
    summary = metrics.record_summary(records, status)
    totals: dict[str, int] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(("bytes_up", "bytes_down")) and _num(value) is not None:
                totals[key] = totals.get(key, 0) + int(value)
    final = summary["final_test_acc"]
    return {"final_test_acc": None if summary["diverged_round"] is not None else final,
            "best_test_acc": summary["best_test_acc"],
            "diverged_round": summary["diverged_round"],
            "rounds_to_target": None if target is None else rounds_to_target(records, target),
            "time_to_target_s": None if target is None else time_to_target(records, target),
            "rounds": max((int(r["round"]) for r in records), default=0),
            "bytes_up": totals.pop("bytes_up", 0), "bytes_down": totals.pop("bytes_down", 0),
            "bytes_by_kind": dict(sorted(totals.items())),
            "sim_time_s": sim_time(records)}


def last_rounds_accuracy(records: list[dict], last: int, rounds: int,
                         status: str | None = None) -> dict:
    """The mean test accuracy over the evaluated rounds among the last ``last`` of the
    run's ``rounds`` (rounds max(1, rounds - last + 1) .. rounds; round 0, the initial
    model, never counts), as paper 003 Tables 7-9 report it (the last 100 of 1000 rounds).

    Returns ``{"mean": float | None, "evaluated": n, "window": w}``: ``n`` of the ``w``
    rounds of the window were evaluated (the config's ``eval_last`` >= ``last`` evaluates
    them all). ``mean`` is None for a run that diverged (it has no accuracy there) and
    when no round of the window was evaluated."""
    first = max(1, rounds - last + 1)
    window = max(0, rounds - first + 1)
    if metrics.record_summary(records, status)["diverged_round"] is not None:
        return {"mean": None, "evaluated": 0, "window": window}
    accs = [float(r["test_acc"]) for r in records
            if first <= r.get("round", 0) <= rounds and _num(r.get("test_acc")) is not None]
    return {"mean": statistics.fmean(accs) if accs else None, "evaluated": len(accs),
            "window": window}


def summarize(values: list[float | None]) -> dict:
    """Mean and sample standard deviation of the values that are not None."""
    got = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(got) if got else None,
            "std": statistics.stdev(got) if len(got) > 1 else (0.0 if got else None),
            "n": len(got), "values": list(values)}
