"""Self-contained HTML reports: the verdict first, then the curves, then the details.

One file per parity run (`DIR/report.html`) and per `compare` (`OUT/report.html`), plus
`index.html` for a folder of parity runs. Figures are matplotlib PNGs inlined as base64; the page
loads nothing from the network. Jinja2 autoescapes every value: completions, prompts and error
messages are model or user text and show as text, never as markup.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

TEMPLATES = Path(__file__).with_name("templates")
GROUPS = {
    "rewards": ("reward", "reward_std", "frac_reward_zero_std", "rewards/reward_correct/mean",
                "rewards/reward_format/mean", "reward_errors"),
    "lengths": ("completions/mean_length", "completions/clipped_ratio", "completions/mean_terminated_length"),
    "loss and gradient": ("loss", "grad_norm", "learning_rate", "entropy", "kl", "param_rel_l2"),
    "clipping and ratios": ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"),
    "IS and train-inference mismatch": ("sampling/importance_sampling_ratio/mean",
                                        "sampling/importance_sampling_ratio/min",
                                        "sampling/importance_sampling_ratio/max",
                                        "sampling/sampling_logp_difference/mean", "mismatch/logp_diff/mean",
                                        "mismatch/token_mult_prob_error"),
    "batch": ("prompts_in_step", "sequences_in_step", "tokens_in_step", "epoch"),
    "throughput and memory": ("wall_s", "gen_s", "harness_s", "peak_mem_bytes"),
}
KEY_METRICS = ("reward", "completions/mean_length", "loss", "grad_norm", "entropy", "param_rel_l2",
               "prompts_in_step", "sampling/importance_sampling_ratio/mean")
SHORT = {"completions/mean_length": "length", "param_rel_l2": "weights (rel. L2)", "prompts_in_step": "prompts/step",
         "sampling/importance_sampling_ratio/mean": "IS ratio"}
CHECK_TITLES = {"batch": "1. Batch semantics", "loss_type": "2. loss_type",
                "importance_sampling": "3. Importance-sampling correction"}


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html", "j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _num
    return env


def _num(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}g}"
    return str(v)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)  # no tight bbox: it re-draws every axis and costs most of the time
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def _series(df, metric):
    if df is None or metric not in getattr(df, "columns", []):
        return None
    try:
        return df[metric].astype(float)
    except (TypeError, ValueError):
        return None


def curves_figure(a, b, metrics, first_div=None, tolerance=None, names=("scratch", "trl"), rel_l2=None,
                  spread=None) -> str | None:
    """Per metric: both curves overlaid (with a tolerance band around the second, or each side's seed spread),
    the difference below, and a marker at the first divergence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for m in metrics:
        if m == "param_rel_l2":
            if rel_l2:
                panels.append((m, None, None))
        elif _series(a, m) is not None or _series(b, m) is not None:
            panels.append((m, _series(a, m), _series(b, m)))
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows * 2, cols, figsize=(3.8 * cols, 3.6 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] * rows})
    for i, (m, x, y) in enumerate(panels):
        top, bottom = axes[(i // cols) * 2][i % cols], axes[(i // cols) * 2 + 1][i % cols]
        if m == "param_rel_l2":
            steps = list(range(1, len(rel_l2) + 1))
            top.plot(steps, [max(v, 1e-12) for v in rel_l2], color="#7b3294", lw=1.5, label="rel. L2 distance")
            lim = (tolerance or {}).get("param_rel_l2", {}).get("max")
            if lim:
                top.axhline(lim, color="#999", ls="--", lw=1, label="tolerance")
            top.set_yscale("log")
            bottom.axis("off")
        else:
            if x is not None:
                top.plot(x.index, x.values, color="#1f77b4", lw=1.6, label=names[0])
            if y is not None:
                top.plot(y.index, y.values, color="#ff7f0e", lw=1.2, ls="--", label=names[1])
            if spread and m in spread:
                for side, color in ((0, "#1f77b4"), (1, "#ff7f0e")):
                    lo, hi = spread[m][side]
                    top.fill_between(lo.index, lo.values, hi.values, color=color, alpha=0.15, lw=0)
            t = (tolerance or {}).get(m)
            if y is not None and t and "atol" in t:
                band = t.get("atol", 0) + t.get("rtol", 0) * y.abs()
                top.fill_between(y.index, (y - band).values, (y + band).values, color="#ff7f0e", alpha=0.18, lw=0)
            if x is not None and y is not None:
                d = (x - y).dropna()
                bottom.plot(d.index, d.values, color="#444", lw=1)
                bottom.axhline(0, color="#bbb", lw=0.8)
                bottom.set_ylabel("difference", fontsize=7)
            else:
                bottom.text(0.5, 0.5, f"only in {names[0] if y is None else names[1]}", ha="center", va="center",
                            fontsize=8, transform=bottom.transAxes)
                bottom.set_xticks([])
                bottom.set_yticks([])
        if first_div and first_div.get("metric") == m:
            for ax in (top, bottom):
                ax.axvline(first_div["step"], color="#d62728", lw=1.2)
            top.annotate(f"first divergence\nstep {first_div['step']}", (first_div["step"], 0.95),
                         xycoords=("data", "axes fraction"), fontsize=7, color="#d62728", va="top")
        top.set_title(m, fontsize=9)
        top.tick_params(labelsize=7)
        bottom.tick_params(labelsize=7)
        if i == 0:
            top.legend(fontsize=7)
    for j in range(len(panels), rows * cols):
        axes[(j // cols) * 2][j % cols].axis("off")
        axes[(j // cols) * 2 + 1][j % cols].axis("off")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.05, hspace=0.45, wspace=0.3)
    return _png(fig)


# ---------------------------------------------------------------------------------------------
# data gathering
# ---------------------------------------------------------------------------------------------
def _read(run_dir: Path):
    import warnings

    from harness.runlog.log import METRICS_FILE, read_run

    if not (run_dir / METRICS_FILE).exists():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = read_run(run_dir)
    return None if df.empty else df


def _completions(run_dir: Path, step: int | None) -> list[dict]:
    """The completions logged at `step` (or the last logged step before it)."""
    from harness.runlog.log import COMPLETIONS_FILE

    path = run_dir / COMPLETIONS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    steps = sorted({r["step"] for r in rows})
    if not steps:
        return []
    pick = step if step in steps else max([s for s in steps if step is None or s <= step] or steps[:1])
    out = []
    for r in rows:
        if r["step"] == pick:
            prompt = r.get("prompt")
            if isinstance(prompt, list):
                prompt = " | ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
            out.append({"step": pick, "prompt": str(prompt), "completion": str(r.get("completion", "")),
                        "advantage": r.get("advantage"), "rewards": r.get("rewards", {})})
    return out


def _three_checks(a, b, manifest_a: dict, manifest_b: dict) -> list[dict]:
    """The lesson's three checks, with the values that decided each."""
    from trl_runner.translate import LOSS_TYPES

    spec = manifest_a.get("spec", {})
    trl_cfg = manifest_b.get("trl_config", {})

    def first(df, m):
        s = _series(df, m)
        return None if s is None or s.dropna().empty else s.dropna().iloc[0]

    def ratio(df):
        s = _series(df, "sampling/importance_sampling_ratio/mean")
        if s is None:
            return ""
        lo, hi = _series(df, "sampling/importance_sampling_ratio/min"), _series(df, "sampling/importance_sampling_ratio/max")
        return f", ratio mean {_num(float(s.mean()))} (min {_num(float(lo.min()))}, max {_num(float(hi.max()))})"

    is_a = "on" if spec.get("IS_CORRECTION") and spec.get("sampler", {}).get("kind") != "policy" else "off"
    is_b = "on" if trl_cfg.get("vllm_importance_sampling_correction") and (
        trl_cfg.get("use_vllm") or spec.get("sampler", {}).get("kind") == "emulated") else "off"
    return [
        {"name": CHECK_TITLES["batch"],
         "scratch": f"{_num(first(a, 'prompts_in_step'))} prompts / {_num(first(a, 'sequences_in_step'))} sequences "
                    "per step",
         "trl": f"{_num(first(b, 'prompts_in_step'))} prompts / {_num(first(b, 'sequences_in_step'))} sequences per "
                f"step (per_device_train_batch_size {trl_cfg.get('per_device_train_batch_size')}, accumulation "
                f"{trl_cfg.get('gradient_accumulation_steps')})",
         "differs": first(a, "prompts_in_step") != first(b, "prompts_in_step")},
        {"name": CHECK_TITLES["loss_type"],
         "scratch": f"LOSS_NORM = {spec.get('LOSS_NORM')} (TRL's {LOSS_TYPES.get(spec.get('LOSS_NORM'))})",
         "trl": f"loss_type = {trl_cfg.get('loss_type')}",
         "differs": LOSS_TYPES.get(spec.get("LOSS_NORM")) != trl_cfg.get("loss_type")},
        {"name": CHECK_TITLES["importance_sampling"],
         "scratch": is_a + (f" ({spec.get('IS_MODE')})" if is_a == "on" else "") + ratio(a),
         "trl": is_b + (f" ({trl_cfg.get('vllm_importance_sampling_mode')})" if is_b == "on" else "") + ratio(b),
         "differs": is_a != is_b},
    ]


def _matrix_view(cells: list[dict]) -> tuple[list[str], list[dict]]:
    """Cells x key metrics: the largest relative difference, coloured by whether it left tolerance."""
    cols = [m for m in KEY_METRICS if any(m in c.get("metrics", {}) for c in cells)]
    rows = []
    for c in cells:
        entries = []
        for m in cols:
            mm = c.get("metrics", {}).get(m)
            if mm is None:
                entries.append({"text": "", "cls": "na"})
                continue
            bad = mm.get("first_outside") is not None
            entries.append({"text": _num(mm.get("max_rel") if m != "param_rel_l2" else mm.get("max_abs"), 2),
                            "cls": "bad" if bad else ("zero" if not mm.get("max_abs") else "good")})
        rows.append({"name": c["name"], "entries": entries, "verdict": c.get("verdict"), "ok": c.get("ok")})
    return cols, rows


def _seed_spread(a_frames, b_frames):
    """Per metric, each side's min..max over seeds (the free-run band)."""
    import pandas as pd

    a_frames = [f for f in a_frames if f is not None]
    b_frames = [f for f in b_frames if f is not None]
    if not a_frames or not b_frames:
        return None
    out = {}
    for m in {x for g in GROUPS.values() for x in g}:
        sides = []
        for frames in (a_frames, b_frames):
            cols = [c for c in (_series(f, m) for f in frames) if c is not None]
            if not cols:
                break
            stacked = pd.concat(cols, axis=1)
            sides.append((stacked.min(axis=1), stacked.max(axis=1)))
        if len(sides) == 2:
            out[m] = sides
    return out


def _cell_view(cell: dict, tolerances: dict, mode: str, full: bool = True) -> dict:
    """One cell's page section. `full`: every metric group; otherwise the key curves only."""
    from harness.runlog.params import relative_l2

    cell_dir = Path(cell.get("dir", ""))
    rel, spread = None, None
    if mode == "free":
        a_dirs = sorted((cell_dir / "scratch").glob("seed-*"))
        b_dirs = sorted((cell_dir / "trl").glob("seed-*"))
        a_root = a_dirs[0] if a_dirs else cell_dir / "scratch"
        b_root = b_dirs[0] if b_dirs else cell_dir / "trl"
        spread = _seed_spread([_read(d) for d in a_dirs], [_read(d) for d in b_dirs])
    else:
        a_root, b_root = cell_dir / "scratch", cell_dir / "trl"
    a, b = _read(a_root), _read(b_root)
    if mode != "free" and a is not None and b is not None:
        rel = relative_l2(a_root, b_root)
    manifest_a = (a.attrs.get("manifest") if a is not None else None) or {}
    manifest_b = (b.attrs.get("manifest") if b is not None else None) or {}
    mapping_path = b_root / "mapping.json"
    mapping = json.loads(mapping_path.read_text()) if mapping_path.exists() else []
    fd = cell.get("first_divergence")
    tol = tolerances.get("lockstep", {}).get(manifest_a.get("spec", {}).get("DTYPE", "float32"), {})
    timing = set(GROUPS["throughput and memory"])  # no tolerance: these differ run to run by nature
    tol_by_metric = {m: tol.get(m, tol.get("default", {})) for m in {x for g in GROUPS.values() for x in g} - timing}
    tol_by_metric["param_rel_l2"] = tol.get("param_rel_l2", {})
    figures = []
    groups = GROUPS.items() if full else [("key curves", KEY_METRICS)]
    if a is not None or b is not None:
        for group, metrics in groups:
            img = curves_figure(a, b, metrics, fd, tol_by_metric if mode == "lockstep" else None,
                                rel_l2=rel if "param_rel_l2" in metrics else None, spread=spread)
            if img:
                figures.append({"group": group, "img": img})
    step = fd["step"] if fd else None
    return {
        **cell, "figures": figures, "full": full,
        "checks": _three_checks(a, b, manifest_a, manifest_b) if a is not None and b is not None else [],
        "completions": list(zip(_completions(a_root, step), _completions(b_root, step))),
        "diff_config": [r for r in mapping if str(r.get("scratch_value")) != str(r.get("trl_value"))],
        "mapping": mapping,
        "samplers": sorted({str(m.get("sampler")) for m in (manifest_a, manifest_b) if m.get("sampler")}),
        "emulated": any("emulated" in str(m.get("sampler", "")) for m in (manifest_a, manifest_b)),
        "device": manifest_a.get("device"), "lockstep_note": mode == "lockstep",
    }


# ---------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------
def write_parity_report(out_dir: str | Path) -> Path:
    from harness.diagnose.compare import load_tolerances

    out_dir = Path(out_dir)
    doc = json.loads((out_dir / "verdict.json").read_text())
    tolerances = load_tolerances()
    # every metric group where a person looks first: the matched cell, one cell per expected cause, surprises
    full, seen = set(), set()
    for i, c in enumerate(doc["cells"]):
        if i == 0 or not c.get("ok") or (c.get("expected_cause") and c["expected_cause"] not in seen):
            full.add(i)
            seen.add(c.get("expected_cause"))
    cells = [_cell_view(c, tolerances, doc.get("mode", "lockstep"), full=i in full) for i, c in enumerate(doc["cells"])]
    cols, matrix_rows = _matrix_view(doc["cells"])
    html = _env().get_template("parity.html.j2").render(doc=doc, cells=cells, matrix_cols=[SHORT.get(c, c) for c in cols],
                                                         matrix_rows=matrix_rows)
    path = out_dir / "report.html"
    path.write_text(html)
    write_index(out_dir.parent)
    return path


def write_compare_report(out_dir: str | Path, result: dict) -> Path:
    from harness.diagnose.compare import load_any_run, load_tolerances

    out_dir = Path(out_dir)
    a_dir, b_dir = (Path(r) for r in result.get("runs", ["", ""]))
    a = load_any_run(a_dir) if a_dir.exists() else None
    b = load_any_run(b_dir) if b_dir.exists() else None
    tol = load_tolerances().get(result["mode"], {}).get(result.get("dtype") or "float32", {})
    figures = []
    for group, metrics in GROUPS.items():
        if group == "throughput and memory":
            continue
        img = curves_figure(a, b, metrics, result.get("first_divergence"),
                            {m: tol.get(m, tol.get("default", {})) for m in metrics}, names=(a_dir.name, b_dir.name))
        if img:
            figures.append({"group": group, "img": img})
    html = _env().get_template("compare.html.j2").render(result=result, figures=figures,
                                                          names=(a_dir.name or "A", b_dir.name or "B"))
    path = out_dir / "report.html"
    path.write_text(html)
    return path


def write_index(root: str | Path) -> Path | None:
    """index.html for a folder holding several parity runs (folders with verdict.json)."""
    root = Path(root)
    runs = []
    for v in sorted(root.glob("*/verdict.json")):
        try:
            doc = json.loads(v.read_text())
        except json.JSONDecodeError:
            continue
        runs.append({"name": v.parent.name, "ok": doc.get("ok"), "mode": doc.get("mode"), "matrix": doc.get("matrix"),
                     "cells": len(doc.get("cells", [])), "as_expected": sum(c.get("ok", False) for c in doc["cells"]),
                     "report": f"{v.parent.name}/report.html", "spec": doc.get("spec")})
    if len(runs) < 2:
        return None
    path = root / "index.html"
    path.write_text(_env().get_template("index.html.j2").render(runs=runs, root=str(root)))
    return path
