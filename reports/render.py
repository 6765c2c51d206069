"""Self-contained HTML reports: the verdict first, then the curves, then the details.

One file per parity run (`DIR/report.html`) and per `compare` (`OUT/report.html`), plus
`index.html` for a folder of parity runs. The parity page's figures are inline SVG (reports/svg.py, texts escaped
there); the compare page's are matplotlib PNGs inlined as base64. The page loads nothing from the network. Jinja2
autoescapes every other value: completions, prompts and error messages are model or user text and show as text,
never as markup.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from harness.diagnose.answer import short_numbers, training_divergence
from harness.runlog.atomic import atomic_write_text
from reports import svg

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
    env.filters["short"] = short_numbers
    env.filters["parted"] = training_divergence  # where a cell's runs part, as its headline says it
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


BLUE, ORANGE, RED, GREEN, GREY, PURPLE = "#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#777", "#7b3294"
# one metric's chart, in pixels: the two curves above, their difference below, on the same steps
WIDTH, LEFT, RIGHT = 380, 52, 10
PLOT_W = WIDTH - LEFT - RIGHT
CURVES_TOP, CURVES_H = 40, 128
DIFF_TOP, DIFF_H = 204, 56
HEIGHT = 280
OVERVIEW_H = 200  # an overview chart: one plot, CURVES_TOP to OVERVIEW_H - 24


def _steps(*series) -> tuple[float, float]:
    """The steps a chart spans: every step any of `series` logs, half a step more at each end."""
    steps = [s for x in series if x is not None for s in map(svg.finite, x.index) if s is not None]
    return (min(steps) - 0.5, max(steps) + 0.5) if steps else (0.5, 1.5)


def _title(chart: svg.Chart, text: str) -> None:
    """Across the top, cut to the chart's width (about 7 px a character in 12 px bold)."""
    chart.text(chart.width / 2, 15, text, size=12, weight=600, anchor="middle", limit=int((chart.width - 8) / 7))


def _mark_divergence(first_div: dict | None, metric: str, plots: list[svg.Plot]) -> None:
    """A red line at the first divergence through every plot of the metric where the sides part, and its step."""
    step = svg.finite(first_div.get("step")) if first_div and first_div.get("metric") == metric else None
    if step is None:
        return
    for plot in plots:
        plot.vline(step, RED, cls="divergence")
    top = plots[0]
    right_half = top.x(step) > top.left + top.width / 2
    top.chart.text(top.x(step) + (-4 if right_half else 4), top.top + 12, f"parts at step {step:g}", color=RED,
                   anchor="end" if right_half else "start")


def curves_figure(a, b, metrics, first_div=None, tolerance=None, names=("scratch", "trl"), rel_l2=None,
                  spread=None, envelope=None, k_noise: float = 10.0) -> Markup | None:
    """One chart per metric with data (inline SVG): both curves overlaid (or each side's seed spread), the
    difference below on its own scale with the tolerance band around 0, and a red line at the first divergence.
    `param_rel_l2`: the distance between the two models' weights (`rel_l2`, per step) on a log axis.
    `envelope`: the noise twin's (calibrated tolerance): drawn in grey behind the difference, and the band is the
    larger of the static bound and k_noise times it."""
    charts = []
    for m in metrics:
        if m == "param_rel_l2":
            if rel_l2:
                charts.append(_weights_chart(rel_l2, first_div, tolerance, envelope, k_noise))
        elif _series(a, m) is not None or _series(b, m) is not None:
            charts.append(_metric_chart(m, _series(a, m), _series(b, m), names, first_div, tolerance, spread,
                                        envelope, k_noise))
    return Markup("".join(charts)) if charts else None


