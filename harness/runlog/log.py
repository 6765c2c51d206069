"""The metric log both loops write, its manifest, and the reader.

A run folder holds:
- `metrics.jsonl`: one JSON object per optimizer step, appended and flushed (and fsync'ed) when the
  step ends, so a killed run keeps every finished step. Metric names are TRL's where TRL has one;
  the harness adds `step`, `prompts_in_step`, `sequences_in_step`, `prompt_ids_hash`,
  `tokens_in_step`, `wall_s` (the step), `gen_s` (its generation), `harness_s` (the harness's own
  bookkeeping: weight sketch, completion samples, consumption records), `peak_mem_bytes`, `epoch`,
  `reward_errors`.
- `manifest.json`: the resolved spec, seeds, library versions, device, git commit and `status`
  (`running`, `finished`, `failed: <reason>`, `interrupted`), rewritten atomically.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

from harness.experiment.models import run_label
from harness.experiment.rewards import reward_provenance
from harness.runlog.atomic import atomic_write_text

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # a few completions per generation step, for reports
COMPLETIONS_PER_STEP = 4
MANIFEST_FILE = "manifest.json"
# differ run to run; ignored by determinism checks
TIMING_FIELDS = ("wall_s", "gen_s", "harness_s", "peak_mem_bytes", "step_time")


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def device_description(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _clean(value):
    """JSON has no NaN/Inf: write them as null (TRL's log does the same for metrics with no valid values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _write_json_atomic(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(_clean(data), indent=2, sort_keys=False, default=str) + "\n")


class RunWriter:
    """Writes one run's folder. Use as a context manager: an exception marks the run failed."""

    def __init__(self, out_dir: str | Path, side: str, spec, device: str, extra: dict | None = None):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / METRICS_FILE
        self.metrics_path.write_text("")  # a fresh run starts a fresh log
        (self.dir / COMPLETIONS_FILE).write_text("")
        self.manifest = {
            "side": side,
            "status": "running",
            "spec": spec.to_dict(),
            "seeds": {"SEED": spec.SEED, "model.init_seed": spec.model.init_seed, "data.seed": spec.data.seed},
            "versions": library_versions(),
            "device": device_description(device),
            "ran": run_label(spec, device_description(device)),  # dtype, autocast, device, model and its weights hash
            "git_commit": git_commit(),
            "command": sys.argv,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "steps_logged": 0,
            "rewards": reward_provenance(spec),  # each function's file and source hash: whose rewards scored this
            **(extra or {}),
        }
        _write_json_atomic(self.dir / MANIFEST_FILE, self.manifest)
        self._fh = open(self.metrics_path, "a", buffering=1)

    def log_step(self, row: dict) -> None:
        self._fh.write(json.dumps(_clean(row), default=float) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.manifest["steps_logged"] += 1

    def log_completions(self, step: int, samples: list[dict]) -> None:
        """The first few completions of a generation step (prompt, completion, rewards, advantage)."""
        with open(self.dir / COMPLETIONS_FILE, "a") as fh:
            for i, sample in enumerate(samples[:COMPLETIONS_PER_STEP]):
                fh.write(json.dumps(_clean({"step": step, "index": i, **sample}), default=str) + "\n")

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        _write_json_atomic(self.dir / MANIFEST_FILE, self.manifest)

    def finish(self, status: str) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.update(status=status, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("interrupted")
        elif issubclass(exc_type, FloatingPointError):  # "failed: non-finite loss at step N"
            self.finish(f"failed: {exc}")
        else:
            self.finish(f"failed: {exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
        return False


def read_metrics(path: str | Path) -> tuple[list[dict], list[str]]:
    """Rows of a metrics.jsonl and a list of problems found (a truncated last line is dropped and reported)."""
    path = Path(path)
    rows, problems = [], []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            where = "last line" if n == len(lines) else f"line {n}"
            problems.append(f"{path}: {where} is not complete JSON (a killed writer?); skipped")
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            problems.append(f"{path}: line {n} is not a JSON object; skipped")
    return rows, problems


def read_run(run_dir: str | Path):
    """A run as a pandas DataFrame indexed by step; `df.attrs` holds the manifest and any problems."""
    import pandas as pd

    run_dir = Path(run_dir)
    rows, problems = read_metrics(run_dir / METRICS_FILE)
    stepped = [r for r in rows if isinstance(r.get("step"), (int, float)) and not isinstance(r["step"], bool)]
    if len(stepped) < len(rows):
        problems.append(f"{run_dir / METRICS_FILE}: {len(rows) - len(stepped)} row(s) without a step number; skipped")
    for p in problems:
        warnings.warn(p, stacklevel=2)
    df = pd.DataFrame(stepped)
    if not df.empty:
        df = df.set_index("step", drop=False).sort_index()
    manifest_path = run_dir / MANIFEST_FILE
    manifest = {}
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            problems.append(f"{manifest_path}: not readable JSON ({e}); read without it")
        if not isinstance(manifest, dict):
            problems.append(f"{manifest_path}: not a JSON object; read without it")
            manifest = {}
    df.attrs["manifest"] = manifest
    df.attrs["problems"] = problems
    return df


def peak_memory_bytes(device: str) -> int:
    """Peak accelerator memory since the last reset, or the process's peak RSS on CPU."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


class Progress:
    """Progress of one loop: a tqdm bar on a terminal; elsewhere (CI, a log file) a plain line about every
    10% of the steps, with the ETA. Silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool):
        import sys

        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=label, unit="step", dynamic_ncols=True)

    def update(self, row: dict) -> None:
        self.done += 1
        reward = row.get("reward")
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{reward:.3f}" if reward is not None else "-", loss=f"{row['loss']:.4g}")
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            import sys

            elapsed = time.perf_counter() - self.t0
            eta = elapsed / self.done * (self.total - self.done)
            r = f"{reward:.3f}" if reward is not None else "-"
            print(f"  {self.label}: step {self.done}/{self.total}  reward {r}  loss {row['loss']:.4g}  "
                  f"elapsed {elapsed:.1f} s  eta {eta:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def step_ranges(steps: list[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> '1-3, 5, 7-8'."""
    out, start, prev = [], None, None
    for s in sorted(steps):
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = s
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)
