"""Run a user's GRPO loop (any command, any language) as a side of a parity run, and turn what it logs into the
harness's metric log.

Before the command starts, its run folder gets `spec.json` (the resolved spec) and the loop's environment names
the starting checkpoint, the spec, the lockstep rollouts (lockstep only), the seed, the metric file it appends to
and where it may save its final weights (harness/loop.py lists them; docs/your-loop.md walks through them).
After it exits, every line it wrote is checked (a JSON object with an integer `step` and a numeric `loss`;
other values numbers or null), mapped to the harness's names with `[loop.metrics]`, and written to the run's
`metrics.jsonl`. A loop that crashes, hangs past `loop.timeout_s`, writes nothing or writes a bad line raises
`LoopError` naming the line and what is wrong; its stdout and stderr stay in the run folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.runlog.tensors import TENSORS_FILE, TRAINED_FILE  # harness.loop.tensors / .trained write them

RAW_METRICS = "loop_metrics.jsonl"
WEIGHTS_DIR = "weights"
STDOUT, STDERR = "stdout.log", "stderr.log"


class LoopError(RuntimeError):
    """Your loop did not finish as the contract asks; the message says where and what."""


def spec_json(spec) -> dict:
    """The spec as your loop reads it (PARITY_SPEC): every field, plus the quantities derived from them."""
    return {**spec.to_dict(), "derived": {
        "sequences_per_step": spec.sequences_per_step, "micro_batch_size": spec.micro_batch_size,
        "rounds": spec.rounds}}


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def read_loop_metrics(path: Path, names: dict[str, str]) -> list[dict]:
    """The lines your loop wrote, checked and mapped to the harness's names; LoopError at the first bad line."""
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        raise LoopError(f"your loop wrote no metrics to PARITY_METRICS ({path}): append one JSON line per optimizer "
                        "step, at least {\"step\": 1, \"loss\": 0.12} (harness.loop.log_step does it)")
    theirs_to_ours = {theirs: ours for ours, theirs in names.items()}
    rows, last = [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise LoopError(f"{where}: not JSON ({e.msg}): {line[:120]!r}") from None
        if not isinstance(raw, dict):
            raise LoopError(f"{where}: a line must be a JSON object, got {type(raw).__name__}: {line[:120]!r}")
        row = {}
        for key, value in raw.items():
            key = theirs_to_ours.get(key, key)
            if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
                value = float(value)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise LoopError(f"{where}: {key!r} must be a number or null, got {type(value).__name__} "
                                f"{value!r}" + ("" if key != "step" else "; step is the optimizer step, 1, 2, ..."))
            row[key] = value
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise LoopError(f"{where}: no integer \"step\" (the optimizer step, starting at 1): {line[:120]!r}"
                            + ("; map your step column with [loop.metrics] step = \"...\"" if "step" not in raw else ""))
        if step <= last:
            raise LoopError(f"{where}: step {step} after step {last}: steps must increase, one line per optimizer step")
        if not isinstance(row.get("loss"), (int, float)):
            raise LoopError(f"{where}: no numeric \"loss\"" + (f" (keys: {', '.join(raw)}); map yours with "
                                                              "[loop.metrics] loss = \"your_name\""))
        if not math.isfinite(row["loss"]):
            raise LoopError(f"{where}: your loop logged a non-finite loss ({row['loss']}) at step {step}")
        last = step
        rows.append(row)
    return rows


def train(spec, out_dir, rollouts: str | Path | None = None, progress: bool = False, log=print) -> Path:
    """Run `spec.loop.command` once (seed spec.SEED) into `out_dir`; returns the run folder. Raises LoopError."""
    from harness.experiment.models import checkpoint_dir, resolve_device
    from harness.runlog.log import RunWriter
    from harness.runlog.stops import STOP, Interrupted

    command = spec.loop.command
    if not command:
        raise LoopError("no loop command: pass --loop \"CMD\" or set [loop] command in the spec")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Path(checkpoint_dir(spec)).resolve()  # absolute: the loop may run in another folder ([loop] cwd)
    (out_dir / "spec.json").write_text(json.dumps(spec_json(spec), indent=2) + "\n")
    raw_path = out_dir / RAW_METRICS
    raw_path.write_text("")
    weights = out_dir / WEIGHTS_DIR
    shutil.rmtree(weights, ignore_errors=True)  # weights an earlier run left must not pass for this run's
    env = {**os.environ, "PARITY_INIT": str(ckpt), "PARITY_SPEC": str((out_dir / "spec.json").resolve()),
           "PARITY_SEED": str(spec.SEED), "PARITY_METRICS": str(raw_path.resolve()),
           "PARITY_WEIGHTS_OUT": str(weights.resolve()),
           "PARITY_TENSORS": str((out_dir / TENSORS_FILE).resolve()),
           "PARITY_TRAINED": str((out_dir / TRAINED_FILE).resolve())}
    (out_dir / TENSORS_FILE).unlink(missing_ok=True)  # an earlier run's tensors must not pass for this run's
    (out_dir / TRAINED_FILE).unlink(missing_ok=True)
    env.pop("PARITY_ROLLOUTS", None)
    # `python` in the command is the interpreter the harness runs under (its venv), found first on PATH
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    if rollouts is not None:
        env["PARITY_ROLLOUTS"] = str(Path(rollouts).resolve())
    cwd = spec.loop.cwd or os.getcwd()
    extra = {"loop_command": command, "loop_cwd": cwd, "checkpoint": str(ckpt),
             "rollouts": "external (lockstep)" if rollouts is not None else "own"}
    with RunWriter(out_dir, "yours", spec, resolve_device(spec), extra) as writer:
        t0 = time.perf_counter()
        with open(out_dir / STDOUT, "w") as so, open(out_dir / STDERR, "w") as se:
            proc = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=so, stderr=se,
                                    start_new_session=True)  # its own process group: a timeout stops all of it
            deadline = time.monotonic() + spec.loop.timeout_s
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=1.0)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if STOP.requested:  # SIGINT/SIGTERM to the harness: the loop (its own session) goes too
                        raise Interrupted(f"{STOP.requested} while your loop ran")
                    if time.monotonic() > deadline:
                        raise LoopError(f"your loop ran past loop.timeout_s = {spec.loop.timeout_s:g} s and was "
                                        f"stopped; last output: "
                                        f"{_tail(out_dir / STDERR) or _tail(out_dir / STDOUT) or '(none)'}")
            except BaseException:  # a timeout, Ctrl-C, SIGTERM: take the loop's whole process group down with us
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if rc != 0:
            raise LoopError(f"your loop exited with status {rc}: {_tail(out_dir / STDERR) or '(no stderr)'} "
                            f"(full output: {out_dir / STDERR})")
        rows = read_loop_metrics(raw_path, spec.loop.metrics)
        _check_trained(out_dir / TRAINED_FILE, rollouts, [r["step"] for r in rows])
        if rows[-1]["step"] < spec.STEPS:  # fewer steps than the spec: compared as far as it went, it would pass
            from harness.runlog.log import step_ranges

            logged = [r["step"] for r in rows]
            gaps = sorted(set(range(1, logged[-1] + 1)) - set(logged))
            raise LoopError(f"your loop logged {len(rows)} steps ({step_ranges(logged)}"
                            + (f"; none for step {step_ranges(gaps)}" if gaps else "") + f") and exited after step "
                            f"{logged[-1]}; the spec asks for STEPS = {spec.STEPS}"
                            + (": it skipped the steps it logged none for and stopped there; log every optimizer "
                               "step, or see its stderr.log" if gaps else ": read STEPS from PARITY_SPEC "
                               "(harness.loop.spec()); a loop that skips a step (a NaN loss, say) and counts only the "
                               "steps it took also ends short: count the skipped ones too; or see its stderr.log"))
        wall = (time.perf_counter() - t0) / len(rows)
        for row in rows:
            writer.log_step({**row, "wall_s": row.get("wall_s", wall)})
        writer.update(weights_saved=(weights / "config.json").exists())
        if progress:
            log(f"yours: {len(rows)} steps in {time.perf_counter() - t0:.1f} s")
    return out_dir