def _metric_chart(m, x, y, names, first_div, tolerance, spread, envelope, k_noise) -> str:
    chart = svg.Chart(WIDTH, HEIGHT, f"{m}: {names[0]} and {names[1]}, and their difference")
    _title(chart, m)
    steps = _steps(x, y)
    sides = [(s, color, dash, name) for s, color, dash, name in ((x, BLUE, False, names[0]), (y, ORANGE, True, names[1]))
             if s is not None]
    bands = list(zip(spread[m], (BLUE, ORANGE))) if spread and m in spread else []
    values = [v for s, *_ in sides for v in s.values] + [v for (lo, hi), _ in bands for v in (*lo.values, *hi.values)]
    top = chart.plot(LEFT, CURVES_TOP, PLOT_W, CURVES_H, steps, svg.limits(values))
    top.axes()
    for (lo, hi), color in bands:
        top.band(lo.index, lo.values, hi.values, color, 0.15)
    for s, color, dash, name in sides:
        top.line(s.index, s.values, color, width=1.4 if dash else 1.8, dash=dash, name=name)
    legend = [(name, color, "dash" if dash else "line") for _s, color, dash, name in sides]
    legend += [("min–max over seeds", "#999", "band")] if bands else []
    plots = [top]
    if x is not None and y is not None:
        bottom, entries = _difference_plot(chart, m, x, y, names, steps, tolerance, envelope, k_noise)
        plots.append(bottom)
        legend += entries
    else:
        chart.text(LEFT + PLOT_W / 2, DIFF_TOP + DIFF_H / 2, f"only in {names[0] if y is None else names[1]}",
                   size=11, color="#555", anchor="middle", limit=int(PLOT_W / 6.4))
    chart.legend(LEFT, 31, legend)
    _mark_divergence(first_div, m, plots)
    return chart.svg()


def _difference_plot(chart, m, x, y, names, steps, tolerance, envelope, k_noise) -> tuple[svg.Plot, list]:
    """x - y at every step both log, with the noise twin's envelope (grey) and the tolerance (green) around 0;
    zoomed in on the difference when the band would flatten it. Returns the plot and its legend entries."""
    import numpy as np
    import pandas as pd

    d = (x - y).dropna()
    band = _band((tolerance or {}).get(m), y)
    env = envelope.at(m, d.index, y.reindex(d.index).to_numpy()) if envelope is not None else None
    if env is not None:
        env = pd.Series(env, index=d.index)
        band = env * k_noise if band is None else np.maximum(band.reindex(d.index), env * k_noise)
    band = band.reindex(d.index) if band is not None and not d.empty else None
    values = [0.0, *d.values]
    for around in (env, band):
        if around is not None:
            values += [*around.values, *(-around).values]
    ylim = svg.limits(values)
    peak = float(d.abs().max()) if not d.empty else 0.0
    widest = float(band.max()) if band is not None else 0.0
    note = f"tolerance ±{widest:.2g} (beyond view)" if peak > 0 and widest > 5 * peak else ""
    if note:  # the band would flatten the difference: zoom in
        ylim = svg.limits([-1.25 * peak, 1.25 * peak])
        chart.text(LEFT + PLOT_W, DIFF_TOP - 5, note, color=GREEN, anchor="end")
    room = int((PLOT_W - (svg.CHAR_W * len(note) + 10 if note else 0)) / svg.CHAR_W)  # beside the note
    chart.text(LEFT, DIFF_TOP - 5, f"{names[0]} − {names[1]}", color="#555", limit=max(room, 8))
    plot = chart.plot(LEFT, DIFF_TOP, PLOT_W, DIFF_H, steps, ylim)
    plot.axes(y_ticks=2)
    legend = []
    if env is not None:
        plot.band(d.index, (-env).values, env.values, GREY, 0.35)
        legend.append(("noise twin", GREY, "band"))
    if band is not None:
        plot.band(d.index, (-band).values, band.values, GREEN, 0.15)
        legend.append(("tolerance", GREEN, "band"))
    plot.hline(0.0, "#bbb")
    plot.line(d.index, d.values, "#333", width=1.2, name="difference")
    return plot, legend


