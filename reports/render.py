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
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, select_autoescape

from harness.diagnose import noise
from harness.runlog.atomic import atomic_write_text

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
TEXT_LIMIT = 4000  # characters of one prompt or completion shown in a report


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


TIMING = frozenset(GROUPS["throughput and memory"])
# bookkeeping columns: compared by the comparator, never drawn as curves
NOT_CURVES = frozenset({"step", "prompt_ids_hash", "reward_errors", "step_time", "num_tokens"})
MAX_PANELS = 9  # a cell shows at most this many curves; the rest are listed in words


def _style_axis(ax) -> None:
    """Integer steps, no offset or scientific shorthand on the value axis, labels a person can read."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    if ax.get_yscale() == "linear":  # log axes keep their decades
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.ticklabel_format(axis="y", useOffset=False)
    ax.tick_params(labelsize=9)
    ax.grid(alpha=0.25, lw=0.6)


def _band(t: dict | None, y):
    """The tolerance around 0 that the difference must stay within at each step (lockstep), or None."""
    if not t or "atol" not in t or y is None:
        return None
    return t.get("atol", 0) + t.get("rtol", 0) * y.abs()


def classify_metrics(a, b, metrics) -> dict:
    """Which metrics carry information: `plot` (they differ somewhere: worth a picture), `identical` (equal on
    every step), `constant` (identical and never change), `one_sided` (logged by one side only)."""
    out = {"plot": [], "identical": [], "constant": [], "one_sided": []}
    for m in metrics:
        x, y = _series(a, m), _series(b, m)
        if x is None and y is None:
            continue
        if x is None or y is None:
            out["one_sided"].append(m)
            continue
        if x.index.equals(y.index) and x.equals(y):
            out["constant" if x.dropna().nunique() <= 1 else "identical"].append(m)
        else:
            out["plot"].append(m)
    return out


def curves_figure(a, b, metrics, first_div=None, tolerance=None, names=("scratch", "trl"), rel_l2=None,
                  spread=None, cols: int = 3, envelope=None, k_noise: float = 10.0) -> str | None:
    """Per metric: both curves overlaid (or each side's seed spread), the difference below on its own scale with
    the tolerance band around 0, and a red line at the first divergence. Only metrics with data are drawn.
    `envelope`: the noise twin's (calibrated tolerance): drawn in grey behind the difference, and the band is the
    larger of the static bound and k_noise times it."""
    import matplotlib
    import numpy as np
    import pandas as pd

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # titles are metric and run names, not TeX: a `$` stays a `$`
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
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows * 2, cols, figsize=(4.4 * cols, 3.5 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] * rows})
    for i, (m, x, y) in enumerate(panels):
        top, bottom = axes[(i // cols) * 2][i % cols], axes[(i // cols) * 2 + 1][i % cols]
        if m == "param_rel_l2":
            steps = list(range(1, len(rel_l2) + 1))
            finite = sum(math.isfinite(v) for v in rel_l2)  # a user's loop: its final weights only, one point
            top.plot(steps, [max(v, 1e-12) for v in rel_l2], color="#7b3294", lw=1.8, label="distance",
                     marker="o" if finite < 3 else None)
            top.set_xlim(0.5, len(rel_l2) + 0.5)
            lim = (tolerance or {}).get("param_rel_l2", {}).get("max")
            env = envelope.at(m, steps) if envelope is not None else None
            if env is not None:
                top.plot(steps, [max(v, 1e-12) for v in env], color="#888", lw=1.2, label="noise twin")
                top.plot(steps, [max(lim or 0.0, k_noise * v, 1e-12) for v in env], color="#999", ls="--", lw=1,
                         label=f"tolerance (max of floor, {k_noise:g}x noise)")
            elif lim:
                top.axhline(lim, color="#999", ls="--", lw=1, label="tolerance")
            top.set_yscale("log")
            top.legend(fontsize=8, loc="lower right")
            bottom.axis("off")
            title = "weights: relative L2 distance"
        else:
            if x is not None:
                top.plot(x.index, x.values, color="#1f77b4", lw=1.8, label=names[0])
            if y is not None:
                top.plot(y.index, y.values, color="#ff7f0e", lw=1.4, ls="--", label=names[1])
            if spread and m in spread:
                for side, color in ((0, "#1f77b4"), (1, "#ff7f0e")):
                    lo, hi = spread[m][side]
                    top.fill_between(lo.index, lo.values, hi.values, color=color, alpha=0.15, lw=0)
            if x is not None and y is not None:
                d = (x - y).dropna()
                bottom.plot(d.index, d.values, color="#333", lw=1.2)
                bottom.axhline(0, color="#bbb", lw=0.8)
                band = _band((tolerance or {}).get(m), y)
                env = envelope.at(m, d.index, y.reindex(d.index).to_numpy()) if envelope is not None else None
                if env is not None:
                    env = pd.Series(env, index=d.index)
                    bottom.fill_between(d.index, (-env).values, env.values, color="#777", alpha=0.35, lw=0,
                                        label="noise twin")
                    band = env * k_noise if band is None else np.maximum(band.reindex(d.index), env * k_noise)
                if band is not None and not d.empty:
                    band = band.reindex(d.index)
                    bottom.fill_between(d.index, (-band).values, band.values, color="#2ca02c", alpha=0.15, lw=0,
                                        label="tolerance")
                    peak = float(d.abs().max())
                    if peak > 0 and float(band.max()) > 5 * peak:  # the band would flatten the difference: zoom in
                        bottom.set_ylim(-1.3 * peak, 1.3 * peak)
                        bottom.text(0.99, 0.95, f"tolerance ±{float(band.max()):.2g} (beyond view)", fontsize=7,
                                    ha="right", va="top", color="#2ca02c", transform=bottom.transAxes)
                bottom.set_ylabel(f"{names[0]} − {names[1]}", fontsize=8)
                _style_axis(bottom)
            else:
                bottom.text(0.5, 0.5, f"only in {names[0] if y is None else names[1]}", ha="center", va="center",
                            fontsize=9, transform=bottom.transAxes)
                bottom.set_xticks([])
                bottom.set_yticks([])
            title = m
            if i == 0:
                top.legend(fontsize=8)
        if first_div and first_div.get("metric") == m:
            for ax in (top, bottom):
                ax.axvline(first_div["step"], color="#d62728", lw=1.2)
            top.annotate(f"parts at step {first_div['step']}", (first_div["step"], 0.95),
                         xycoords=("data", "axes fraction"), fontsize=8, color="#d62728", va="top", ha="left")
        top.set_title(title, fontsize=10.5)
        _style_axis(top)
    for j in range(len(panels), rows * cols):
        axes[(j // cols) * 2][j % cols].axis("off")
        axes[(j // cols) * 2 + 1][j % cols].axis("off")
    fig.subplots_adjust(left=0.7 / (4.4 * cols), right=0.98, top=1 - 0.35 / (3.5 * rows), bottom=0.25 / (3.5 * rows),
                        hspace=0.5, wspace=0.3)
    return _png(fig)


def overview_figure(cells: list[dict], tolerance_max: float | None = None) -> str | None:
    """The first picture: per diverged cell, the metric where it parts (both sides, the step marked); and, in
    lockstep, the distance between the two models' weights for every cell on one log axis."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    parted = [c for c in cells if c.get("first_divergence") and c.get("_frames")]
    dists = [c for c in cells if c.get("_rel_l2")]
    n = len(parted) + (1 if dists else 0)
    if not n:
        return None
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 2.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    k = 0
    if dists:
        ax = flat[0]
        for c in dists:
            steps = list(range(1, len(c["_rel_l2"]) + 1))
            ok = not c.get("first_divergence")
            ax.plot(steps, [max(v, 1e-12) for v in c["_rel_l2"]], lw=1.4 if ok else 1.0,
                    color="#2ca02c" if ok else "#d62728", alpha=0.85)
        if tolerance_max:
            ax.axhline(tolerance_max, color="#999", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_title("weights apart (rel. L2): green parity, red parted", fontsize=10)
        _style_axis(ax)
        k = 1
    for c in parted:
        ax = flat[k]
        k += 1
        fd = c["first_divergence"]
        a, b = c["_frames"]
        names = c.get("sides") or ("scratch", "trl")
        for df, color, ls, name in ((a, "#1f77b4", "-", names[0]), (b, "#ff7f0e", "--", names[1])):
            s = _series(df, fd["metric"])
            if s is not None:
                ax.plot(s.index, s.values, color=color, ls=ls, lw=1.5, label=name)
        ax.axvline(fd["step"], color="#d62728", lw=1.2)
        ax.set_title(f"{c['name']}: {fd['metric']}", fontsize=10)
        _style_axis(ax)
        if c is parted[0]:
            ax.legend(fontsize=8)
    for ax in flat[k:]:
        ax.axis("off")
    fig.subplots_adjust(left=0.7 / (4.4 * cols), right=0.98, top=1 - 0.35 / (2.6 * rows), bottom=0.3 / (2.6 * rows),
                        hspace=0.5, wspace=0.3)
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
        try:
            df = read_run(run_dir)
        except (OSError, ValueError):  # not a readable metric log (binary, say): the report shows the run without it
            return None
    return None if df.empty else df


def _json_file(path: Path, default):
    """A JSON file's value when it is of the default's type; the default when it is missing or damaged."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default
    return value if isinstance(value, type(default)) else default


def _completions(run_dir: Path, step: int | None) -> list[dict]:
    """The completions logged at `step` (or the last logged step before it)."""
    from harness.runlog.log import COMPLETIONS_FILE

    path = run_dir / COMPLETIONS_FILE
    if not path.exists():
        return []
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and not isinstance(row["step"], bool):
            rows.append(row)
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
            out.append({"step": pick, "prompt": clip_text(str(prompt)),
                        "completion": clip_text(str(r.get("completion", ""))),
                        "advantage": r.get("advantage"), "rewards": r.get("rewards", {})})
    return out


def clip_text(text: str, limit: int | None = None) -> str:
    """`text` cut to `limit` characters with a visible mark, so that a 20 MB question (times every completion of
    it, times every cell) does not make an 80 MB report; the run folder's completions.jsonl keeps it whole."""
    limit = TEXT_LIMIT if limit is None else limit
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} chars cut)"


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


