"""Running a peer simulator's benchmark script in its own interpreter (Flower, pfl): the
environment it gets, the probe that checks it can import its framework, and one run of
``python -m <script> --data <workload> --out <json>`` with its result read back."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peer_env(threads: int | None = None) -> dict:
    """This environment with the repository on PYTHONPATH (the scripts import
    ``benchmarks.*``) and, given ``threads``, OMP_NUM_THREADS defaulting to it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def probe(python: str, code: str, missing: str, threads: int | None = None
          ) -> tuple[str | None, str]:
    """(``python``, what ``code`` printed) when ``python -c code`` succeeds, else (None,
    why: the last line of its error and the ``missing`` advice)."""
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              env=peer_env(threads))
    except OSError as e:                   # no such interpreter, or not executable
        return None, f"cannot run {python} ({e.strerror or e}); {missing}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        return None, f"not importable by {python} ({last}); {missing}"
    return python, proc.stdout.strip()


def run_script(w, python: str, module: str, args: list[str], threads: int | None = None,
               tree_memory: bool = False) -> dict:
    """Save the workload ``w``, run ``python -m module --data ... --out ... *args`` from
    the repository root and read its JSON result. Returns ``{"result": ..., "wall_s":
    ...}`` (and ``peak_mb``, the summed RSS of the process tree, with ``tree_memory``),
    or ``{"error": "exit N: <last lines>"}``."""
    with tempfile.TemporaryDirectory(prefix="splitfed-bench-") as tmp:
        data, out = Path(tmp) / "workload.pt", Path(tmp) / "result.json"
        w.save(data)
        cmd = [python, "-m", module, "--data", str(data), "--out", str(out), *args]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=peer_env(threads), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        mem = TreeRss(proc.pid) if tree_memory else None
        output, _ = proc.communicate()
        peak = mem.stop() if mem is not None else None
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(output.strip().splitlines()[-3:])
            return {"error": f"exit {proc.returncode}: {tail}"}
        done = {"result": json.loads(out.read_text()), "wall_s": time.perf_counter() - t0}
    if peak is not None:
        done["peak_mb"] = peak
    return done


class TreeRss:
    """Peak of the summed RSS of a process and all its descendants, sampled."""

    def __init__(self, pid: int, every: float = 0.25):
        self.pid, self.every, self.peak_kb = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.every):
            self.peak_kb = max(self.peak_kb, _tree_rss_kb(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kb / 1024.0


def _tree_rss_kb(root: int) -> int:
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry)
        children.setdefault(int(fields.get("PPid", "0").strip()), []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total
