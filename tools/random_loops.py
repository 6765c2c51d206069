"""Random GRPO loops through the harness's explanation, scored against their answers (tests/random_loops).

    python tools/random_loops.py --seeds 0-199 --jobs 1 --out runs/random-loops

Resumable: a seed already in OUT/results.jsonl is not run again. Prints each seed's result with progress and ETA,
appends to results.jsonl, and rewrites OUT/summary.md (right / wrong, the misses by kind, a table over the seeds)
after every seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.random_loops.score import rescore, score_seed, verify_answer  # noqa: E402


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def load(path: Path) -> dict[int, dict]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["seed"]: row for row in rows}


def summary(rows: list[dict]) -> str:
    right = sum(r["right"] for r in rows)
    kinds, first = Counter(), Counter()
    for r in rows:
        kinds.update({m.split(":")[0] for m in r["misses"]})
        first.update(r["misses"])
    lines = [f"# Random loops: {right} of {len(rows)} right ({100 * right / max(len(rows), 1):.1f}%)", "",
             "| miss kind | loops |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in kinds.most_common()]
    lines += ["", "| miss | loops |", "|---|---|"] + [f"| {k} | {n} |" for k, n in first.most_common()]
    lines += ["", "| seed | right | differences | verdict | status | misses | wall s |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["seed"]):
        lines.append(f"| {r['seed']} | {'yes' if r['right'] else 'no'} | {', '.join(r['differences'])} | "
                     f"{r['verdict']} | {r['status']} | {'; '.join(r['misses'])} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def verify(seeds: list[int], out: Path) -> int:
    path = out / "verify.jsonl"
    done = load(path)
    for k, seed in enumerate([s for s in seeds if s not in done], 1):
        row = verify_answer(seed, out)
        with path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        done[seed] = row
        said = {None: "not checkable (a selection or an inexpressible choice)", True: "reproduces the loop",
                False: "does NOT reproduce the loop"}[row["verified"]]
        print(f"[{k}] seed {seed}: the answer {said}", flush=True)
    rows = [r for r in done.values() if r["verified"] is not None]
    print(f"answers checked: {sum(r['verified'] for r in rows)} of {len(rows)} reproduce their loop at parity")
    return 0 if all(r["verified"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-2", help="e.g. 0-199 or 0,5,9-12")
    ap.add_argument("--jobs", type=int, default=1, help="explanations run at once")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--verify", action="store_true", help="check the answers instead: the built-in loop set up as "
                    "each answer says against its loop, parity expected (OUT/verify.jsonl)")
    ap.add_argument("--rescore", action="store_true", help="score OUT's finished seeds again from their run folders")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.verify:
        return verify(parse_seeds(args.seeds), args.out)
    if args.rescore:  # the scorer changed: score the finished runs again, nothing re-run
        rows = [rescore(row, args.out) for row in load(args.out / "results.jsonl").values()]
        (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (args.out / "summary.md").write_text(summary(rows))
        print(summary(rows))
        return 0
    results = args.out / "results.jsonl"
    done = load(results)
    todo = [s for s in parse_seeds(args.seeds) if s not in done]
    print(f"{len(done)} seeds done before, {len(todo)} to run", flush=True)
    t0, walls = time.time(), []
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = {pool.submit(score_seed, s, args.out): s for s in todo}
        for k, fut in enumerate(as_completed(futures), 1):
            row = fut.result()
            with results.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            done[row["seed"]] = row
            walls.append(row["wall_s"])
            eta = (time.time() - t0) / k * (len(todo) - k)
            print(f"[{k}/{len(todo)}] seed {row['seed']}: {'right' if row['right'] else 'WRONG'} "
                  f"{'; '.join(row['misses'])} ({row['wall_s']} s; ETA {eta / 60:.1f} min)", flush=True)
            (args.out / "summary.md").write_text(summary(list(done.values())))
    rows = list(done.values())
    (args.out / "summary.md").write_text(summary(rows))
    print(summary(rows).split("\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
