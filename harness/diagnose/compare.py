"""The comparator: two metric logs in, per-metric differences and the first divergence out.

`python -m harness compare A B --out DIR` reads, for each side, one run's log (any format runs.py reads: a harness
run folder, JSONL, CSV, a TRL trainer_state.json, TensorBoard event files; its names and missing values are said
there), or several runs of one side (free-run seeds): a comma-separated list (an item may be a quoted glob), or a
folder of seed runs (`seed-*/`, as the harness's free runs write them).

Steps are aligned by number, or by generation round (`align_rounds`: a `round` column, else each log's steps
counted K to a round from its first step; values averaged per round). Per metric it reports the max |delta|
and max relative delta with the step of each, the mean delta (one-sided drift, as TRL's tests/invariant
checks) and the first step outside tolerance. Tolerances come from a TOML file (default:
harness/diagnose/tolerances.toml): lockstep defaults are torch.testing's per-dtype rtol/atol. Several seeds
per side are compared with the free-run statistic (freerun.compare_free), never with lockstep's tolerances.

A metric (or a step's value) that one side logs and the other does not: between the built-in sides
(`compare_runs`, the matrix) a divergence, since there it means different settings; in `compare_inputs`
(the `compare` command, other people's logs) listed as not compared, never a divergence.
"""

from __future__ import annotations

import glob
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from pandas.api.types import is_numeric_dtype

from harness.diagnose import noise
from harness.diagnose.runs import CompareInputError, _absent, _as_step, _build, absent_at, load_any_run

DEFAULT_TOLERANCES = Path(__file__).with_name("tolerances.toml")
# when several metrics leave tolerance at the same step, report them in the lesson's order
PRIORITY = ("prompts_in_step", "sequences_in_step", "prompt_ids_hash", "epoch", "tokens_in_step", "num_tokens",
            "reward", "reward_std", "loss", "grad_norm", "completions/mean_length", "entropy", "learning_rate",
            "sampling/importance_sampling_ratio/mean", "param_rel_l2")
CHECKS = ("batch", "loss_type", "importance_sampling")  # the lesson's checks, worded as suspicions by compare


def load_tolerances(path: str | Path | None = None) -> dict:
    path = Path(path) if path else DEFAULT_TOLERANCES
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CompareInputError(f"tolerance file {path}: {e}") from None


