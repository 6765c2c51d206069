"""Time to verdict as the user's clock reads it (issue 29): the default matrix's wall against one scratch + TRL pair's,
measured side by side in one run, with where the matrix's wall goes.

    python tools/verdict_bench.py [--spec harness/specs/default.toml] [-n 1]

Runs, one after the other in fresh processes (as a user runs them): `python -m harness --help`, `harness run
scratch` and `harness run trl` on the spec (one pair), then `harness parity --spec SPEC` (the default matrix and its
report). The parity run's output is read line by line as it comes, so the table also says when the first cell
started, when the verdict was printed and when the report was written. With -n > 1 each is repeated and the median
kept. Figures go to docs/benchmarks.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from explain_bench import timed  # noqa: E402 - one wall-clock runner for the bench tools


def parity_marks(cmd: list[str]) -> dict[str, float]:
    """The parity run's wall, and the seconds at which its first cell started, its verdict table was printed and
    its report written (from its output lines as they arrive)."""
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env=_unbuffered()) as proc:
        for line in proc.stdout:
            now = time.perf_counter() - t0
            if line.startswith("[cell 1/") and "first cell" not in marks:
                marks["first cell"] = now
            elif line.startswith("parity ") and "verdict" not in marks:
                marks["verdict"] = now
            elif line.startswith("report:"):
                marks["report"] = now
        rc = proc.wait()
    if rc not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {rc}")
    marks["wall"] = time.perf_counter() - t0
    return marks


def _unbuffered() -> dict:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="harness/specs/default.toml")
    p.add_argument("-n", type=int, default=1, help="repeats (the median is kept)")
    args = p.parse_args()
    py = sys.executable
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for _ in range(args.n):
            runs.setdefault("help", []).append(timed([py, "-m", "harness", "--help"]))
            runs.setdefault("scratch", []).append(
                timed([py, "-m", "harness", "run", "scratch", "--spec", args.spec, "--out", str(tmp / "s")]))
            runs.setdefault("trl", []).append(
                timed([py, "-m", "harness", "run", "trl", "--spec", args.spec, "--out", str(tmp / "t")]))
            marks = parity_marks([py, "-m", "harness", "parity", "--spec", args.spec, "--out", str(tmp / "p"), "--force"])
            for k, v in marks.items():
                runs.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    pair = med["scratch"] + med["trl"]
    rows = [("python -m harness --help", f"{med['help']:.2f} s"),
            ("run scratch (wall)", f"{med['scratch']:.1f} s"), ("run trl (wall)", f"{med['trl']:.1f} s"),
            ("one pair (scratch + trl)", f"{pair:.1f} s"),
            ("parity, default matrix (wall)", f"{med['wall']:.1f} s = {med['wall'] / pair:.2f}x the pair"),
            ("  start to the first cell", f"{med.get('first cell', float('nan')):.1f} s"),
            ("  first cell to the verdict", f"{med.get('verdict', float('nan')) - med.get('first cell', 0):.1f} s"),
            ("  verdict to 'report:'", f"{med.get('report', float('nan')) - med.get('verdict', 0):.1f} s"),
            ("  'report:' to exit", f"{med['wall'] - med.get('report', med['wall']):.1f} s")]
    width = max(len(r[0]) for r in rows)
    print(f"{args.spec}, median of {args.n}")
    print("\n".join(f"{a:{width}s}  {b}" for a, b in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
