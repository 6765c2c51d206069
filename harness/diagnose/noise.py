"""The calibrated tolerance: how far floating point alone moves a run, measured on the run itself.

A fixed per-dtype bound cannot be right for every model, learning rate and run length: rounding noise in
lockstep grows step by step (Adam turns a 1e-7 gradient difference into a sign flip where a gradient is near
zero; the weights then differ and every later forward pass with them). So the harness measures it. The
scratch side is run a second time on the same recorded rollouts with a change that only alters rounding (the
*noise twin*: every initial weight moved by one ulp of the dtype it is held in (MASTER_WEIGHTS), micro-batch
gradients summed in reverse order; `scratch_grpo.train(noise_twin=True)`). A bf16 autocast run holds fp32 master
weights: a bf16 step there would be a real 2^-8 change of every weight (measured on SmolLM2, H200: the twin's
weights 5.7e-3 apart from the first step, where the two sides measured 1.9e-6 after 10 steps and 2.8e-6 after 30
at the lesson's config, docs/benchmarks.md); the bf16 arithmetic's own noise is the static floor's part
(torch.testing's bf16 bounds). Per metric and step, the envelope is the largest
|plain - twin| seen up to that step, absolute or relative to the metric's value (noise does not shrink back
once it is in the weights; see `Envelope`), and param_rel_l2's envelope is the twin's relative L2 distance
to the plain run.

A cross-implementation difference diverges at a step when it exceeds both the static bound of the dtype (the
floor: torch.testing's rule, `tolerances.toml`) and K times the envelope. K and the floor are in
`tolerances.toml` [calibrated], with the measurements they rest on (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.runlog.atomic import atomic_write_text

NOISE_FILE = "noise_envelope.json"


@dataclass
class Envelope:
    """Per step (index) and metric (columns): the running maximum over the steps so far of |plain - twin|
    (`absolute`) and of |plain - twin| / |plain| (`relative`). A metric's envelope at a step is the larger of the
    absolute one and the relative one times the metric's value there: a spike (a gradient norm 30x its usual
    size) carries its noise with it, and a metric near 0 keeps the absolute noise it had."""

    absolute: pd.DataFrame
    relative: pd.DataFrame

    @property
    def columns(self):
        return self.absolute.columns

    def at(self, metric: str, steps, value=None) -> np.ndarray | None:
        """The envelope of `metric` at `steps` (carried forward over steps the twin did not log; 0 before its
        first), scaled by |value| (an array over the same steps) for the relative part; None for a metric the
        twin did not measure."""
        if metric not in self.absolute.columns:
            return None
        out = _carry(self.absolute[metric], steps)
        if value is not None and metric in self.relative.columns:
            out = np.maximum(out, _carry(self.relative[metric], steps) * np.abs(np.asarray(value, dtype=float)))
        return out


def _carry(series: pd.Series, steps) -> np.ndarray:
    s = series.reindex(series.index.union(pd.Index(steps))).ffill().fillna(0.0)
    return s.reindex(pd.Index(steps)).to_numpy(dtype=float)


def envelope(plain: pd.DataFrame, twin: pd.DataFrame, param_rel_l2: list[float] | None) -> Envelope:
    """The noise envelope of a plain run and its twin (frames indexed by step).

    Only numeric metrics both runs log are kept; a NaN difference (a value one run lacks) counts as 0 at that
    step. `param_rel_l2`: the twin's per-step relative L2 distance to the plain run's weights (already relative:
    its envelope is absolute)."""
    steps = plain.index.intersection(twin.index)
    absolute, relative = {}, {}
    for c in sorted(set(plain.columns) & set(twin.columns)):
        x = pd.to_numeric(plain.loc[steps, c], errors="coerce")
        y = pd.to_numeric(twin.loc[steps, c], errors="coerce")
        if x.isna().all() or y.isna().all():
            continue
        d = (x - y).abs().replace([np.inf, -np.inf], np.nan).fillna(0.0)
        absolute[c] = d.cummax().to_numpy(dtype=float)
        rel = (d / x.abs()).where(d > 0, 0.0).replace([np.inf, -np.inf], np.nan).fillna(0.0)
        relative[c] = rel.cummax().to_numpy(dtype=float)
    if param_rel_l2 is not None:
        arr = np.zeros(len(steps))
        n = min(len(arr), len(param_rel_l2))
        arr[:n] = np.maximum.accumulate(np.asarray(param_rel_l2[:n], dtype=float))
        if n < len(arr):
            arr[n:] = arr[n - 1] if n else 0.0
        absolute["param_rel_l2"] = arr
    return Envelope(pd.DataFrame(absolute, index=steps), pd.DataFrame(relative, index=steps))


def k_of(tolerances: dict) -> float:
    """k from a tolerance table's [calibrated] section (10 where it has none)."""
    return float(tolerances.get("calibrated", {}).get("k", 10.0))


def bound(floor: np.ndarray | float, env: np.ndarray | None, k: float) -> np.ndarray | float:
    """The calibrated bound at each step: the larger of the static floor and k times the envelope."""
    if env is None:
        return floor
    return np.maximum(floor, k * np.asarray(env, dtype=float))


def save(env: Envelope, out_dir: Path, k: float, twin_dir: str) -> Path:
    path = Path(out_dir) / NOISE_FILE
    doc = {"k": k, "twin": twin_dir, "steps": [int(s) for s in env.absolute.index],
           "envelope": {c: [float(v) for v in env.absolute[c]] for c in env.absolute.columns},
           "relative": {c: [float(v) for v in env.relative[c]] for c in env.relative.columns}}
    atomic_write_text(path, json.dumps(doc) + "\n")
    return path


def load(run_dir: Path) -> Envelope | None:
    """The envelope a pair saved beside its sides (None when the pair ran with static tolerances)."""
    path = Path(run_dir) / NOISE_FILE
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    index = pd.Index(doc["steps"], name="step")
    return Envelope(pd.DataFrame(doc["envelope"], index=index), pd.DataFrame(doc.get("relative", {}), index=index))