def _weights_chart(rel_l2, first_div, tolerance, envelope, k_noise) -> str:
    """The relative L2 distance between the two models' weights per step, on a log axis, against its tolerance
    (with a noise twin: the larger of the floor and k_noise times the twin's distance)."""
    chart = svg.Chart(WIDTH, HEIGHT, "weights: relative L2 distance between the two models, per step")
    _title(chart, "weights: relative L2 distance")
    steps = list(range(1, len(rel_l2) + 1))
    limit = (tolerance or {}).get("param_rel_l2", {}).get("max")
    env = envelope.at("param_rel_l2", steps) if envelope is not None else None
    lines = [([max(v, 1e-12) for v in rel_l2], PURPLE, False, "distance")]
    if env is not None:
        lines.append(([max(v, 1e-12) for v in env], "#888", False, "noise twin"))
        lines.append(([max(limit or 0.0, k_noise * v, 1e-12) for v in env], "#999", True, "tolerance"))
    values = [v for ys, *_ in lines for v in ys] + ([limit] if limit and env is None else [])
    plot = chart.plot(LEFT, CURVES_TOP, PLOT_W, DIFF_TOP + DIFF_H - 14 - CURVES_TOP, (0.5, len(steps) + 0.5),
                      svg.limits(values, log=True), log=True)
    plot.axes()
    legend = [(name, color, "dash" if dash else "line") for _ys, color, dash, name in lines]
    if limit and env is None:
        plot.hline(limit, "#999", dash=True, width=1)
        legend.append(("tolerance", "#999", "dash"))
    if env is not None:  # what the dashed line is, under the step axis
        floor = f"{limit:.2g} and " if limit else ""
        chart.text(LEFT, HEIGHT - 5, f"tolerance: the larger of {floor}{k_noise:g}× the noise twin", color="#555")
    elif limit:
        chart.text(LEFT, HEIGHT - 5, f"tolerance: {limit:.2g} (a fixed bound)", color="#555")
    few = sum(svg.finite(v) is not None for v in rel_l2) < 3  # a user's loop: its final weights only, one point
    for ys, color, dash, name in lines:
        plot.line(steps, ys, color, width=1.8 if name == "distance" else 1.2, dash=dash, name=name,
                  markers=few and name == "distance")
    chart.legend(LEFT, 31, legend)
    _mark_divergence(first_div, "param_rel_l2", [plot])
    return chart.svg()


def overview_figure(cells: list[dict], tolerance_max: float | None = None) -> Markup | None:
    """The first picture: in lockstep, the distance between the two models' weights for every cell on one log
    axis; and per diverged cell, the metric where it parts (both sides, the step marked)."""
    parted = [c for c in cells if c.get("first_divergence") and c.get("_frames")]
    dists = [c for c in cells if c.get("_rel_l2")]
    charts = [_distances_chart(dists, tolerance_max)] if dists else []
    charts += [_parted_chart(c) for c in parted]
    return Markup("".join(charts)) if charts else None


def _distances_chart(cells: list[dict], tolerance_max: float | None) -> str:
    chart = svg.Chart(WIDTH, OVERVIEW_H, "weights apart (relative L2) per cell: green at parity, red parted")
    _title(chart, "weights apart (rel. L2): green parity, red parted")
    longest = max(len(c["_rel_l2"]) for c in cells)
    values = [max(v, 1e-12) for c in cells for v in c["_rel_l2"]] + ([tolerance_max] if tolerance_max else [])
    plot = chart.plot(LEFT, CURVES_TOP, PLOT_W, OVERVIEW_H - 24 - CURVES_TOP, (0.5, longest + 0.5),
                      svg.limits(values, log=True), log=True)
    plot.axes()
    if tolerance_max:
        plot.hline(tolerance_max, "#999", dash=True, width=1)
    for c in cells:
        ok = not c.get("first_divergence")
        plot.line(range(1, len(c["_rel_l2"]) + 1), [max(v, 1e-12) for v in c["_rel_l2"]], GREEN if ok else RED,
                  width=1.4 if ok else 1.0, name=c["name"])
    chart.legend(LEFT, 31, [("parity", GREEN, "line"), ("parted", RED, "line")]
                 + ([("tolerance", "#999", "dash")] if tolerance_max else []))
    return chart.svg()


def _parted_chart(cell: dict) -> str:
    fd = cell["first_divergence"]
    a, b = cell["_frames"]
    names = cell.get("sides") or ("scratch", "trl")
    chart = svg.Chart(WIDTH, OVERVIEW_H, f"{cell['name']}: {fd['metric']}, where the two sides part")
    _title(chart, f"{cell['name']}: {fd['metric']}")
    sides = [(s, color, dash, name) for s, color, dash, name in ((_series(a, fd["metric"]), BLUE, False, names[0]),
                                                                (_series(b, fd["metric"]), ORANGE, True, names[1]))
             if s is not None]
    plot = chart.plot(LEFT, CURVES_TOP, PLOT_W, OVERVIEW_H - 24 - CURVES_TOP, _steps(*(s for s, *_ in sides)),
                      svg.limits([v for s, *_ in sides for v in s.values]))
    plot.axes()
    for s, color, dash, name in sides:
        plot.line(s.index, s.values, color, width=1.5, dash=dash, name=name)
    chart.legend(LEFT, 31, [(name, color, "dash" if dash else "line") for _s, color, dash, name in sides])
    _mark_divergence(fd, fd["metric"], [plot])
    return chart.svg()


