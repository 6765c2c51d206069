"""A fixed sample of parameter coordinates, recorded after every optimizer step.

Lockstep parity compares the two loops' weights after each step: the relative L2 distance
||theta_scratch - theta_trl|| / ||theta_trl||. Both loops record the same coordinates (chosen per
tensor from a seed and the tensor's name, in proportion to its size); for models up to
`EXACT_LIMIT` parameters every coordinate is recorded, so the distance is exact. Rows are
appended to `param_sketch.f32` (raw float32, one row per step), so a killed run keeps them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from harness.runlog.atomic import atomic_write_text

SKETCH_FILE = "param_sketch.f32"
SKETCH_META = "param_sketch.json"
SKETCH_INIT = "param_sketch_init.f32"  # the same coordinates before the first step (for update statistics)
EXACT_LIMIT = 2_000_000
SAMPLE_SIZE = 65_536


class ParamSketch:
    def __init__(self, model, out_dir: str | Path, seed: int = 0):
        named = [(n, p) for n, p in model.named_parameters()]
        total = sum(p.numel() for _, p in named)
        self.exact = total <= EXACT_LIMIT
        self.plan = []  # (name, flat indices or None for all)
        for name, p in named:
            if self.exact:
                self.plan.append((name, None))
                continue
            k = max(1, round(SAMPLE_SIZE * p.numel() / total))
            h = int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:12], 16)
            g = torch.Generator().manual_seed(h)
            self.plan.append((name, torch.randint(0, p.numel(), (k,), generator=g)))
        self.width = sum(p.numel() if idx is None else len(idx) for (_, p), (_, idx) in zip(named, self.plan))
        self.path = Path(out_dir) / SKETCH_FILE
        self.path.write_bytes(b"")
        atomic_write_text(Path(out_dir) / SKETCH_META, json.dumps(
            {"width": self.width, "exact": self.exact, "parameters": total, "seed": seed}) + "\n")
        (Path(out_dir) / SKETCH_INIT).write_bytes(self._row(model).tobytes())

    @torch.no_grad()
    def _row(self, model) -> np.ndarray:
        params = dict(model.named_parameters())
        parts = []
        for name, idx in self.plan:
            flat = params[name].detach().reshape(-1)
            parts.append((flat if idx is None else flat[idx.to(flat.device)]).float().cpu())
        return torch.cat(parts).numpy().astype(np.float32)

    def record(self, model) -> None:
        row = self._row(model)
        with open(self.path, "ab") as fh:
            fh.write(row.tobytes())


def read_sketch(run_dir: str | Path) -> tuple[np.ndarray, dict] | None:
    """(steps x width array, meta), whole rows only; None when the run recorded none."""
    run_dir = Path(run_dir)
    meta_path = run_dir / SKETCH_META
    if not meta_path.exists():
        return None
    try:  # a damaged sketch (a folder edited by hand, a disk that lost it) reads as none, like a missing one
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        raw = np.fromfile(run_dir / SKETCH_FILE, dtype=np.float32)
    except (OSError, ValueError):
        return None
    if not (isinstance(meta, dict) and type(meta.get("width")) is int and meta["width"] > 0):
        return None
    rows = len(raw) // meta["width"]
    return raw[: rows * meta["width"]].reshape(rows, meta["width"]), meta


def relative_l2(a_dir: str | Path, b_dir: str | Path) -> list[float] | None:
    """Per step ||a - b|| / ||b|| over the recorded coordinates; None when either run has no sketch."""
    return relative_l2_of(read_sketch(a_dir), read_sketch(b_dir))


def relative_l2_of(a: tuple | None, b: tuple | None) -> list[float] | None:
    """relative_l2 on sketches in hand ((steps x width array, meta) each, as read_sketch gives them)."""
    if a is None or b is None or a[1]["width"] != b[1]["width"]:
        return None
    n = min(len(a[0]), len(b[0]))
    x, y = a[0][:n].astype(np.float64), b[0][:n].astype(np.float64)
    return list(np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), 1e-30))


def update_stats(run_dir: str | Path) -> list[dict] | None:
    """Per optimizer step, over the recorded coordinates: the fraction whose value did not change (with bf16
    weights, updates smaller than half a bf16 step round to nothing) and the median |update| / |weight|.
    None when the run recorded no initial row (older runs) or no steps."""
    found = read_sketch(run_dir)
    init_path = Path(run_dir) / SKETCH_INIT
    if found is None or not init_path.exists():
        return None
    init = np.fromfile(init_path, dtype=np.float32)
    return update_stats_of(found[0], init if len(init) == found[1]["width"] else None)


def update_stats_of(rows: np.ndarray, init: np.ndarray | None) -> list[dict] | None:
    """update_stats on a sketch in hand: its rows (steps x width) and its initial row (None: not recorded)."""
    if init is None or not len(rows):
        return None
    rows = np.vstack([init[None], rows])
    return [step_update_stats(rows[t - 1], rows[t]) for t in range(1, len(rows))]


def step_update_stats(before: np.ndarray, after: np.ndarray) -> dict:
    """{"unchanged": fraction of coordinates with after == before, "median_rel": median |after - before| / |before|
    over the non-zero weights}; NaN coordinates are left out."""
    ok = np.isfinite(before) & np.isfinite(after)
    b, a = before[ok].astype(np.float64), after[ok].astype(np.float64)
    nz = b != 0
    return {"unchanged": float(np.mean(a == b)) if len(b) else float("nan"),
            "median_rel": float(np.median(np.abs(a[nz] - b[nz]) / np.abs(b[nz]))) if nz.any() else float("nan")}
