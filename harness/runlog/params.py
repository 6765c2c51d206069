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

SKETCH_FILE = "param_sketch.f32"
SKETCH_META = "param_sketch.json"
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
        (Path(out_dir) / SKETCH_META).write_text(json.dumps(
            {"width": self.width, "exact": self.exact, "parameters": total, "seed": seed}) + "\n")

    @torch.no_grad()
    def record(self, model) -> None:
        params = dict(model.named_parameters())
        parts = []
        for name, idx in self.plan:
            flat = params[name].detach().reshape(-1)
            parts.append((flat if idx is None else flat[idx.to(flat.device)]).float().cpu())
        row = torch.cat(parts).numpy().astype(np.float32)
        with open(self.path, "ab") as fh:
            fh.write(row.tobytes())


def read_sketch(run_dir: str | Path) -> tuple[np.ndarray, dict] | None:
    """(steps x width array, meta), whole rows only; None when the run recorded none."""
    run_dir = Path(run_dir)
    meta_path = run_dir / SKETCH_META
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    raw = np.fromfile(run_dir / SKETCH_FILE, dtype=np.float32)
    rows = len(raw) // meta["width"]
    return raw[: rows * meta["width"]].reshape(rows, meta["width"]), meta


def relative_l2(a_dir: str | Path, b_dir: str | Path) -> list[float] | None:
    """Per step ||a - b|| / ||b|| over the recorded coordinates; None when either run has no sketch."""
    a, b = read_sketch(a_dir), read_sketch(b_dir)
    if a is None or b is None or a[1]["width"] != b[1]["width"]:
        return None
    n = min(len(a[0]), len(b[0]))
    x, y = a[0][:n].astype(np.float64), b[0][:n].astype(np.float64)
    return list(np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), 1e-30))