# ---------------------------------------------------------------------------------------------
# data gathering
# ---------------------------------------------------------------------------------------------
def _read(run_dir: Path):
    """A run's metric log as a frame indexed by step, or None. Without its attrs: pandas deep-copies them into every
    column taken out of the frame, and with the manifest in them that was a third of the report's time (`_manifest`
    reads the manifest)."""
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
    df.attrs.clear()
    return None if df.empty else df


def _manifest(run_dir: Path, df) -> dict:
    """The manifest of a run whose metric log could be read (`df`, from `_read`), else {}."""
    from harness.runlog.log import MANIFEST_FILE

    return _json_file(run_dir / MANIFEST_FILE, {}) if df is not None else {}


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
    from harness.diagnose import noise
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
    manifest_a, manifest_b = _manifest(a_root, a), _manifest(b_root, b)
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
            figures.append({"group": "metrics that differ", "svg": img})
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
        "_frames": (a, b), "_dtype": manifest_a.get("spec", {}).get("DTYPE"),
        "_rel_l2": rel if rel and not any(math.isnan(v) for v in rel) else None,
    }


# ---------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------
# the report on your loop's one script: its copy button puts the [trl] table on the clipboard (no data in it)
COPY_SCRIPT = Markup("""
document.querySelectorAll("button.copy").forEach(function (button) {
  button.addEventListener("click", function () {
    var source = document.getElementById(button.dataset.copy);
    function done() { button.textContent = "copied"; }
    function select() {
      var range = document.createRange();
      range.selectNodeContents(source);
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      document.execCommand("copy");
      done();
    }
    if (navigator.clipboard) { navigator.clipboard.writeText(source.textContent).then(done, select); } else { select(); }
  });
});
""")


def _other_notes(explained: dict, answer: dict) -> list[str]:
    """The explanation's notes that the page does not already say: not what the run could not tell (the answer's
    list) and not a stage's read (the stage table holds each rule)."""
    from harness.diagnose.answer import UNTOLD

    rules = {f.get("rule") for f in explained.get("identified") or []}
    return [n for n in explained.get("notes") or []
            if UNTOLD not in n and "cannot tell" not in n and n.split(": ", 1)[-1] not in rules]


def _parting_before(sentence: str) -> str:
    """The headline's parting, said as what it is: the logged metrics of your loop and of TRL as the spec sets it up,
    before the answer's settings (a reader took "first on loss" for the dataflow's first link, which the chain shows)."""
    first = sentence.split(". ")[0].rstrip(".")
    if first.startswith("The two loops part"):
        return "Before these settings, the logged metrics part" + first[len("The two loops part"):] + "."
    return first + "."


def write_parity_report(out_dir: str | Path) -> Path:
    from harness.diagnose.answer import short_value, your_loop_answer
    from harness.diagnose.compare import load_tolerances
    from harness.diagnose.verdict import headline

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
    answer = your_loop_answer(doc)
    if answer and cells[0].get("explained"):  # your loop, explained: the answer first, the evidence folded below
        html = _env().get_template("yours.html.j2").render(
            doc=doc, cells=cells, answer=answer, parting=_parting_before(headline(doc)["sentence"]),
            notes=_other_notes(cells[0]["explained"], answer), short_value=short_value, copy_script=COPY_SCRIPT)
        return _write_report(out_dir, html)
    cols, matrix_rows = _matrix_view(doc["cells"])
    dtype = next((c["_dtype"] for c in cells if c["_frames"][0] is not None), "float32")
    limit = tolerances.get("lockstep", {}).get(dtype or "float32", {}).get("param_rel_l2", {}).get("max")
    overview = overview_figure(cells, limit if doc.get("mode", "lockstep") == "lockstep" else None)
    html = _env().get_template("parity.html.j2").render(doc=doc, cells=cells, matrix_cols=[SHORT.get(c, c) for c in cols],
                                                         matrix_rows=matrix_rows, headline=headline(doc),
                                                         overview=overview)
    return _write_report(out_dir, html)


def _write_report(out_dir: Path, html: str) -> Path:
    path = out_dir / "report.html"
    atomic_write_text(path, html)
    try:
        write_index(out_dir.parent)
    except OSError:  # the folder above the run is not ours to write to: no index, the report stands
        pass
    return path