def _noise_note(cell: dict, calibrated: bool, k: float) -> str | None:
    """One sentence on the calibrated tolerance: the largest difference-to-noise ratio and the smallest weight
    difference the run could have shown."""
    if not calibrated:
        return None
    metrics = cell.get("metrics", {})
    ratios = [(m["ratio_to_noise"], name) for name, m in metrics.items() if m.get("ratio_to_noise") is not None]
    text = (f"Calibrated tolerance: a metric diverges beyond {k:g}x the noise twin's difference (grey; the same scratch "
            "run changed only in its rounding) and beyond the static bound.")
    if ratios:
        r, name = max(ratios)
        text += f" Largest difference / noise: {r:.3g} ({name})."
    w = metrics.get("param_rel_l2", {}).get("noise_last")
    if w is not None:
        text += f" The smallest weight difference this run could have shown: {k * w:.2g} (relative L2)."
    return text


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


def _differences(spec_dict: dict | None) -> list[dict]:
    """The preflight's differences for a cell's spec: what the two sides really do differently (the mapping
    table's texts differ for equal settings, e.g. '4 x 4 = 16 sequences' against '8 x 2 x 1 = 16 sequences')."""
    from harness.diagnose.preflight import preflight
    from harness.experiment.spec import parse_spec

    if not spec_dict:
        return []
    try:
        _tr, diffs, _facts = preflight(parse_spec(spec_dict))
    except Exception:  # a spec this version cannot read back: the mapping table below still shows the settings
        return []
    return [{"check": d.check, "quantity": d.quantity, "scratch": d.scratch, "trl": d.trl,
             "fields": ", ".join(map(str, d.fields))} for d in diffs]