def align_rounds(df: pd.DataFrame, steps_per_round: int | None = None) -> pd.DataFrame:
    """The log by generation round: its `round` column, else its steps counted `steps_per_round` to a round from
    its first step (round 1). Per round, the mean of the values its steps logged (a NaN or inf among them stays
    one); text: the first value."""
    source = df.attrs.get("source", "a log")
    if "round" in df.columns:
        rounds = [_as_step(v) for v in df["round"]]
    elif steps_per_round:
        first = df.index.min()
        rounds = [int((s - first) // steps_per_round) + 1 for s in df.index]
    else:
        raise CompareInputError(f"{source}: --align round needs a `round` column or --steps-per-round K (optimizer "
                                "steps per generation round; 1 for a log with one row per round)")
    cols = [c for c in df.columns if c not in ("step", "round")]
    gone = {c: absent_at(df, c, df.index) for c in cols}
    bare = _bare(df)
    column = {c: bare[c].tolist() for c in cols}
    groups: dict = {}
    for pos, r in enumerate(rounds):
        if r is not None:  # (a row without a round number is left out)
            groups.setdefault(r, []).append(pos)
    by_round = {}
    for r, positions in groups.items():
        row = {"step": r}
        for c in cols:
            vals = [column[c][p] for p in positions if not gone[c][p]]
            if not vals:
                continue
            numbers = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                          for v in vals)
            row[c] = float(np.mean(np.asarray(vals, dtype=float))) if numbers else vals[0]
        by_round[r] = row
    out = _build(by_round)
    if out.empty:
        raise CompareInputError(f"{source}: no round to align (its `round` column holds no numbers)")
    out.attrs.update({k: v for k, v in df.attrs.items() if k != "absent"})
    sizes = sorted({len(p) for p in groups.values()})
    if sizes != [1]:
        per = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
        out.attrs["problems"] = list(df.attrs.get("problems", [])) + [
            f"{source}: {len(df)} rows in {len(groups)} rounds ({per} per round), values averaged per round"]
    return out


# TRL with logging_steps = N logs one row every N steps, averaged over the steps since the row before: the loss
# (transformers' Trainer divides the loss summed since the last log by the steps in between) and GRPOTrainer's own
# metrics (GRPOTrainer.log averages each metric's list since the last log). These are the value at the logged step.
WINDOW_LAST = frozenset({"grad_norm", "learning_rate", "num_tokens", "epoch", "trl/epoch"})


def _log_spacing(df: pd.DataFrame) -> int | None:
    """N when the log has a row every N steps (the first and last gap may be shorter: logging_first_step, the
    last step), else None."""
    steps = sorted(df.index)
    if len(steps) < 2 or not all(isinstance(s, (int, np.integer)) for s in steps):
        return None
    gaps = [int(y - x) for x, y in zip(steps, steps[1:])]
    n = max(set(gaps), key=lambda g: (gaps.count(g), g))  # the most common gap (the larger of a tie)
    regular = n > 0 and all(g == n for g in gaps[1:-1]) and gaps[0] <= n and gaps[-1] <= n
    return n if regular else None


def align_logging_windows(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(a, b), with the per-step one averaged over the other's logging windows when one has a row every N > 1 steps
    (TRL's logging_steps = N) and the other a row every step: for each logged step k the steps after the logged
    step before it through k (k-N+1..k), WINDOW_LAST metrics at k; windows the per-step log does not cover whole
    are left out. The note travels in the averaged frame's problems, into the comparison's notes."""
    spacing = (_log_spacing(a), _log_spacing(b))
    if spacing[0] == 1 and (spacing[1] or 0) > 1:
        dense, sparse, n = a, b, spacing[1]
    elif spacing[1] == 1 and (spacing[0] or 0) > 1:
        dense, sparse, n = b, a, spacing[0]
    else:
        return a, b
    have = set(dense.index)
    cols = [c for c in dense.columns if c != "step"]
    bare = _bare(dense)
    by_step, prev = {}, int(dense.index.min()) - 1
    for k in sorted(int(s) for s in sparse.index):
        window = list(range(max(prev, k - n) + 1, k + 1))
        prev = k
        if not window or not have.issuperset(window):
            continue
        row = {"step": k}
        for c in cols:
            kept = [s for s, gone in zip(window, absent_at(dense, c, window)) if not gone]
            if not kept:
                continue
            vals = bare.loc[kept, c].tolist()
            numbers = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                          for v in vals)
            if c in WINDOW_LAST or not numbers:
                if kept[-1] == k:
                    row[c] = vals[-1]
            else:
                row[c] = float(np.mean(np.asarray(vals, dtype=float)))
        by_step[k] = row
    if not by_step:
        return a, b
    out = _build(by_step)
    out.attrs.update({key: v for key, v in dense.attrs.items() if key != "absent"})
    out.attrs["problems"] = list(dense.attrs.get("problems", [])) + [
        f"TRL logged every {n} steps ({sparse.attrs.get('source', 'one log')}: logging_steps = {n}, each row the "
        f"average of the steps since the row before): the per-step log ({dense.attrs.get('source', 'the other')}) is "
        f"averaged over the same windows (steps k-{n - 1}..k for each logged step k; {', '.join(sorted(WINDOW_LAST))} "
        "taken at k, as TRL logs them)"]
    return (out, b) if dense is a else (a, out)


# ---------------------------------------------------------------------------------------------
# the inputs of `compare`: one run or several seeds per side
# ---------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Both sides' logs, loaded: one frame per run (several: free-run seeds)."""
    a: list
    b: list
    paths: tuple
    names: tuple
    align: str = "step"
    mapping: dict = field(default_factory=dict)


def parse_map(items) -> dict:
    """`--map OURS=THEIRS` items -> {OURS: THEIRS}."""
    out = {}
    for item in items or ():
        ours, sep, theirs = str(item).partition("=")
        if not sep or not ours.strip() or not theirs.strip():
            raise CompareInputError(f"--map {item}: expected OURS=THEIRS (the harness/TRL name, then your log's "
                                    "column), e.g. --map loss=train_loss")
        out[ours.strip()] = theirs.strip()
    return out


def parse_steps_per_round(value) -> tuple[int, int] | None:
    """`--steps-per-round K` (both logs) or `KA,KB` (each log) -> (KA, KB)."""
    if value in (None, ""):
        return None
    parts = [p.strip() for p in str(value).split(",")]
    try:
        ks = [int(p) for p in parts]
    except ValueError:
        ks = []
    if len(ks) not in (1, 2) or min(ks) < 1:
        raise CompareInputError(f"--steps-per-round {value}: expected K or KA,KB (positive whole numbers: optimizer "
                                "steps per generation round, 1 for a log with one row per round)")
    return (ks[0], ks[-1])


def _is_run(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "trainer_state.json").is_file()


def expand_runs(arg) -> list[Path]:
    """One side's runs: a run, a comma-separated list of runs (an item may be a glob), or a folder of seed runs
    (its seed-*/ subfolders)."""
    paths = []
    for item in (s.strip() for s in str(arg).split(",")):
        if not item:
            continue
        if any(ch in item for ch in "*?["):
            found = sorted(glob.glob(item))
            if not found:
                raise CompareInputError(f"{item}: the pattern matches no file or folder")
            paths += [Path(p) for p in found]
        else:
            paths.append(Path(item))
    if not paths:
        raise CompareInputError(f"{arg!r}: no run given")
    if len(paths) == 1 and paths[0].is_dir() and not _is_run(paths[0]):
        seeds = sorted(d for d in paths[0].glob("seed-*") if d.is_dir() and _is_run(d))
        if seeds:
            return seeds
    return paths


def _label(paths: list[Path]) -> str:
    p = paths[0]
    name = p.parent.name if p.name in ("metrics.jsonl", "trainer_state.json") else p.name
    if len(paths) > 1:
        name = f"{p.parent.name or name} ({len(paths)} runs)"
    return name or "A"


def load_inputs(run_a, run_b, *, mapping: dict | None = None, align: str = "step",
                steps_per_round=None) -> Inputs:
    """Both sides of a comparison, loaded and aligned (by step, or by generation round)."""
    mapping = dict(mapping or {})
    per_round = parse_steps_per_round(steps_per_round) if not isinstance(steps_per_round, tuple) else steps_per_round
    if align not in ("step", "round"):
        raise CompareInputError(f"--align {align}: expected step or round")
    if per_round and align != "round":
        raise CompareInputError("--steps-per-round counts steps to a generation round: add --align round")
    paths = (expand_runs(run_a), expand_runs(run_b))
    frames = ([load_any_run(p, mapping) for p in paths[0]], [load_any_run(p, mapping) for p in paths[1]])
    if mapping:
        found = {c for side in frames for f in side for c in f.attrs.get("mapped", [])}
        for ours, theirs in mapping.items():
            if theirs not in found and f"train/{theirs}" not in found:
                cols = {c for side in frames for f in side for c in f.attrs.get("columns", [])}
                raise CompareInputError(f"--map {ours}={theirs}: neither log has a column {theirs!r} (their columns: "
                                        f"{', '.join(sorted(cols)[:30])})")
    if align == "round":
        frames = tuple([align_rounds(f, per_round[i] if per_round else None) for f in side]
                       for i, side in enumerate(frames))
    else:  # a log every N steps (TRL's logging_steps) against a per-step one: the per-step one over the same windows
        first_a, first_b = frames[0][0], frames[1][0]
        frames = ([align_logging_windows(f, first_b)[0] for f in frames[0]],
                  [align_logging_windows(first_a, f)[1] for f in frames[1]])
    return Inputs(a=frames[0], b=frames[1], paths=paths, names=(_label(paths[0]), _label(paths[1])), align=align,
                  mapping=mapping)


def suspicions(result: dict, evidence) -> list[dict]:
    """The lesson's checks that the curves point at, worded by `evidence(check, result)` (the attribution's
    rules, harness.diagnose.attribution.evidence, passed in: this module cannot import it). Suspected only:
    compare re-runs nothing, so nothing is confirmed."""
    fd = result.get("first_divergence")
    if evidence is None or fd is None:
        return []
    # a NaN or inf first: no sign of how the loss is averaged, whatever the loss_type rule would read into it
    nan_first = fd["step"] in ((result["metrics"].get(fd["metric"]) or {}).get("non_finite_steps") or [])
    out = []
    for check in CHECKS:
        if check == "loss_type" and nan_first:
            continue
        try:
            why = evidence(check, result)
        except (KeyError, TypeError, ValueError):  # a result without the fields a rule reads
            why = None
        if why:
            out.append({"check": check, "status": "suspected", "evidence": why})
    return out


SEEDS_HINT = "give each side a folder of seed runs (seed-*/), or a comma-separated list of runs, e.g. A1,A2,A3 B1,B2,B3"


def input_mode(inputs: Inputs, mode: str | None = None) -> str:
    """"lockstep" for one run per side, "free" for several seeds per side (`mode` None picks by the count); a
    mode the counts do not allow is an input error saying what to give instead."""
    n = (len(inputs.a), len(inputs.b))
    mode = mode or ("free" if max(n) > 1 else "lockstep")
    if mode == "free" and min(n) < 2:
        raise CompareInputError(f"--mode free measures the seed-to-seed noise, which needs at least 2 seeds per side "
                                f"(here {n[0]} and {n[1]}): {SEEDS_HINT}; or compare one run per side in lockstep "
                                "mode")
    if mode == "lockstep" and max(n) > 1:
        raise CompareInputError(f"several runs per side ({n[0]} and {n[1]}) are free-run seeds: use --mode free (the "
                                "default for them), or give one run per side")
    return mode


def compare_inputs(inputs: Inputs, *, dtype: str | None = None, tolerance_file: str | Path | None = None,
                   evidence=None) -> dict:
    """One run per side, compared with lockstep's tolerances; metrics one side logs are listed as not compared.
    (Several seeds per side: `harness.diagnose.freerun.compare_free_inputs`, the seed-noise statistic.)
    `evidence`: the attribution's rules, for the suspicions (see `suspicions`)."""
    input_mode(inputs, "lockstep")
    a, b = inputs.a[0], inputs.b[0]
    if dtype is None:
        dtype = (a.attrs.get("manifest", {}).get("spec") or {}).get("DTYPE", "float32")
    if not len(a.index.intersection(b.index)):
        raise CompareInputError(f"{inputs.names[0]} and {inputs.names[1]} share no {_unit(inputs)} ("
                                f"{a.index.min()}..{a.index.max()} and {b.index.min()}..{b.index.max()}): check "
                                "the step column (--map step=COLUMN), or align by round (--align round)")
    rel = None
    dirs = [p if p.is_dir() else p.parent for p in (inputs.paths[0][0], inputs.paths[1][0])]
    if inputs.align == "step" and all((d / "metrics.jsonl").exists() for d in dirs):
        from harness.runlog.params import relative_l2

        rel = relative_l2(*dirs)
    result = compare_frames(a, b, mode="lockstep", dtype=dtype, tolerances=load_tolerances(tolerance_file),
                            param_rel_l2=rel, one_sided="not_compared")
    if not any(m != "param_rel_l2" for m in result["metrics"]):
        raise CompareInputError(f"{inputs.names[0]} and {inputs.names[1]} share no metric at a shared {_unit(inputs)} "
                                f"({inputs.names[0]}: {_columns(a)}; {inputs.names[1]}: {_columns(b)}): name the "
                                "pairs with --map OURS=THEIRS")
    if a.index.min() != b.index.min():
        result["notes"].append(f"the logs start at different {_unit(inputs)}s ({a.index.min()} and "
                               f"{b.index.min()}); they are matched by number" + (
                                   "" if inputs.align == "round" else ": if one counts from 0, --align round "
                                   "--steps-per-round 1 numbers both from 1"))
    return finish_inputs(result, inputs, evidence)


def finish_inputs(result: dict, inputs: Inputs, evidence=None) -> dict:
    """What every comparison of inputs records besides the numbers: runs, names, alignment, map, suspicions."""
    several = max(len(inputs.a), len(inputs.b)) > 1
    result["runs"] = [[str(p) for p in inputs.paths[0]], [str(p) for p in inputs.paths[1]]] if several \
        else [str(inputs.paths[0][0]), str(inputs.paths[1][0])]
    result["names"] = list(inputs.names)
    result["align"] = inputs.align
    result["map"] = dict(inputs.mapping)
    result["suspected"] = suspicions(result, evidence)
    return result


def _unit(inputs: Inputs) -> str:
    return "round" if inputs.align == "round" else "step"


def _columns(df: pd.DataFrame, limit: int = 12) -> str:
    cols = [c for c in df.columns if c != "step"]
    return ", ".join(cols[:limit]) + (" ..." if len(cols) > limit else "") if cols else "none"


def tolerance_for(tol: dict, mode: str, dtype: str, metric: str) -> dict:
    """A metric's {rtol, atol} from a tolerance table: exact metrics 0/0, else its own entry or the default."""
    table = tol.get(mode, {}).get(dtype, {})
    if metric in tol.get("exact", {}).get("metrics", []):
        return {"rtol": 0.0, "atol": 0.0}
    return table.get(metric, table.get("default", {"rtol": 1.3e-6, "atol": 1e-5}))


# Statistics of the completions and of the policy, not what training computes: a loop of yours may define one
# otherwise (a kl averaged over the round's tokens, rewards of its own) while it trains as the other side does.
DERIVED = ("kl", "entropy", "clip_ratio/", "completions/", "reward", "rewards/", "frac_reward_zero_std", "num_tokens",
           "sampling/", "mismatch/", "epoch", "prompts_in_step", "sequences_in_step", "tokens_in_step",
           "prompt_ids_hash")


def is_derived(metric: str) -> bool:
    """`kl`, `reward_std`, `rewards/f/mean`, `completions/mean_length`, ...: a statistic, not training (DERIVED)."""
    return any(metric == d or (d.endswith("/") and metric.startswith(d)) or metric.startswith(d + "_")
               or metric.startswith(d + "/") for d in DERIVED)


def steps_logged_words(yours, spec) -> str | None:
    """A loop that logged other steps than 1..STEPS, said as what it did."""
    from harness.runlog.log import step_ranges

    steps = [int(s) for s in yours.index]
    missing = sorted(set(range(1, spec.STEPS + 1)) - set(steps))
    if not missing:
        return None
    return (f"your loop logged {len(steps)} of the spec's {spec.STEPS} steps ({step_ranges(steps)}); it logged no "
            f"step {step_ranges(missing)}: those steps are not compared (a loop that skips a step, say on a NaN loss, "
            "should still log it, or count its steps as the optimizer does)")


def compare_frames(a: pd.DataFrame, b: pd.DataFrame, *, mode: str = "lockstep", dtype: str = "float32",
                   tolerances: dict | None = None, param_rel_l2: list[float] | None = None,
                   one_sided: str = "divergence", envelope: noise.Envelope | None = None) -> dict:
    """Per-metric differences of two runs and the first step where any leaves tolerance.

    A NaN or inf on either side (both included) is a divergence at that step; a value neither log has at a step
    is not compared there. A metric only one side logs is never a divergence: listed in `only_in_a/b`, and with
    `one_sided="not_compared"` (other people's logs) also in `not_compared`. `one_sided` also says what a step's
    value that only one side has is: "divergence" (the built-in sides, which log every metric at the same steps) or
    not compared there. `envelope`: the noise twin's (harness/diagnose/noise.py); with
    it a step is outside only beyond both the static bound and K times the envelope (the calibrated tolerance)."""
    if one_sided not in ("divergence", "not_compared"):
        raise ValueError(f"one_sided: {one_sided!r}")
    tol = tolerances or load_tolerances()
    k_noise = noise.k_of(tol)
    procs = [int((df.attrs.get("manifest") or {}).get("processes", 1)) for df in (a, b)]
    problems = [*a.attrs.get("problems", []), *b.attrs.get("problems", [])]
    gone = (a.attrs.get("absent") or {}, b.attrs.get("absent") or {})
    a, b = _bare(a), _bare(b)  # (pandas deep-copies attrs on every selection)
    not_decisive = set(tol.get("aggregation", {}).get("per_micro_step", [])) if procs[0] != procs[1] else set()
    ignore = set(tol.get("ignore", {}).get("metrics", [])) | {"step"}
    steps = a.index.intersection(b.index)
    notes = []
    if len(a) != len(b):
        notes.append(f"runs of different lengths: {len(a)} and {len(b)} steps; compared on the {len(steps)} shared")
    only_a, only_b, not_compared = _one_sided_metrics(a, b, ignore, tol, one_sided)
    metrics, failures, non_finite = {}, [], []
    for col in sorted((set(a.columns) & set(b.columns)) - ignore):
        x, y = a.loc[steps, col], b.loc[steps, col]
        gone_a, gone_b = _absent(gone[0].get(col), steps), _absent(gone[1].get(col), steps)
        # a value one log has at a step and the other does not (the built-in sides log each metric at the same
        # steps, so there it means a different cadence: a divergence; other people's logs: not compared there)
        one = steps[gone_a ^ gone_b] if one_sided == "divergence" else steps[:0]
        if col == "prompt_ids_hash" or not (is_numeric_dtype(x) and is_numeric_dtype(y)):
            metrics[col] = _equal_metric(x, y, gone_a, gone_b, steps, one)
            if metrics[col]["first_outside"] is not None:
                failures.append((metrics[col]["first_outside"], col))
            continue
        x, y = pd.to_numeric(x, errors="coerce").astype(float), pd.to_numeric(y, errors="coerce").astype(float)
        found = _numeric_metric(col, x, y, gone_a, gone_b, steps, one, tolerance_for(tol, mode, dtype, col),
                                envelope, k_noise)
        if found is None:  # never finite on both sides at one step, and no NaN or inf computed
            if one_sided == "not_compared":
                not_compared[col] = "steps"
            continue
        metrics[col], bad_steps, nan_note = found
        if nan_note:
            non_finite.append(nan_note)
        if bad_steps and col in not_decisive and "non_finite_steps" not in metrics[col]:
            metrics[col]["decisive"] = False
        elif bad_steps:
            failures.append((bad_steps[0], col))
    if non_finite:
        notes.append("NaN or inf (a divergence at that step, also when both sides have it): "
                     + "; ".join(non_finite[:6]) + (" ..." if len(non_finite) > 6 else ""))
    if not_decisive:
        notes.append(f"{procs[0]} vs {procs[1]} processes: {', '.join(sorted(not_decisive & set(metrics)))} are "
                     "averaged per micro-step across processes on one side and per micro-batch on the other; "
                     "reported, not decisive")
    if param_rel_l2 is not None:
        metrics["param_rel_l2"] = _param_metric(param_rel_l2, param_limit(tol, mode, dtype, envelope is not None),
                                                envelope, k_noise)
        if metrics["param_rel_l2"]["first_outside"] is not None:
            failures.append((metrics["param_rel_l2"]["first_outside"], "param_rel_l2"))
    rank = {m: i for i, m in enumerate(PRIORITY)}
    failures.sort(key=lambda f: (f[0], rank.get(f[1], len(rank)), f[1]))
    first = {"step": failures[0][0], "metric": failures[0][1]} if failures else None
    if envelope is not None:
        notes.append(f"calibrated tolerance: a metric diverges beyond {k_noise:g}x the noise twin's difference "
                     "(the same scratch run changed only in its rounding) and beyond the static bound")
    return {"mode": mode, "dtype": dtype, "steps": [len(a), len(b)], "first_divergence": first,
            "tolerance_mode": "calibrated" if envelope is not None else "static", "k_noise": k_noise,
            "outside": sorted({m for _, m in failures}), "only_in_a": only_a, "only_in_b": only_b,
            "not_compared": sorted(not_compared), "not_compared_why": dict(sorted(not_compared.items())),
            "one_sided": one_sided,
            "metrics": metrics, "notes": notes + problems}


def _one_sided_metrics(a: pd.DataFrame, b: pd.DataFrame, ignore: set, tol: dict,
                       one_sided: str) -> tuple[list[str], list[str], dict[str, str]]:
    """The metrics only one side logs: (only in a, only in b), less those one-sided by design (the tolerances'
    one_sided_prefixes), and the metrics not compared ({metric: why}: "a"/"b", only that side logs it; with
    `one_sided="not_compared"` every such metric, else none yet; "steps", never logged by both at one step, is
    added by the caller). A metric one side logs and the other never does (TRL's IS ratios with the correction on
    one side only, a counter one loop keeps) is never a divergence: there is nothing to hold it against. The
    built-in sides list it as `only_in_a/b` (attribution reads it as evidence: IS statistics on one side point at
    the IS correction)."""
    by_design = tuple(tol.get("ignore", {}).get("one_sided_prefixes", []))
    only_a = sorted(c for c in set(a.columns) - set(b.columns) - ignore if not c.startswith(by_design))
    only_b = sorted(c for c in set(b.columns) - set(a.columns) - ignore if not c.startswith(by_design))
    not_compared: dict[str, str] = {}
    if one_sided == "not_compared":
        not_compared = {c: "a" for c in set(a.columns) - set(b.columns) - ignore}
        not_compared.update({c: "b" for c in set(b.columns) - set(a.columns) - ignore})
    return only_a, only_b, not_compared


def _equal_metric(x: pd.Series, y: pd.Series, gone_a, gone_b, steps, one) -> dict:
    """A text metric (or one not numeric on both sides), compared by equality: a step is outside where the values
    differ, or where only one side has a value (`one`: the steps where that is a divergence)."""
    same = (x.astype(str) == y.astype(str)).to_numpy() | (gone_a & gone_b)
    bad = sorted([int(s) for s in steps[~same & ~(gone_a ^ gone_b)]] + [int(s) for s in one])
    return {"max_abs": 0.0 if not bad else math.inf, "max_rel": 0.0 if not bad else math.inf,
            "mean_delta": 0.0, "step_max_abs": bad[0] if bad else None, "first_outside": bad[0]
            if bad else None, "tolerance": "equal"}


def _numeric_metric(col: str, x: pd.Series, y: pd.Series, gone_a, gone_b, steps, one, t: dict,
                    envelope: noise.Envelope | None, k_noise: float) -> tuple[dict, list[int], str] | None:
    """A numeric metric over the shared steps, against tolerance `t` (and K times the envelope, calibrated): its
    figures, the steps it is outside (a NaN or inf a run computed, on either side, is outside: a divergence, never
    parity; so is a step only one side has, `one`), and a note on its first NaN or inf ("" without one). None
    when no step has a finite value on both sides and neither computed a NaN or inf."""
    xv, yv = x.to_numpy(), y.to_numpy()
    nan_steps = steps[(~gone_a & ~np.isfinite(xv)) | (~gone_b & ~np.isfinite(yv))]
    both = pd.Series(np.isfinite(xv) & np.isfinite(yv) & ~gone_a & ~gone_b, index=x.index)
    bad_steps = sorted({int(s) for s in nan_steps} | {int(s) for s in one})
    if not both.any() and not nan_steps.size:
        return None
    note = ""
    if nan_steps.size:
        s0 = nan_steps[0]
        note = (f"{col} at step {s0} (A={_val(x[s0], gone_a[steps.get_loc(s0)])}, "
                f"B={_val(y[s0], gone_b[steps.get_loc(s0)])})")
    if both.any():
        d = (x - y).abs()[both]
        rel = (d / y.abs()[both]).replace([np.inf], np.nan).where(d > 0, 0.0)
        floor = (t.get("atol", 0.0) + t.get("rtol", 0.0) * y.abs()[both]).to_numpy()
        env = envelope.at(col, d.index, y[both].to_numpy()) if envelope is not None else None
        limit = noise.bound(floor, env, k_noise)
        outside = d.to_numpy() > limit
        bad_steps = sorted(set(bad_steps) | {int(s) for s in d.index[outside]})
        metric = {
            "max_abs": float(d.max()), "step_max_abs": int(d.idxmax()),
            "max_rel": float(rel.max()) if rel.notna().any() else 0.0,
            "step_max_rel": int(rel.idxmax()) if rel.notna().any() and rel.max() > 0 else None,
            "mean_delta": float((x - y)[both].mean()),
        }
        if env is not None:
            metric.update(_noise_figures(d.to_numpy(), env, k_noise, limit))
    else:
        metric = {"max_abs": math.nan, "step_max_abs": None, "max_rel": math.nan, "step_max_rel": None,
                  "mean_delta": math.nan}
    metric.update({"first_outside": bad_steps[0] if bad_steps else None, "tolerance": t,
                   "steps_compared": int(both.sum())})
    if nan_steps.size:
        metric["non_finite_steps"] = [int(s) for s in nan_steps[:20]]
    return metric, bad_steps, note


def _param_metric(param_rel_l2: list[float], limit: float, envelope: noise.Envelope | None, k_noise: float) -> dict:
    """The weights' relative L2 distance at each saved step against its bound (`limit`, and K times the envelope)."""
    arr = np.asarray(param_rel_l2, dtype=float)
    env = envelope.at("param_rel_l2", range(1, len(arr) + 1)) if envelope is not None else None
    bound = noise.bound(limit, env, k_noise)
    over = np.nonzero(arr > bound)[0]
    metric = {"max_abs": float(arr.max()), "step_max_abs": int(arr.argmax()) + 1,
              "max_rel": float(arr.max()), "mean_delta": float(arr.mean()),
              "first_outside": int(over[0]) + 1 if len(over) else None,
              "tolerance": {"max": limit}}
    if env is not None:
        metric.update(_noise_figures(arr, env, k_noise, bound))
    return metric


def param_limit(tol: dict, mode: str, dtype: str, calibrated: bool = False) -> float:
    """The static bound on the weights' relative L2 distance; calibrated runs use [calibrated]'s floor (the envelope
    does the rest), static runs the dtype's own (loose in bf16, where nothing measures the run's noise)."""
    if calibrated and "param_rel_l2_floor" in tol.get("calibrated", {}):
        return float(tol["calibrated"]["param_rel_l2_floor"])
    return float(tol.get(mode, {}).get(dtype, {}).get("param_rel_l2", {}).get("max", 1e-5))


def _noise_figures(d: np.ndarray, env: np.ndarray, k: float, bound) -> dict:
    """How the difference stands against the noise: its largest ratio to the envelope (where the envelope is not 0),
    to the bound that decided (above 1: outside), and the envelope at the last step (the smallest difference this
    run could have shown is k times it)."""
    ok = env > 0
    ratio = float(np.max(d[ok] / env[ok])) if ok.any() else None
    bound = np.broadcast_to(np.asarray(bound, dtype=float), d.shape)
    pos = bound > 0
    return {"noise_last": float(env[-1]) if len(env) else 0.0, "ratio_to_noise": ratio, "k_noise": k,
            "ratio_to_bound": float(np.max(d[pos] / bound[pos])) if pos.any() else None}


def _bare(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy(deep=False)
    out.attrs = {}
    return out


def _val(v, absent: bool) -> str:
    return "not logged" if absent else repr(float(v)) if isinstance(v, (int, float, np.floating)) else repr(v)


def compare_runs(run_a, run_b, *, mode: str = "lockstep", dtype: str | None = None,
                 tolerance_file: str | Path | None = None, envelope: noise.Envelope | None = None,
                 held: tuple | None = None) -> dict:
    """Two runs of the built-in sides (the matrix, attribution): a metric or value one side lacks is a divergence.
    `envelope`: the pair's noise twin (calibrated tolerance), else the static bounds alone. `held`: (a's log, b's
    log, the weights' relative distance per step or None) where the caller has them in hand (a cell's pair)."""
    from harness.runlog.params import relative_l2

    if held is not None:
        a, b, rel = held
    else:
        a, b = load_any_run(run_a), load_any_run(run_b)
        rel = relative_l2(run_a, run_b) if Path(run_a).is_dir() and Path(run_b).is_dir() else None
    if dtype is None:
        dtype = (a.attrs.get("manifest", {}).get("spec") or {}).get("DTYPE", "float32")
    out = compare_frames(a, b, mode=mode, dtype=dtype, tolerances=load_tolerances(tolerance_file), param_rel_l2=rel,
                         envelope=envelope)
    out["runs"] = [str(run_a), str(run_b)]
    return out


def format_comparison(result: dict, names=("A", "B"), top: int = 15) -> str:
    lines = []
    fd = result["first_divergence"]
    unit = "round" if result.get("align") == "round" else "step"
    if result["mode"] == "free":
        how = f"free, {result['seeds'][0]} vs {result['seeds'][1]} seeds, {result['steps'][0]} {unit}s; {result['statistic']}"
    else:
        how = f"{result['mode']}, {result['dtype']}; {result['steps'][0]} vs {result['steps'][1]} {unit}s"
    lines.append(f"verdict: {'parity' if fd is None else 'diverged'} ({how})")
    if fd:
        lines.append(f"first divergence: {unit} {fd['step']}, {fd['metric']}")
    for s in result.get("suspected", []):
        lines.append(f"suspected: {s['check']} ({s['evidence']})")
    if result.get("suspected"):
        lines.append("  (from the curves alone: compare re-runs nothing; `python -m harness parity` confirms a cause by "
                     "re-running with it aligned)")
    for n in result["notes"]:
        lines.append(f"note: {n}")
    if result.get("one_sided") == "not_compared":
        why = result.get("not_compared_why") or {m: "" for m in result.get("not_compared", [])}
        for code, words in (("a", f"only {names[0]} logs them"), ("b", f"only {names[1]} logs them"),
                            ("steps", f"never logged by both at one {unit}"), ("", "")):
            listed = [m for m, w in why.items() if w == code]
            if listed:
                lines.append(f"not compared{f' ({words})' if words else ''}: {', '.join(listed)}")
    elif result["only_in_a"] or result["only_in_b"]:
        lines.append(f"only in {names[0]}: {', '.join(result['only_in_a']) or '-'}")
        lines.append(f"only in {names[1]}: {', '.join(result['only_in_b']) or '-'}")
    lines.append(f"{'metric':42s} {'max |delta|':>12s} {'at ' + unit:>8s} {'max rel':>10s} {'mean delta':>12s} "
                 f"{'first outside':>14s}")
    ordered = sorted(result["metrics"].items(), key=lambda kv: (kv[1]["first_outside"] is None,
                                                                 kv[1]["first_outside"] or 0, kv[0]))
    for name, m in ordered[:top] if top else ordered:
        fo = m["first_outside"]
        at = m.get("step_max_abs")
        lines.append(f"{name:42s} {m['max_abs']:>12.3g} {'-' if at is None else str(at):>8s} "
                     f"{m['max_rel']:>10.3g} {m['mean_delta']:>12.3g} {'-' if fo is None else str(fo):>14s}")
    return "\n".join(lines)
