"""What a cell's attribution re-runs saw: for a matrix folder and a cell, the attribution entries, then per re-run
folder (aligned-*) its comparison again (first divergence, the metrics nearest to or beyond the calibrated bound,
notes), whether it replayed the cell's own recording, and what each side's manifest says it sampled with.
Written for issue 28 item 1 (a GPU `is=sequence_mask` cell called "unexplained").

    python tools/rerun_report.py /tmp/runs/qwen3 is=sequence_mask
"""

from __future__ import annotations

import filecmp
import json
import sys
from pathlib import Path


def main(matrix_dir: str, cell: str) -> int:
    from harness.diagnose import noise
    from harness.diagnose.compare import compare_runs

    root = Path(matrix_dir)
    doc = json.loads((root / "verdict.json").read_text())
    entry = next((c for c in doc["cells"] if c["name"] == cell), None)
    if entry is None:
        print(f"no cell {cell!r} in {root / 'verdict.json'}")
        return 2
    print(f"cell {cell}: {entry['verdict']} {entry.get('first_divergence')}; spec dtype {doc['base_spec'].get('DTYPE')}")
    for d in entry.get("attribution_detail", []):
        keep = {k: d.get(k) for k in ("status", "evidence", "rerun_first_divergence", "rerun_outside", "rerun_error")
                if d.get(k) is not None}
        print(f"  {d['cause']}: {json.dumps(keep, default=str)[:600]}")
        if d.get("tensor_diff") or d.get("tensor_diff_error"):  # the tensor walk (attribution._walk_tensors)
            print(f"  tensor walk: {json.dumps(d.get('tensor_diff'), default=str)[:1500]} "
                  f"{d.get('tensor_diff_error') or ''}")
            print(f"  evidence: {d.get('evidence', '')[-1200:]}")
    cell_dir = Path(entry["dir"]) if Path(entry["dir"]).exists() else root / Path(entry["dir"]).name
    for rerun in sorted(cell_dir.glob("aligned-*")):
        print(f"\nre-run {rerun.name}:")
        same = (rerun / "rollouts.jsonl").exists() and filecmp.cmp(rerun / "rollouts.jsonl",
                                                                   cell_dir / "rollouts.jsonl", shallow=False)
        print(f"  replays the cell's own recording: {same}; envelope: {(rerun / noise.NOISE_FILE).exists()}")
        for side in ("scratch", "trl"):
            m = rerun / side / "manifest.json"
            if m.exists():
                man = json.loads(m.read_text())
                trl = man.get("trl_config", {})
                print(f"  {side}: status {man.get('status')}, sampler {man.get('sampler')!r}, generation "
                      f"{man.get('generation')!r}, rollouts {man.get('rollouts')!r}"
                      + (f", IS {trl.get('vllm_importance_sampling_correction')}" if trl else
                         f", IS {man.get('spec', {}).get('IS_CORRECTION')}"))
        if not ((rerun / "scratch" / "metrics.jsonl").exists() and (rerun / "trl" / "metrics.jsonl").exists()):
            print("  (a side's metric log is missing: the re-run failed or was cut)")
            continue
        env = noise.load(rerun)
        r = compare_runs(rerun / "scratch", rerun / "trl", mode="lockstep", dtype=doc["base_spec"].get("DTYPE", "float32"),
                         envelope=env)
        print(f"  first divergence {r['first_divergence']}; outside {r['outside']}")
        ranked = sorted(r["metrics"].items(), key=lambda kv: -(kv[1].get("ratio_to_bound") or 0))
        for name, m in ranked[:10]:
            print(f"    {name}: max_abs {m.get('max_abs'):.3g} at step {m.get('step_max_abs')}, ratio to bound "
                  f"{m.get('ratio_to_bound')}, to noise {m.get('ratio_to_noise')}, first outside {m.get('first_outside')}")
        for note in r["notes"]:
            print(f"  note: {note[:300]}")
        for side in ("scratch", "trl"):
            rows = [json.loads(x) for x in (rerun / side / "metrics.jsonl").read_text().splitlines() if x.strip()]
            print(f"  {side} steps: " + "; ".join(f"{x['step']}: loss {x.get('loss'):.3g} gn {x.get('grad_norm'):.4g}"
                                                 for x in rows[:10]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