def _cell_view(cell: dict, tolerances: dict, mode: str, full: bool = True) -> dict:
    """One cell's page section. Curves only for metrics that differ somewhere (`full`: all of them, else the key
    metrics), the rest named in words: identical on every step, constant, logged by one side only."""
    from harness.runlog.params import relative_l2

    cell_dir = Path(cell.get("dir", ""))
    sides = tuple(cell.get("sides") or ("scratch", "trl"))  # ("yours", "trl") for a user's loop
    rel, spread = None, None
    if mode == "free":
        a_dirs = sorted((cell_dir / sides[0]).glob("seed-*"))
        b_dirs = sorted((cell_dir / sides[1]).glob("seed-*"))
        a_root = a_dirs[0] if a_dirs else cell_dir / sides[0]
        b_root = b_dirs[0] if b_dirs else cell_dir / sides[1]
        spread = _seed_spread([_read(d) for d in a_dirs], [_read(d) for d in b_dirs])
    else:
        a_root, b_root = cell_dir / sides[0], cell_dir / sides[1]
    a, b = _read(a_root), _read(b_root)
    if mode != "free" and a is not None and b is not None:
        rel = relative_l2(a_root, b_root)
    if rel is None and "param_rel_l2" in cell.get("metrics", {}):  # a user's loop: its final weights only
        m = cell["metrics"]["param_rel_l2"]
        rel = [math.nan] * (int(m.get("step_max_abs") or (len(a) if a is not None else 1)) - 1) + [m["max_abs"]]
    manifest_a = (a.attrs.get("manifest") if a is not None else None) or {}
    manifest_b = (b.attrs.get("manifest") if b is not None else None) or {}
    mapping_path = b_root / "mapping.json"
    mapping = _json_file(mapping_path, [])
    fd = cell.get("first_divergence")
    dtype = manifest_a.get("spec", {}).get("DTYPE", "float32")
    tol = tolerances.get("lockstep", {}).get(dtype, {})
    # timing metrics get no curve and no tolerance: they differ run to run by nature
    ordered = [m for g in GROUPS.values() for m in g if m not in TIMING and m != "param_rel_l2"]
    if a is not None and b is not None:  # anything else both sides log (a reward's own mean, say)
        ordered += sorted((set(a.columns) & set(b.columns)) - set(ordered) - TIMING - NOT_CURVES)
    tol_by_metric = {m: tol.get(m, tol.get("default", {})) for m in ordered}
    tol_by_metric["param_rel_l2"] = tol.get("param_rel_l2", {})
    try:
        envelope = noise.load(cell_dir) if mode == "lockstep" else None  # the noise twin's: calibrated tolerance
    except (OSError, ValueError, KeyError, TypeError):  # a damaged envelope file: the static bands only
        envelope = None
    if envelope is not None:  # the calibrated run's floor, as the comparison used it
        from harness.diagnose.compare import param_limit

        tol_by_metric["param_rel_l2"] = {"max": param_limit(tolerances, "lockstep", dtype, calibrated=True)}
    k_noise = noise.k_of(tolerances)
    kinds = classify_metrics(a, b, ordered)
    plot = kinds["plot"] if full else [m for m in kinds["plot"] if m in KEY_METRICS]
    if fd and fd.get("metric") in plot:  # the metric where the sides part comes first
        plot.remove(fd["metric"])
        plot.insert(0, fd["metric"])
    shown = (["param_rel_l2"] if rel else []) + plot
    figures = []
    if shown:
        img = curves_figure(a, b, shown[:MAX_PANELS], fd, tol_by_metric if mode == "lockstep" else None, rel_l2=rel,
                            spread=spread, names=sides, envelope=envelope, k_noise=k_noise)
        if img:
            figures.append({"group": "metrics that differ", "img": img})
    kinds["not_drawn"] = shown[MAX_PANELS:] + ([m for m in kinds["plot"] if m not in plot])
    kinds["timing"] = {side: {m: float(df[m].median()) for m in ("wall_s", "gen_s") if _series(df, m) is not None}
                       for side, df in zip(sides, (a, b)) if df is not None}
    step = fd["step"] if fd else None
    return {
        **cell, "noise_note": _noise_note(cell, envelope is not None, k_noise), "figures": figures, "full": full,
        # the lesson's checks read the scratch loop's spec; a user's loop keeps its choices to itself
        "checks": _three_checks(a, b, manifest_a, manifest_b) if a is not None and b is not None and
        sides == ("scratch", "trl") else [], "sides": sides,
        "explained": next((d for d in cell.get("attribution_detail") or [] if "runs" in d), None),
        "completions": list(zip(_completions(a_root, step), _completions(b_root, step))),
        "diff_config": _differences(manifest_a.get("spec")) if sides == ("scratch", "trl") else [],
        "mapping": mapping,
        "samplers": sorted({str(m.get("sampler")) for m in (manifest_a, manifest_b) if m.get("sampler")}),
        "emulated": any("emulated" in str(m.get("sampler", "")) for m in (manifest_a, manifest_b)),
        "device": manifest_a.get("device"), "lockstep_note": mode == "lockstep", "kinds": kinds,
        "_frames": (a, b), "_rel_l2": rel if rel and not any(math.isnan(v) for v in rel) else None,
    }


