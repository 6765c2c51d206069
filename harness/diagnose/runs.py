"""A run's metric log, in any of the formats `compare` reads, as a frame indexed by step with the harness's names.

`load_any_run` reads:
- a run folder the harness wrote (`metrics.jsonl` + `manifest.json`), or its `metrics.jsonl`;
- any other JSONL file (one JSON object per logged row) or CSV file (a header row), e.g. a W&B export;
- a TRL `trainer_state.json` (its `log_history`), or the folder holding it;
- TensorBoard event files (TRL's default report_to when tensorboard is installed), or a folder holding them.

Names: `--map OURS=THEIRS` renames a log's column THEIRS to the harness/TRL metric name OURS (in both logs,
where present). Without a map, TRL's log_history keys are the harness's names already; W&B columns lose their
`train/` prefix (`train/epoch` becomes `trl/epoch`, TRL's epoch); the step is the first of `step`,
`train/global_step`, `global_step`, `iteration`, `_step`; W&B bookkeeping (`_runtime`, `_timestamp`, any
column starting with `_`) and the Trainer's end-of-training summary (`train_runtime`, ...) are dropped, and
so are text columns of other people's logs (a run name, say; `prompt_ids_hash` is kept).

Missing and non-finite values: a value a log does not have (an absent key, a JSON null outside harness
logs, an empty CSV cell) is absent and not compared at that step. A NaN or inf a run computed (JSON
NaN/Infinity, "nan"/"inf" in a CSV, a null in a harness log, whose writer stores them so) is a divergence
at that step on either side, both sides included, never parity. `df.attrs["absent"]` ({metric: [steps]},
set by `load_any_run`) carries the difference; in a frame without it every NaN is a computed one.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

# a log's step: the first of these it has (W&B: the Trainer's train/global_step before wandb's own _step)
STEP_COLUMNS = ("step", "train/global_step", "global_step", "iteration", "_step")
# the Trainer's end-of-training summary (W&B: train/train_runtime, ...): one row, not a per-step metric
SUMMARY_KEYS = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                          "train_loss"})
TEXT_METRICS = frozenset({"prompt_ids_hash"})  # text the comparator compares (by equality)


class CompareInputError(ValueError):
    """A run that cannot be compared; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# reading logs: the harness's, JSONL, CSV, TRL's trainer_state.json
# ---------------------------------------------------------------------------------------------
def load_any_run(path: str | Path, mapping: dict | None = None) -> pd.DataFrame:
    """A harness run folder, a metrics.jsonl or any JSONL, a CSV, or a TRL trainer_state.json (or its folder), as
    a frame indexed by step with the harness's metric names. `mapping`: {OURS: THEIRS} column renames."""
    from harness.runlog.log import MANIFEST_FILE, METRICS_FILE, read_metrics

    path = Path(path)
    mapping = dict(mapping or {})
    log = path / METRICS_FILE if path.is_dir() else path
    if log.is_file() and log.suffix == ".jsonl":
        manifest_path = log.parent / MANIFEST_FILE
        harness = log.name == METRICS_FILE and manifest_path.exists()  # RunWriter's log: a null is a NaN or inf
        try:
            rows, problems = read_metrics(log) if harness else _read_jsonl(log)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CompareInputError(f"{log}: cannot be read ({e})") from None
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if harness else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CompareInputError(f"{manifest_path}: cannot be read ({e}); remove it to compare the metric log "
                                    "alone") from None
        if not isinstance(manifest, dict):
            raise CompareInputError(f"{manifest_path}: not a JSON object (a harness manifest is one); remove it to "
                                    "compare the metric log alone")
        return _frame(rows, log, mapping, harness=harness, manifest=manifest, problems=problems)
    if path.is_file() and path.suffix.lower() == ".csv":
        rows, problems = _read_csv(path)
        return _frame(rows, path, mapping, problems=problems)
    events = tensorboard_files(path)
    if events:  # TRL's default report_to when tensorboard is installed: train/loss, train/grad_norm, ...
        rows = _read_tensorboard(path, events)
        return _frame(rows, path, mapping, trl_history=True, manifest={"source": str(path)})
    state = path / "trainer_state.json" if path.is_dir() else path
    if not state.exists():
        raise CompareInputError(f"{path}: neither a harness run (metrics.jsonl) nor a TRL trainer_state.json "
                                "(nor a .jsonl or .csv log, nor TensorBoard event files)")
    try:
        history = json.loads(state.read_text())["log_history"]
        if not isinstance(history, list):
            raise TypeError("log_history is not a list")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CompareInputError(f"{state}: not a trainer_state.json with log_history ({e})") from None
    loss = mapping.get("loss", "loss")  # training rows carry the loss; eval rows and the summary do not
    rows = [h for h in history if isinstance(h, dict) and loss in h]
    return _frame(rows, state, mapping, trl_history=True, manifest={"side": "trl", "source": str(state)})


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    from harness.runlog.log import read_metrics  # one JSON object per line, whatever wrote it

    return read_metrics(path)


