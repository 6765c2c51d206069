"""Does the calibrated tolerance hold on this configuration? Matched pairs must stay at parity, small injected
differences must still be flagged. One lockstep pair per variant, with the noise twin; prints a table.

    python tools/noise_check.py --spec harness/specs/default.toml --set STEPS=200 --out runs/noise-check

Columns (/bound: the largest difference over the bound that decided, max(floor, k x envelope): above 1 is
outside): the verdict, the first flagged step and metric (and the first on a trained quantity: loss, gradient norm,
entropy, reward, weights, clipping), the largest ratio of the cross-implementation difference
to the noise envelope over the decisive metrics (a matched pair must stay below k), and the smallest weight
difference the run could have shown (k x the twin's relative L2 distance at the last step). Figures go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.diagnose.pairs import run_pair  # noqa: E402
from harness.diagnose.preflight import apply_alignment  # noqa: E402
from harness.experiment.spec import load_spec  # noqa: E402

DECISIVE = ("loss", "grad_norm", "entropy", "reward", "param_rel_l2", "clip_ratio/region_mean")


def variants(spec) -> list[tuple[str, dict, str]]:
    """(name, alignment, expected): the matched spec, the TRL learning rate x1.01, Adam's beta2 0.99 vs 0.991."""
    return [
        ("matched", {}, "parity"),
        ("lr x1.01", {"set_trl": {"learning_rate": spec.LR * 1.01}}, "diverged"),
        ("adam_beta2 0.99 vs 0.991", {"set": {"ADAM_BETA2": 0.99}, "set_trl": {"adam_beta2": 0.991}}, "diverged"),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/noise-check")
    p.add_argument("--only", help="comma-separated variant names")
    args = p.parse_args()
    spec = load_spec(args.spec, args.set)
    out = Path(args.out)
    rows = []
    for name, align, expected in variants(spec):
        if args.only and name not in args.only.split(","):
            continue
        s = apply_alignment(spec, {"set": align.get("set", {}), "set_trl": align.get("set_trl", {})})
        t0 = time.perf_counter()
        r = run_pair(s, out / name.replace(" ", "_"))
        wall = time.perf_counter() - t0
        ratios = {m: v.get("ratio_to_noise") for m, v in r["metrics"].items() if v.get("ratio_to_noise") is not None}
        top = max(((v, m) for m, v in ratios.items() if m in DECISIVE), default=(None, None))
        to_bound = max((v["ratio_to_bound"] for m, v in r["metrics"].items()
                        if m in DECISIVE and v.get("ratio_to_bound") is not None), default=None)
        p_m = r["metrics"].get("param_rel_l2", {})
        mde = p_m.get("noise_last", 0.0) * r["k_noise"] if p_m else None
        fd = r["first_divergence"]
        trained = [(v["first_outside"], m) for m, v in r["metrics"].items() if m in DECISIVE and v.get("first_outside")]
        rows.append({"variant": name, "expected": expected, "verdict": "parity" if fd is None else "diverged",
                     "first": fd, "first_trained": min(trained) if trained else None,
                     "max_ratio": top[0], "max_ratio_metric": top[1], "max_to_bound": to_bound,
                     "weights_rel_l2": p_m.get("max_abs"), "min_detectable_weights": mde, "wall_s": round(wall, 1)})
        print(_line(rows[-1]), flush=True)
    (out / "noise_check.json").write_text(json.dumps({"spec": args.spec, "set": args.set, "rows": rows}, indent=2))
    print(f"\n{'variant':28s} {'expected':9s} {'verdict':9s} {'first flagged':28s} {'first on training':24s} "
          f"{'max diff/noise':>22s} {'/bound':>7s} "
          f"{'weights':>9s} {'detectable':>10s} {'wall s':>7s}")
    for row in rows:
        print(_line(row))
    return 0 if all(r["verdict"] == r["expected"] for r in rows) else 1


def _line(r: dict) -> str:
    first = f"step {r['first']['step']} {r['first']['metric']}" if r["first"] else "-"
    trained = f"step {r['first_trained'][0]} {r['first_trained'][1]}" if r.get("first_trained") else "-"
    ratio = f"{r['max_ratio']:.2f} ({r['max_ratio_metric']})" if r["max_ratio"] is not None else "-"
    fmt = lambda v: "-" if v is None else f"{v:.2g}"  # noqa: E731
    return (f"{r['variant']:28s} {r['expected']:9s} {r['verdict']:9s} {first:28s} {trained:24s} {ratio:>22s} "
            f"{fmt(r.get('max_to_bound')):>7s} "
            f"{fmt(r['weights_rel_l2']):>9s} {fmt(r['min_detectable_weights']):>10s} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