# ---------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------
def write_parity_report(out_dir: str | Path) -> Path:
    from harness.diagnose.compare import load_tolerances
    from harness.diagnose.matrix import headline

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
    dtype = next((c["_frames"][0].attrs.get("manifest", {}).get("spec", {}).get("DTYPE") for c in cells
                  if c["_frames"][0] is not None), "float32")
    limit = tolerances.get("lockstep", {}).get(dtype or "float32", {}).get("param_rel_l2", {}).get("max")
    overview = overview_figure(cells, limit if doc.get("mode", "lockstep") == "lockstep" else None)
    html = _env().get_template("parity.html.j2").render(doc=doc, cells=cells, matrix_cols=[SHORT.get(c, c) for c in cols],
                                                         matrix_rows=matrix_rows, headline=headline(doc),
                                                         overview=overview)
    path = out_dir / "report.html"
    atomic_write_text(path, html)
    try:
        write_index(out_dir.parent)
    except OSError:  # the folder above the run is not ours to write to: no index, the report stands
        pass
    return path


def write_compare_report(out_dir: str | Path, result: dict, frames=None) -> Path:
    """The compare page. `frames`: each side's loaded runs (lists of frames, as `compare` read and aligned them);
    without them the runs named in the result are read again. Several seeds: the first seed's curve and each
    side's seed band."""
    from harness.diagnose.compare import load_any_run, load_tolerances

    out_dir = Path(out_dir)
    runs = result.get("runs", ["", ""])
    paths = [Path(r[0] if isinstance(r, list) else r) for r in runs]
    if frames is None:
        frames = [[load_any_run(p)] if str(p) and p.exists() else [] for p in paths]
    a, b = (f[0] if f else None for f in frames)
    spread = _seed_spread(frames[0], frames[1]) if max(len(f) for f in frames) > 1 else None
    tol = load_tolerances().get(result["mode"], {}).get(result.get("dtype") or "float32", {})
    names = tuple(result.get("names") or (paths[0].name or "A", paths[1].name or "B"))
    figures = []
    for group, metrics in GROUPS.items():
        if group == "throughput and memory":
            continue
        bands = {m: tol.get(m, tol.get("default", {})) for m in metrics} if result["mode"] == "lockstep" else None
        img = curves_figure(a, b, metrics, result.get("first_divergence"), bands, names=names, spread=spread)
        if img:
            figures.append({"group": group, "img": img})
    html = _env().get_template("compare.html.j2").render(result=result, figures=figures, names=names)
    path = out_dir / "report.html"
    atomic_write_text(path, html)
    return path


def write_index(root: str | Path) -> Path | None:
    """index.html for a folder holding several parity runs (folders with verdict.json)."""
    root = Path(root)
    runs = []
    for v in sorted(root.glob("*/verdict.json")):
        try:
            doc = json.loads(v.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            continue  # a folder that is not a readable parity run is not listed
        if not isinstance(doc, dict) or not isinstance(doc.get("cells", []), list):
            continue
        cells = [c for c in doc.get("cells", []) if isinstance(c, dict)]
        runs.append({"name": v.parent.name, "ok": doc.get("ok") is True, "complete": doc.get("complete", True) is True,
                     "mode": doc.get("mode"), "matrix": doc.get("matrix"),
                     "cells": len(cells), "as_expected": sum(c.get("ok") is True for c in cells),
                     "report": f"./{quote(v.parent.name)}/report.html", "spec": doc.get("spec")})
    if len(runs) < 2:
        return None
    path = root / "index.html"
    atomic_write_text(path, _env().get_template("index.html.j2").render(runs=runs, root=str(root)))
    return path