def _read_csv(path: Path) -> tuple[list[dict], list[str]]:
    """Rows of a CSV: an empty cell is absent; a column whose cells all read as numbers ("nan", "inf" included)
    is numeric."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            raw = list(reader)
            header = [h for h in (reader.fieldnames or []) if h is not None]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CompareInputError(f"{path}: cannot be read as CSV ({e})") from None
    numeric = {}
    for col in header:
        try:
            [float(r[col]) for r in raw if (r.get(col) or "").strip()]
            numeric[col] = True
        except (TypeError, ValueError):
            numeric[col] = False
    rows = [{col: float(r[col]) if numeric[col] else r[col] for col in header if (r.get(col) or "").strip()}
            for r in raw]
    return rows, []


def _as_step(value):
    """A step value as int (or float when fractional); None when it is not a finite number, or one too large to
    count steps (beyond 2**53 a float no longer holds every whole number, nor an int64 index this one)."""
    if isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(v) or abs(v) >= 2**53:
        return None
    return int(v) if v.is_integer() else v


def _names(columns: list[str], mapping: dict, trl_history: bool) -> tuple[dict, list[str]]:
    """{column in the log: harness name} for the columns kept, and the map's THEIRS names found here."""
    renamed = {}
    for ours, theirs in mapping.items():
        for cand in (theirs, f"train/{theirs}"):
            if cand in columns:
                renamed[cand] = ours
                break
    names = {}
    for c in columns:
        if c in renamed:
            names[c] = renamed[c]
        elif c == "train/epoch" or (trl_history and c == "epoch"):
            names[c] = "trl/epoch"  # TRL's epoch; the harness's `epoch` counts prompts seen
        elif c.startswith("train/") and c != "train/global_step":
            names[c] = c[len("train/"):]
        else:
            names[c] = c
    # one name from several columns: a mapped one wins, then one that had its name already
    chosen: dict[str, str] = {}
    for c in sorted(names, key=lambda c: 0 if c in renamed else 1 if names[c] == c else 2):
        chosen.setdefault(names[c], c)
    keep = {c: n for n, c in chosen.items()}
    if "step" not in keep.values():
        for cand in STEP_COLUMNS[1:]:
            src = next((c for c, n in keep.items() if n == cand), None)
            if src is not None:
                keep[src] = "step"
                break
    keep = {c: n for c, n in keep.items() if n == "step" or not (n.startswith("_") or n in STEP_COLUMNS or
                                                                    n in SUMMARY_KEYS)}
    return keep, sorted(renamed)


def tensorboard_files(path: Path) -> list[Path]:
    """The TensorBoard event files of a run: `path` itself, or those under the folder (TRL writes them to
    `<output_dir>/runs/<date_host>/`)."""
    if path.is_file():
        return [path] if path.name.startswith("events.out.tfevents") else []
    return sorted(path.rglob("events.out.tfevents*")) if path.is_dir() else []