def _check_trained(path: Path, rollouts, steps: list[int] = ()) -> None:
    """Your loop's trained.jsonl (harness.loop.trained), where it wrote one: readable, every logged step (`steps`)
    named with at least one completion (the built-in loop replays each step), and every (round, index) a completion of
    the rollouts it was given. LoopError naming the first that is not."""
    from harness.runlog.tensors import read_trained

    try:
        selection = read_trained(path)
    except ValueError as e:
        raise LoopError(f"harness.loop.trained wrote a bad line: {e}") from None
    if not selection or rollouts is None:
        return
    missing = [s for s in steps if not selection.get(s)]
    if missing:
        raise LoopError(f"{path.name}: step {missing[0]} trained on no completion it names ({len(missing)} logged "
                        "step(s) without one): call harness.loop.trained(step, rows) for every optimizer step, with at "
                        "least one (round, index) pair")
    sizes = [len(json.loads(line).get("completion_ids") or []) for line in Path(rollouts).read_text().splitlines()
             if line.strip()]
    for step, pairs in sorted(selection.items()):
        for r, i in pairs:
            if r >= len(sizes) or i >= sizes[r]:
                held = sizes[r] if r < len(sizes) else 0
                raise LoopError(f"{path.name}: step {step} names round {r}, completion {i}, which the rollouts do not "
                                f"hold ({len(sizes)} rounds; round {r} holds {held} completions): pairs are (round, "
                                "index within that round), both from 0")


def final_weights_sketch(yours: Path, seed: int):
    """The parameter sketch's coordinates of the weights your loop saved at its last step ((1 x width array, meta)),
    or None when it saved none."""
    from harness.experiment.models import load_model
    from harness.runlog.params import ParamSketch, read_sketch

    weights = Path(yours) / WEIGHTS_DIR
    if not (weights / "config.json").exists():
        return None
    model = load_model(weights, "float32", "cpu")
    folder = Path(yours) / "final_weights_sketch"  # not the run's own sketch: it holds one row, of the last step
    folder.mkdir(exist_ok=True)
    sketch = ParamSketch(model, folder, seed=seed)
    sketch.record(model)
    return read_sketch(folder)


def final_weights_distance(mine, other) -> float:
    """||w_yours - w_other|| / ||w_other|| over the sketched coordinates: `mine`, the row of final_weights_sketch;
    `other`, the other side's sketch row of the same step (the same width)."""
    import numpy as np

    a, b = np.asarray(mine, dtype=np.float64), np.asarray(other, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
