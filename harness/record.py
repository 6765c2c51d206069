"""Golden references, as TRL's tests/invariant keeps them: `python -m harness record --spec FILE --out REF`.

A reference is a lockstep pair (both loops' metric logs and the shared rollouts) plus `reference.json`
with the resolved spec, library versions, device and git commit. Recording refuses to overwrite
without `--force` and refuses a dirty tree without `--allow-dirty`, so a reference always names the
code that made it. `check_against_reference` replays the recorded rollouts into fresh runs of both
loops and compares each with its reference, explaining version differences when they fail.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from harness.runlog.atomic import atomic_write_text

REFERENCE_FILE = "reference.json"


class RecordError(ValueError):
    pass


def _dirty() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []


def record(spec, spec_path: str, out: str | Path, force: bool = False, allow_dirty: bool = False, log=print) -> Path:
    from harness.diagnose.pairs import run_pair
    from harness.runlog.log import device_description, git_commit, library_versions

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise RecordError(f"{out} already holds a reference; pass --force to overwrite it")
    dirty = _dirty()
    if dirty and not allow_dirty:
        raise RecordError(f"the work tree has uncommitted changes ({dirty[0].strip()}, ...): commit them so the "
                          "reference names the code that made it, or pass --allow-dirty")
    if out.exists():
        shutil.rmtree(out)
    log(f"recording a lockstep reference of {spec_path} ({spec.STEPS} steps) into {out}")
    result = run_pair(spec, out, "lockstep")
    from harness.experiment.models import resolve_device

    meta = {"spec_path": spec_path, "spec": spec.to_dict(), "versions": library_versions(),
            "device": device_description(resolve_device(spec)), "git_commit": git_commit(),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": spec.STEPS,
            "lockstep_parity": result["first_divergence"] is None}
    atomic_write_text(out / REFERENCE_FILE, json.dumps(meta, indent=2) + "\n")
    for side in ("scratch", "trl"):  # a reference keeps logs, not weights sketches or TRL's output folder
        for extra in ("param_sketch.f32", "param_sketch.json", "trl_output"):
            p = out / side / extra
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return out


def version_differences(reference: dict) -> list[str]:
    from harness.runlog.log import library_versions

    now = library_versions()
    return [f"{k}: reference {v}, now {now.get(k)}" for k, v in reference.get("versions", {}).items()
            if now.get(k) != v]


def check_against_reference(ref_dir: str | Path, work_dir: str | Path) -> None:
    """Replay the reference's rollouts into fresh runs of both loops; assert each matches its recorded log."""
    from harness.rollouts.lockstep import ROLLOUTS_FILE, ReplaySource
    from harness.pytest_plugin import MetricMismatch, assert_metrics_close
    from harness.experiment.spec import parse_spec
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    ref_dir, work_dir = Path(ref_dir), Path(work_dir)
    meta = json.loads((ref_dir / REFERENCE_FILE).read_text())
    spec = parse_spec(meta["spec"])
    records = ReplaySource.from_file(ref_dir / ROLLOUTS_FILE).records
    train_scratch(spec, work_dir / "scratch", rollout_source=ReplaySource(records), progress=False)
    train_trl(spec, work_dir / "trl", rollout_source=ReplaySource(records), progress=False, lockstep=True)
    problems = []
    for side in ("scratch", "trl"):
        try:
            assert_metrics_close(work_dir / side, ref_dir / side)
        except MetricMismatch as e:
            problems.append(f"[{side} vs its reference] {e}")
    if problems:
        diffs = version_differences(meta)
        why = ("library versions differ from the reference's: " + "; ".join(diffs)) if diffs else \
            "same library versions as the reference: the change is in this code (or the device)"
        raise MetricMismatch("\n".join(problems) + f"\n{why}\nreference recorded {meta['recorded_at']} at "
                             f"{meta['git_commit']} on {meta['device']}")
