"""Fuzzing (hypothesis) of every input the harness reads (issue 19, item 3).

Inputs: spec TOML (`validate`; random types, ranges, unknown keys, unicode, huge values, broken bytes, `--set`),
metric logs for `compare` (JSONL, CSV, run folders with their manifest, TRL trainer_state.json: missing columns,
wrong types, NaN/inf, duplicated or unordered steps, binary junk, truncated last line), lockstep rollout files
(`ReplaySource.from_file`, and `run --rollouts` where the reader refuses), verdict.json given to `parity --resume`
and to the runs index, and user reward functions (None, NaN, wrong length, exceptions, slow).

The property, for each: the command returns 0, 1 or 2 (any other exception fails), on 2 with a one-line message on
stderr, within a time bound, writing nothing outside its own folder (the working directory, an empty temporary
folder, stays empty). `parity --resume` runs with `run_cell` replaced by a stand-in that returns the expected
verdict at once: the resume logic, the verdict, the summary and the report are real, the training is not.

Profiles: `ci` (the default: 40 examples a test, 10 where each writes a report; derandomized, so a CI run is
deterministic; about 40 s on 2 cores) and `fuzz` (`make fuzz`: HYPOTHESIS_PROFILE=fuzz, thousands of examples).
With FUZZ_SAVE=1 (`make fuzz` sets it) each failing input is written to tests/fuzz_corpus/<kind>/ (one file per
failure, the smallest seen as hypothesis shrinks it); every file there is replayed through the same property by
`test_corpus`, so each bug found stays a regression example.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import re
import tempfile
import time
import tomllib
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from conftest import DEFAULT_SPEC, ROOT

CORPUS = ROOT / "tests" / "fuzz_corpus"
SAVE = os.environ.get("FUZZ_SAVE") == "1"
COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.register_profile("ci", max_examples=40, derandomize=True, database=None, **COMMON)
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "3000")), **COMMON)
settings.load_profile(PROFILE)
# a test whose every input writes a report (matplotlib figures, ~0.5 s) runs fewer in CI
FEW = settings(max_examples=10) if PROFILE == "ci" else settings()
TIME_BOUND_S = 20.0  # per input (a report with matplotlib figures included)


# ---------------------------------------------------------------------------------------------
# the property
# ---------------------------------------------------------------------------------------------
def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def call_cli(argv: list[str], where: Path) -> tuple[int, str, str]:
    """harness.cli.main(argv) from an empty working directory inside `where`; checks the property and returns
    (exit code, stdout, stderr)."""
    from harness.cli import main

    cwd = where / "cwd"
    cwd.mkdir()
    old, out, err = os.getcwd(), io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse
                rc = e.code
    finally:
        os.chdir(old)
    took = time.perf_counter() - t0
    stdout, stderr = out.getvalue(), err.getvalue()
    assert rc in (0, 1, 2), f"exit code {rc!r}; stderr: {stderr[-500:]}"
    if rc == 2:
        assert stderr.strip() and "\n" not in stderr.strip(), f"exit 2 needs a one-line message; stderr: {stderr!r}"
    assert "Traceback" not in stderr, stderr[-1500:]
    assert took < TIME_BOUND_S, f"{took:.1f} s"
    assert not list(cwd.iterdir()), f"wrote into the working directory: {_files(cwd)}"
    if currently_in_test_context():  # (--hypothesis-show-statistics: how the inputs spread over the outcomes)
        event(f"{argv[0]}: exit {rc}")
    return rc, stdout, stderr


def _keep(kind: str, name: str, data: bytes, error: BaseException) -> None:
    """With FUZZ_SAVE=1: the failing input into the corpus, one file per failure (type and message's first line),
    kept smallest as hypothesis shrinks it."""
    first = (str(error).strip().splitlines() or [""])[0]
    first = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "", first)[:120]  # names, sizes and offsets change as it shrinks
    key = hashlib.sha256(f"{kind}:{type(error).__name__}:{first}".encode()).hexdigest()[:12]
    folder = CORPUS / kind
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"found-{key}.*"))
    if found and found[0].stat().st_size <= len(data):
        return
    for f in found:
        f.unlink()
    (folder / f"found-{key}{Path(name).suffix}").write_bytes(data)


@contextlib.contextmanager
def corpus_on_failure(kind: str, name: str, data: bytes):
    if os.environ.get("FUZZ_TRACE"):  # the input about to run, for a fuzz run killed by a hang or the OOM killer
        Path(os.environ["FUZZ_TRACE"], f"last-{kind}{Path(name).suffix}").write_bytes(data)
    try:
        yield
    except BaseException as e:
        if SAVE and not isinstance(e, KeyboardInterrupt):
            _keep(kind, name, data, e)
        raise


def _workdir(tmp_path: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=tmp_path))


# ---------------------------------------------------------------------------------------------
# strategies shared by the inputs
# ---------------------------------------------------------------------------------------------
WORDS = ["", "cpu", "cuda", "auto", "embedded", "local", "file", "gsm8k", "synthetic", "vllm", "emulated", "policy",
         "naive", "matched", "token", "sequence", "grpo", "dapo", "bnpo", "dr_grpo", "float32", "bfloat16", "float16",
         "correctness", "format", "x.py:f", "os:system", "../../outside", "/dev/null", "\u202eevil", "nul\x00byte",
         "<script>alert(1)</script>", "step", "loss", "reward", "nan", "inf", "-1", "1e400"]
SPECIAL = [0, 1, -1, 2, 3, 2**31, 2**63 - 1, 2**64, -(2**63), 10**30, 1e308, -0.0, 5e-324, 1e-9, 0.5]
scalars = st.one_of(st.integers(-10, 100), st.integers(), st.floats(), st.booleans(), st.text(max_size=20),
                    st.sampled_from(WORDS), st.sampled_from(SPECIAL))
json_values = st.recursive(st.one_of(scalars, st.none()), lambda ch: st.lists(ch, max_size=4) |
                           st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=8)
toml_values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) |
                           st.dictionaries(st.text(max_size=8), ch, max_size=3), max_leaves=6)


@st.composite
def corrupted(draw, data: bytes) -> bytes:
    """The bytes as they are, or cut, spliced with junk, stripped of the last byte, or replaced by junk."""
    how = draw(st.sampled_from(["same"] * 12 + ["cut", "junk", "last", "binary", "bom"]))
    if how == "cut" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "junk":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    if how == "last" and data:
        return data.rstrip(b"\n")[:-1]
    if how == "binary":
        return draw(st.binary(max_size=64))
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    return data


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_doc(doc: dict) -> str:
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"[{json.dumps(k, ensure_ascii=False)}]")
            lines += [f"{json.dumps(kk, ensure_ascii=False)} = {toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# 1. spec TOML: `validate`
# ---------------------------------------------------------------------------------------------
BASE_SPEC = tomllib.loads(DEFAULT_SPEC.read_text())
TRL_KEYS = ["loss_type", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
            "num_generations", "beta", "epsilon", "max_completion_length", "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode", "output_dir", "logging_dir", "report_to", "seed", "no_such_field"]


def _spec_keys() -> list[tuple]:
    from harness.experiment.spec import load_spec

    full = load_spec(DEFAULT_SPEC).to_dict()
    keys = [(k,) for k, v in full.items() if not isinstance(v, dict)]
    keys += [(t, k) for t, v in full.items() if isinstance(v, dict) for k in v]
    return keys + [("trl", k) for k in TRL_KEYS] + [(t,) for t, v in full.items() if isinstance(v, dict)]


SPEC_KEYS = _spec_keys()


@st.composite
def spec_bytes(draw) -> bytes:
    doc = json.loads(json.dumps(BASE_SPEC))
    doc.setdefault("trl", {})
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["set", "set", "set", "drop", "unknown"]))
        key = draw(st.sampled_from(SPEC_KEYS))
        node = doc
        for part in key[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        if op == "set":
            node[key[-1]] = draw(toml_values)
        elif op == "drop":
            node.pop(key[-1], None)
        else:
            node[draw(st.text(min_size=1, max_size=12))] = draw(toml_values)
    return draw(corrupted(toml_doc(doc).encode("utf-8")))


def check_spec(data: bytes, where: Path, sets: list[str] = ()) -> None:
    spec = where / "spec.toml"
    spec.write_bytes(data)
    with corpus_on_failure("spec", "spec.toml", data):
        call_cli(["validate", "--spec", str(spec), *(f"--set={s}" for s in sets)], where)
        assert _files(where).keys() <= {"spec.toml"}, _files(where)


@given(data=spec_bytes(), sets=st.lists(st.one_of(st.sampled_from(["STEPS=2", "STEPS=0", "STEPS=1e9", "LR=nan",
                                                                    "model.layers=\"x\"", "trl.loss_type=3", "=",
                                                                    "NOPE=1", "STEPS", "data.size=99999999999"]),
                                                   st.text(max_size=20)), max_size=2))
def test_spec(tmp_path, data, sets):
    check_spec(data, _workdir(tmp_path), sets)


# ---------------------------------------------------------------------------------------------
# 2. metric logs: `compare`
# ---------------------------------------------------------------------------------------------
COLUMNS = ["step", "loss", "reward", "grad_norm", "train/loss", "train/global_step", "_step", "global_step",
           "iteration", "prompt_ids_hash", "completions/mean_length", "round", "epoch", "entropy", "é", "a,b",
           "q\"x", "train/train_runtime", "_runtime"]
values = st.one_of(st.floats(), st.integers(-5, 60), st.none(), st.text(max_size=6), st.booleans(),
                   st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e308, 2**70]), st.lists(st.floats(), max_size=2))


@st.composite
def metric_rows(draw, shape: tuple) -> list[dict]:
    """Mostly a plausible log (steps 1..n, a few metrics: `shape`, shared by the two sides, values close), then
    bent: steps duplicated, reordered, dropped or of the wrong type, cells of the wrong type, NaN and inf, extra
    and missing columns."""
    n, step_col, metrics = shape
    rows = [{step_col: s + 1, **{m: 1.0 + s + draw(st.sampled_from([0.0, 0.0, 1e-7, 0.3])) for m in metrics}}
            for s in range(n)]
    for _ in range(draw(st.integers(0, 4))):
        if not rows:
            break
        i = draw(st.integers(0, len(rows) - 1))
        how = draw(st.sampled_from(["value", "dup", "swap", "drop_key", "new_key", "row"] if isinstance(rows[i], dict)
                                   else ["dup", "swap"]))
        if how == "value":
            rows[i][draw(st.sampled_from([step_col, *metrics]))] = draw(values)
        elif how == "dup":
            rows.insert(i, json.loads(json.dumps(rows[i])))
        elif how == "swap":
            j = draw(st.integers(0, len(rows) - 1))
            rows[i], rows[j] = rows[j], rows[i]
        elif how == "drop_key" and rows[i]:
            rows[i].pop(draw(st.sampled_from(sorted(rows[i]))))
        elif how == "new_key":
            rows[i][draw(st.sampled_from(COLUMNS) | st.text(max_size=6))] = draw(values)
        else:
            rows[i] = draw(json_values)
    return rows


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _csv(rows) -> bytes:
    rows = [r for r in rows if isinstance(r, dict)]
    header = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header)
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if v is None else v for k, v in r.items()})
    return buf.getvalue().encode()


@st.composite
def metric_input(draw, shape: tuple) -> dict:
    """{relative path: bytes} of one side, and the path to give `compare`."""
    rows = draw(metric_rows(shape))
    form = draw(st.sampled_from(["jsonl", "jsonl", "csv", "csv", "run", "run", "trainer_state"]))
    if form == "jsonl":
        return {"files": {"log.jsonl": draw(corrupted(_jsonl(rows)))}, "arg": "log.jsonl"}
    if form == "csv":
        return {"files": {"log.csv": draw(corrupted(_csv(rows)))}, "arg": "log.csv"}
    if form == "run":
        manifest = draw(st.sampled_from([{"side": "scratch", "status": "finished", "spec": {"DTYPE": "float32"}}] * 3 +
                                        [{}, {"spec": {"DTYPE": "bfloat16"}}]) | json_values)
        return {"files": {"run/metrics.jsonl": draw(corrupted(_jsonl(rows))),
                          "run/manifest.json": draw(corrupted(json.dumps(manifest).encode()))}, "arg": "run"}
    state = {"log_history": draw(st.sampled_from([rows] * 4 + [[], {}]) | json_values)}
    return {"files": {"state/trainer_state.json": draw(corrupted(json.dumps(state).encode()))}, "arg": "state"}


@st.composite
def compare_case(draw) -> dict:
    shape = (draw(st.sampled_from([3, 4, 2, 5, 1, 6, 0])),
             draw(st.sampled_from(["step"] * 5 + ["_step", "train/global_step", "iteration", "steps"])),
             draw(st.lists(st.sampled_from(COLUMNS[1:]), min_size=1, max_size=4, unique=True)))
    a, b = draw(metric_input(shape)), draw(metric_input(shape))
    args = []
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        args.append("--map=" + draw(st.sampled_from(["loss=train_loss", "step=iteration", "step=_step", "x=y",
                                                    "=", "loss", "step=step"]) | st.text(max_size=8)))
    if draw(st.integers(0, 3)) == 0:
        args += ["--align", "round"]
        if draw(st.booleans()):
            args.append("--steps-per-round=" + draw(st.sampled_from(["1", "2", "0", "-1", "x", "1,2", "2,0", ""])))
    if draw(st.integers(0, 9)) == 0:
        args += ["--out", "out"]  # the report, with every figure
    return {"a": {k: base64.b64encode(v).decode() for k, v in a["files"].items()}, "a_arg": a["arg"],
            "b": {k: base64.b64encode(v).decode() for k, v in b["files"].items()}, "b_arg": b["arg"], "args": args}


def check_compare(case: dict, where: Path) -> None:
    raw = json.dumps(case, indent=1).encode()
    with corpus_on_failure("compare", "case.json", raw):
        for side in ("a", "b"):
            for rel, b64 in case[side].items():
                p = where / side / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(base64.b64decode(b64))
        args = [a if a != "out" else str(where / "out") for a in case["args"]]
        before = set(_files(where))
        call_cli(["compare", str(where / "a" / case["a_arg"]), str(where / "b" / case["b_arg"]), *args], where)
        new = set(_files(where)) - before
        assert all(f.startswith("out/") for f in new), new


@given(case=compare_case())
def test_compare(tmp_path, case):
    check_compare(case, _workdir(tmp_path))


# ---------------------------------------------------------------------------------------------
# 3. lockstep rollout files: the reader, and `run --rollouts` where it refuses
# ---------------------------------------------------------------------------------------------
ids = st.lists(st.lists(st.integers(0, 40), max_size=4), min_size=1, max_size=3)


@st.composite
def rollout_bytes(draw) -> bytes:
    records = []
    for r in range(draw(st.integers(0, 3))):
        prompts = draw(ids)
        comps = [draw(st.lists(st.integers(0, 40), max_size=4)) for _ in prompts]
        logps = draw(st.one_of(st.none(), st.just([[-0.5] * len(c) for c in comps])))
        rec = {"round": r, "prompt_ids": prompts, "completion_ids": comps, "logprobs": logps}
        if draw(st.integers(0, 2)) == 0:
            rec[draw(st.sampled_from(["round", "prompt_ids", "completion_ids", "logprobs", "extra"]))] = draw(json_values)
        records.append(rec if draw(st.integers(0, 9)) else draw(json_values))
    return draw(corrupted(_jsonl(records)))


def check_rollouts(data: bytes, where: Path) -> None:
    from harness.rollouts.lockstep import ReplaySource, _record_problem

    path = where / "rollouts.jsonl"
    path.write_bytes(data)
    with corpus_on_failure("rollouts", "rollouts.jsonl", data):
        try:
            records = ReplaySource.from_file(path).records
        except (OSError, ValueError):  # the CLI says so in one line (exit 2), before any model loads
            rc, _out, _err = call_cli(["run", "scratch", "--spec", str(DEFAULT_SPEC), "--rollouts", str(path), "--out",
                                       str(where / "out"), "--steps", "1", "--quiet"], where)
            assert rc == 2
            assert not (where / "out").exists()
        else:
            assert all(_record_problem(r) is None for r in records)


@given(data=rollout_bytes())
def test_rollouts(tmp_path, data):
    check_rollouts(data, _workdir(tmp_path))


# ---------------------------------------------------------------------------------------------
# 4. verdict.json: `parity --resume` and the runs index
# ---------------------------------------------------------------------------------------------
CELLS = ["matched", "loss_type=dapo"]


def _base_verdict() -> dict:
    from conftest import small_spec

    spec = small_spec("STEPS=2")
    cell = {"name": "matched", "dir": "matched", "toggles": {"batch": "matched", "loss_type": "grpo", "is": "off"},
            "expected": "parity", "expected_cause": None, "sides": ["scratch", "trl"], "verdict": "parity",
            "first_divergence": None, "attribution": [], "attribution_detail": [], "metrics": {}, "only_in": {},
            "notes": [], "ok": True, "wall_s": 1.0}
    return {"ok": False, "complete": False, "cells_done": 1, "cells_total": 2, "spec": "default", "matrix": "default",
            "mode": "lockstep", "base_spec": spec.to_dict(), "processes": 1, "cells_selected": CELLS, "cells": [cell],
            "elapsed_s": 1.0, "versions": {}}


BASE_VERDICT = _base_verdict()
VERDICT_PATHS = [(k,) for k in BASE_VERDICT] + [("cells", 0, k) for k in BASE_VERDICT["cells"][0]] + \
    [("cells", 0, k) for k in ("cannot_show", "precision", "updates", "tolerance", "error", "traceback")] + \
    [("base_spec", k) for k in ("STEPS", "NAME", "LOSS_NORM", "trl", "model", "rewards")] + [("cells", 0), ("cells", 1)]


@st.composite
def verdict_bytes(draw) -> bytes:
    doc = json.loads(json.dumps(BASE_VERDICT))
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(VERDICT_PATHS))
        node = doc
        for part in path[:-1]:
            if isinstance(node, dict) and isinstance(part, str):
                node = node.get(part)
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                node = None
        key = path[-1]
        if isinstance(node, dict) and isinstance(key, str):
            if draw(st.integers(0, 4)):
                node[key] = draw(json_values)
            else:
                node.pop(key, None)
        elif isinstance(node, list) and isinstance(key, int):
            if key < len(node):
                node[key] = draw(json_values)
            else:
                node.append(draw(json_values))
    if draw(st.integers(0, 9)) == 0:
        doc = draw(json_values)
    return draw(corrupted(json.dumps(doc).encode()))


def _fake_cell(cell, cell_dir, *a, **k) -> dict:
    cause = cell.expected_cause
    return {"name": cell.name, "dir": str(cell_dir), "toggles": cell.toggles, "expected": cell.expected,
            "expected_cause": cause, "sides": list(cell.sides), "verdict": cell.expected,
            "first_divergence": {"step": 1, "metric": "loss"} if cell.expected == "diverged" else None,
            "attribution": [cause] if cause else [],
            "attribution_detail": [{"cause": cause, "status": "confirmed", "fields": []}] if cause else [],
            "metrics": {}, "only_in": {}, "notes": [], "ok": True, "wall_s": 0.0}


def check_resume(data: bytes, where: Path) -> None:
    run = where / "run"
    run.mkdir()
    (run / "verdict.json").write_bytes(data)
    with corpus_on_failure("verdict", "verdict.json", data):
        rc, _out, _err = call_cli(["parity", "--resume", str(run), "--quiet"], where)
        if rc == 0:
            doc = json.loads((run / "verdict.json").read_text())
            assert doc["complete"] and doc["ok"]


@given(data=verdict_bytes())
def test_resume(tmp_path, monkeypatch, data):
    from harness.diagnose import matrix

    monkeypatch.setattr(matrix, "run_cell", _fake_cell)
    check_resume(data, _workdir(tmp_path))


CELL_FILES = ["scratch/metrics.jsonl", "trl/metrics.jsonl", "scratch/manifest.json", "trl/manifest.json",
              "scratch/completions.jsonl", "trl/completions.jsonl", "trl/mapping.json", "scratch/param_sketch.json",
              "scratch/param_sketch.f32", "trl/param_sketch.json", "trl/param_sketch.f32", "noise_envelope.json",
              "rollouts.jsonl"]


@st.composite
def cell_folder(draw) -> dict:
    """The files of a finished cell that `--resume` keeps and its report reads, some damaged: {path: base64}."""
    rows = [{"step": s, "loss": 0.5 / s, "reward": 0.1 * s, "prompts_in_step": 4} for s in (1, 2)]
    files = {"scratch/metrics.jsonl": _jsonl(rows), "trl/metrics.jsonl": _jsonl(rows),
             "scratch/manifest.json": json.dumps({"side": "scratch", "spec": {"DTYPE": "float32"}}).encode(),
             "trl/manifest.json": json.dumps({"side": "trl", "spec": {"DTYPE": "float32"}}).encode(),
             "scratch/completions.jsonl": _jsonl([{"step": 1, "index": 0, "prompt": "1 + 1", "completion": "2",
                                                   "rewards": {"correctness": 1.0}, "advantage": 0.5}])}
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(CELL_FILES))
        how = draw(st.sampled_from(["json", "rows", "bytes", "corrupt"]))
        if how == "json":
            files[name] = json.dumps(draw(json_values)).encode()
        elif how == "rows":
            files[name] = _jsonl(draw(st.lists(json_values, max_size=3)))
        elif how == "bytes":
            files[name] = draw(st.binary(max_size=40))
        else:
            files[name] = draw(corrupted(files.get(name, b"{}")))
    return {k: base64.b64encode(v).decode() for k, v in files.items()}


def check_cell_folder(case: dict, where: Path) -> None:
    run = where / "run"
    for rel, b64 in case.items():
        (run / "matched" / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / "matched" / rel).write_bytes(base64.b64decode(b64))
    (run / "verdict.json").write_text(json.dumps(BASE_VERDICT))
    with corpus_on_failure("cell", "case.json", json.dumps(case, indent=1).encode()):
        rc, _out, _err = call_cli(["parity", "--resume", str(run), "--quiet"], where)
        assert rc == 0 and (run / "report.html").read_text().rstrip().endswith("</html>")


@FEW
@given(case=cell_folder())
def test_resume_reads_cell_folders(tmp_path, monkeypatch, case):
    from harness.diagnose import matrix

    monkeypatch.setattr(matrix, "run_cell", _fake_cell)
    check_cell_folder(case, _workdir(tmp_path))


def check_index(data: bytes, where: Path) -> None:
    from reports.render import write_index

    for name, content in (("fuzzed", data), ("good", json.dumps({**BASE_VERDICT, "complete": True}).encode())):
        (where / name).mkdir()
        (where / name / "verdict.json").write_bytes(content)
    with corpus_on_failure("index", "verdict.json", data):
        path = write_index(where)
        assert set(_files(where)) <= {"fuzzed/verdict.json", "good/verdict.json", "index.html"}
        if path is not None:
            html = path.read_text()
            assert html.rstrip().endswith("</html>")
            row = re.search(r'>fuzzed</a></td>\s*<td>([^<]*)</td>', html)
            if row and row.group(1) == "OK":  # only a whole run that says it passed reads as one
                doc = json.loads(data)
                assert doc.get("ok") is True and doc.get("complete", True) is True, row.group(0)


@given(data=verdict_bytes())
def test_index(tmp_path, data):
    check_index(data, _workdir(tmp_path))


# ---------------------------------------------------------------------------------------------
# 5. your reward functions: `validate` calls each once on two rows
# ---------------------------------------------------------------------------------------------
RETURNS = ["None", "[None] * n", "[float('nan')] * n", "[1.0] * (n + 1)", "[]", "'ab'", "{'a': 1.0}",
           "(x for x in [1.0] * n)", "[True] * n", "[1j] * n", "[10 ** 400] * n", "['1.0'] * n", "[float('inf')] * n",
           "42", "[1.0] * n", "[0.5, None][:n]", "__import__('numpy').ones(n)", "[[1.0]] * n", "object()",
           "(1 / 0 for _ in completions)", "__import__('decimal').Decimal(1)"]
RAISES = ["ValueError", "KeyError", "ZeroDivisionError", "RecursionError", "MemoryError", "SystemExit",
          "Exception", "BaseException", "StopIteration", "UnicodeDecodeError('x', b'', 0, 1, 'y')"]


@st.composite
def reward_source(draw) -> str:
    how = draw(st.sampled_from(["return", "return", "raise", "sleep", "module"]))
    if how == "module":
        return draw(st.sampled_from(["raise ImportError('no')", "score = 3", "def other(**k):\n    return []",
                                     "def score(:\n", "raise SystemExit(3)", "import no_such_module_xyz", "\x00",
                                     "score = None"])) + "\n"
    body = f"    return {draw(st.sampled_from(RETURNS))}"
    if how == "raise":
        exc = draw(st.sampled_from(RAISES))
        msg = draw(st.text(max_size=30))
        body = f"    raise {exc}" + ("" if "(" in exc else f"({msg!r})")
    if how == "sleep":
        body = f"    import time\n    time.sleep({draw(st.sampled_from([0.01, 0.2, 1000]))})\n" + body
    return f"def score(completions, **kwargs):\n    n = len(completions)\n{body}\n"


def check_reward(source: str, where: Path) -> None:
    (where / "my_rewards.py").write_text(source)
    spec = dict(BASE_SPEC, rewards={"functions": ["correctness", "my_rewards.py:score"], "weights": [1.0, 0.5]})
    (where / "spec.toml").write_text(toml_doc(spec))
    with corpus_on_failure("rewards", "my_rewards.py", source.encode()):
        call_cli(["validate", "--spec", str(where / "spec.toml")], where)
        assert set(_files(where)) - {"spec.toml", "my_rewards.py"} <= {
            f for f in _files(where) if "__pycache__" in f}


@given(source=reward_source())
def test_rewards(tmp_path, monkeypatch, source):
    from harness.experiment import rewards

    monkeypatch.setattr(rewards, "CHECK_SECONDS", 2.0, raising=False)  # a slow function is cut off after this
    check_reward(source, _workdir(tmp_path))


# ---------------------------------------------------------------------------------------------
# the corpus: every input kept, replayed through its property
# ---------------------------------------------------------------------------------------------
CHECKS = {"spec": lambda d, w: check_spec(d, w), "compare": lambda d, w: check_compare(json.loads(d), w),
          "rollouts": check_rollouts, "verdict": check_resume, "index": check_index,
          "cell": lambda d, w: check_cell_folder(json.loads(d), w),
          "rewards": lambda d, w: check_reward(d.decode(), w)}


@pytest.mark.parametrize("path", sorted(p for p in CORPUS.glob("*/*") if p.is_file()),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus(tmp_path, monkeypatch, path):
    from harness.diagnose import matrix
    from harness.experiment import rewards

    monkeypatch.setattr(matrix, "run_cell", _fake_cell)
    monkeypatch.setattr(rewards, "CHECK_SECONDS", 2.0, raising=False)
    CHECKS[path.parent.name](path.read_bytes(), _workdir(tmp_path))