# ---------------------------------------------------------------------------------------------
# the compare page's figures: still matplotlib PNGs inlined as base64 (tests/test_compare_files.py expects one)
# ---------------------------------------------------------------------------------------------
def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)  # no tight bbox: it re-draws every axis and costs most of the time
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _style_axis(ax) -> None:
    """Integer steps, no offset or scientific shorthand on the value axis, labels a person can read."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    if ax.get_yscale() == "linear":  # log axes keep their decades
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.ticklabel_format(axis="y", useOffset=False)
    ax.tick_params(labelsize=9)
    ax.grid(alpha=0.25, lw=0.6)


def curves_png(a, b, metrics, first_div=None, tolerance=None, names=("A", "B"), spread=None,
               cols: int = 3) -> str | None:
    """The compare page's curves (as the parity page drew them before its SVG figures, less what only a parity run
    has: the weights' distance and the noise twin). Per metric: both curves overlaid (and each side's seed spread),
    the difference below on its own scale with the tolerance band around 0, and a red line at the first divergence."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # titles are metric and run names, not TeX: a `$` stays a `$`
    import matplotlib.pyplot as plt

    panels = [(m, _series(a, m), _series(b, m)) for m in metrics
              if m != "param_rel_l2" and (_series(a, m) is not None or _series(b, m) is not None)]
    if not panels:
        return None
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows * 2, cols, figsize=(4.4 * cols, 3.5 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] * rows})
    for i, (m, x, y) in enumerate(panels):
        top, bottom = axes[(i // cols) * 2][i % cols], axes[(i // cols) * 2 + 1][i % cols]
        if x is not None:
            top.plot(x.index, x.values, color=BLUE, lw=1.8, label=names[0])
        if y is not None:
            top.plot(y.index, y.values, color=ORANGE, lw=1.4, ls="--", label=names[1])
        for (lo, hi), color in zip(spread[m], (BLUE, ORANGE)) if spread and m in spread else ():
            top.fill_between(lo.index, lo.values, hi.values, color=color, alpha=0.15, lw=0)
        if x is not None and y is not None:
            d = (x - y).dropna()
            bottom.plot(d.index, d.values, color="#333", lw=1.2)
            bottom.axhline(0, color="#bbb", lw=0.8)
            band = _band((tolerance or {}).get(m), y)
            if band is not None and not d.empty:
                band = band.reindex(d.index)
                bottom.fill_between(d.index, (-band).values, band.values, color=GREEN, alpha=0.15, lw=0,
                                    label="tolerance")
                peak = float(d.abs().max())
                if peak > 0 and float(band.max()) > 5 * peak:  # the band would flatten the difference: zoom in
                    bottom.set_ylim(-1.3 * peak, 1.3 * peak)
                    bottom.text(0.99, 0.95, f"tolerance ±{float(band.max()):.2g} (beyond view)", fontsize=7,
                                ha="right", va="top", color=GREEN, transform=bottom.transAxes)
            bottom.set_ylabel(f"{names[0]} − {names[1]}", fontsize=8)
            _style_axis(bottom)
        else:
            bottom.text(0.5, 0.5, f"only in {names[0] if y is None else names[1]}", ha="center", va="center",
                        fontsize=9, transform=bottom.transAxes)
            bottom.set_xticks([])
            bottom.set_yticks([])
        if i == 0:
            top.legend(fontsize=8)
        if first_div and first_div.get("metric") == m:
            for ax in (top, bottom):
                ax.axvline(first_div["step"], color=RED, lw=1.2)
            top.annotate(f"parts at step {first_div['step']}", (first_div["step"], 0.95),
                         xycoords=("data", "axes fraction"), fontsize=8, color=RED, va="top", ha="left")
        top.set_title(m, fontsize=10.5)
        _style_axis(top)
    for j in range(len(panels), rows * cols):
        axes[(j // cols) * 2][j % cols].axis("off")
        axes[(j // cols) * 2 + 1][j % cols].axis("off")
    fig.subplots_adjust(left=0.7 / (4.4 * cols), right=0.98, top=1 - 0.35 / (3.5 * rows), bottom=0.25 / (3.5 * rows),
                        hspace=0.5, wspace=0.3)
    return _png(fig)


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
        img = curves_png(a, b, metrics, result.get("first_divergence"), bands, names=names, spread=spread)
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