def _read_tensorboard(path: Path, events: list[Path]) -> list[dict]:
    """Scalar summaries as rows {"step": s, tag: value}, read by TensorBoard's own EventAccumulator (every value
    kept; a tag written twice at one step keeps its last value)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise CompareInputError(f"{path}: TensorBoard event files; reading them needs the tensorboard package "
                                "(pip install 'tensorboard>=2.14,<3')") from None
    by_step: dict[int, dict] = {}
    for folder in sorted({e.parent for e in events}):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        try:
            acc.Reload()
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
            raise CompareInputError(f"{folder}: TensorBoard event files that cannot be read ({e})") from None
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                by_step.setdefault(int(ev.step), {"step": int(ev.step)})[tag] = float(ev.value)
    if not by_step:
        raise CompareInputError(f"{path}: TensorBoard event files with no scalar summaries")
    return [by_step[s] for s in sorted(by_step)]


def _frame(rows: list[dict], source: Path, mapping: dict, *, harness: bool = False, trl_history: bool = False,
           manifest: dict | None = None, problems: list[str] | None = None) -> pd.DataFrame:
    """Rows (absent key: not logged; NaN/inf: computed) -> a frame indexed by step, harness names, attrs."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    keep, mapped = _names(columns, mapping, trl_history)
    if rows and "step" not in keep.values():
        shown = ", ".join(columns[:25]) + (f", ... ({len(columns)} columns)" if len(columns) > 25 else "")
        raise CompareInputError(f"{source}: no step column (it has: {shown}); name the column that counts "
                                "optimizer steps with --map step=COLUMN")
    by_step: dict = {}
    no_step = 0
    for r in rows:
        row = {}
        for k, v in r.items():
            name = keep.get(k)
            if name is None:
                continue
            if v is None:
                if not harness:  # pandas and W&B write a missing value as null
                    continue
                v = math.nan  # RunWriter writes NaN and inf as null
            row[name] = v
        step = _as_step(row.get("step"))
        if step is None:
            no_step += 1
            continue
        row["step"] = step
        by_step.setdefault(step, {}).update(row)  # rows of one step (W&B logs several): one row
    notes = list(problems or [])
    if no_step and not harness:
        notes.append(f"{source}: {no_step} row(s) without a step value skipped")
    skipped = [] if harness else _numeric_columns(by_step)
    if skipped:
        notes.append(f"{source}: text columns not compared: {', '.join(skipped[:8])}" + (" ..." if len(skipped) > 8
                                                                                          else ""))
    df = _build(by_step)
    if df.empty:
        raise CompareInputError(f"{source}: the run has no logged steps")
    df.attrs.update(manifest=manifest or {}, problems=notes, source=str(source), columns=columns, mapped=mapped,
                    skipped=skipped)
    return df


def _numeric_columns(by_step: dict) -> list[str]:
    """Drop text and nested columns of another's log (in place), numbers written as strings read as numbers;
    returns the names dropped."""
    kinds: dict[str, set] = {}
    for row in by_step.values():
        for k, v in row.items():
            kinds.setdefault(k, set()).add(type(v))
    dropped = []
    for k, types in kinds.items():
        if k == "step" or k in TEXT_METRICS or types <= {int, float, bool}:
            continue
        if types <= {int, float, bool, str}:
            try:
                for row in by_step.values():
                    if isinstance(row.get(k), str):
                        float(row[k])
            except ValueError:
                pass
            else:
                for row in by_step.values():
                    if isinstance(row.get(k), str):
                        row[k] = float(row[k])
                continue
        dropped.append(k)
        for row in by_step.values():
            row.pop(k, None)
    return sorted(dropped)


def _build(by_step: dict) -> pd.DataFrame:
    """{step: row} -> a frame indexed by step; attrs["absent"]: per metric, the steps its log has no value at."""
    steps = sorted(by_step)
    df = pd.DataFrame([by_step[s] for s in steps])
    if df.empty:
        return df
    df = df.set_index("step", drop=False)
    absent = {}
    for c in df.columns:
        miss = [s for s in steps if c not in by_step[s]]
        if miss:
            absent[c] = miss
    df.attrs["absent"] = absent
    return df


def absent_at(df: pd.DataFrame, metric: str, steps) -> np.ndarray:
    """True where the log has no value for `metric` (not logged at that step, as opposed to a NaN it computed)."""
    return _absent((df.attrs.get("absent") or {}).get(metric), steps)


def _absent(miss, steps) -> np.ndarray:
    if not miss:
        return np.zeros(len(steps), dtype=bool)
    return np.isin(np.asarray(list(steps), dtype=float), np.asarray(miss, dtype=float))
