"""What explaining a loop of yours costs, against one scratch + TRL pair, measured side by side in one run.

    python tools/explain_bench.py [--spec harness/specs/default.toml] [--flags "--beta 0.01 --adam-beta2 0.999"]

Runs, one after the other in fresh processes (as a user runs them): `harness run scratch` and `harness run trl` on
the spec (one pair), then `harness parity --loop "python examples/my_grpo.py FLAGS"` (the pair with your loop, then
the explanation search). Prints the walls, the search's own figures from verdict.json (runs, steps, seconds) and
the ratio of the search to the pair. Figures go to docs/benchmarks.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-800:]}")
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="harness/specs/default.toml")
    p.add_argument("--flags", default="--beta 0.01 --adam-beta2 0.999", help="examples/my_grpo.py's differences")
    p.add_argument("--set", action="append", default=[], help="spec overrides for every run, KEY=VALUE")
    args = p.parse_args()
    py = sys.executable
    sets = [a for s in args.set for a in ("--set", s)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        scratch = timed([py, "-m", "harness", "run", "scratch", "--spec", args.spec, "--out", str(tmp / "s"), *sets])
        trl = timed([py, "-m", "harness", "run", "trl", "--spec", args.spec, "--out", str(tmp / "t"), *sets])
        loop = timed([py, "-m", "harness", "parity", "--spec", args.spec, "--loop",
                      f"python examples/my_grpo.py {args.flags}", "--out", str(tmp / "p"), *sets])
        cell = json.loads((tmp / "p" / "verdict.json").read_text())["cells"][0]
    lead = (cell.get("attribution_detail") or [{}])[0]
    cost = lead.get("cost") or {}
    pair = scratch + trl
    rows = [("run scratch (wall)", f"{scratch:.1f} s"), ("run trl (wall)", f"{trl:.1f} s"),
            ("one pair (scratch + trl)", f"{pair:.1f} s"),
            (f"parity --loop '{args.flags}' (wall)", f"{loop:.1f} s = {loop / pair:.2f}x the pair"),
            ("  of which the explanation search", f"{cost.get('seconds', 0):.1f} s = {cost.get('seconds', 0) / pair:.2f}x "
             f"the pair ({cost.get('runs')} runs, {cost.get('steps')} steps)"),
            ("  its verdict", f"{lead.get('status')}: {lead.get('evidence', '')[:120]}")]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{a:{width}s}  {b}" for a, b in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
