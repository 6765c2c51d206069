"""`compare` on other people's files: JSONL and CSV logs with other column names (--map, W&B and TRL names
recognised), a TRL trainer_state.json, NaN/inf on either side, metrics one side logs, free-run seed folders,
alignment by generation round, suspicions worded from the curves. Small files written here; no training."""

import csv
import json
import math
import re
import subprocess
import sys

import pandas as pd
import pytest

from conftest import ROOT
from harness.diagnose.attribution import evidence as evidence_rules
from harness.diagnose.compare import (CompareInputError, compare_frames, compare_inputs, format_comparison,
                                      input_mode, load_any_run, load_inputs, parse_map)
from harness.diagnose.freerun import compare_free_inputs


def write_jsonl(path, rows, manifest=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes NaN and Infinity as such
    if manifest is not None:
        (path.parent / "manifest.json").write_text(json.dumps(manifest))
    return path


def write_csv(path, header, rows):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def compare(a, b, mode=None, **kw):
    """As the CLI does it: one run per side in lockstep, several seeds per side with the free-run statistic."""
    inputs = load_inputs(a, b, **kw)
    if input_mode(inputs, mode) == "free":
        return compare_free_inputs(inputs, evidence=evidence_rules)
    return compare_inputs(inputs, evidence=evidence_rules)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "harness", "compare", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# a W&B history export of a TRL run: wandb's own _step counts from 0, the Trainer's step is train/global_step
WANDB_HEADER = ["_step", "_runtime", "_timestamp", "train/global_step", "train/loss", "train/reward",
                "train/grad_norm", "train/epoch", "train/train_runtime"]
WANDB_ROWS = [[0, 1.5, 1700000000, 1, 0.5, 0.125, 1.0, 0.1, ""],
              [1, 2.5, 1700000001, 2, 0.4, 0.25, 0.9, 0.2, ""],
              [2, 3.5, 1700000002, 3, 0.3, 0.375, 0.8, 0.3, 99.0]]
HARNESS_ROWS = [{"step": 1, "loss": 0.5, "reward": 0.125, "grad_norm": 1.0},
                {"step": 2, "loss": 0.4, "reward": 0.25, "grad_norm": 0.9},
                {"step": 3, "loss": 0.3, "reward": 0.375, "grad_norm": 0.8}]


def test_wandb_csv_names_are_recognised(tmp_path):
    a = write_csv(tmp_path / "wandb.csv", WANDB_HEADER, WANDB_ROWS)
    df = load_any_run(a)
    assert list(df.index) == [1, 2, 3]  # train/global_step, not wandb's _step
    assert set(df.columns) == {"step", "loss", "reward", "grad_norm", "trl/epoch"}  # bookkeeping and summary dropped
    b = write_jsonl(tmp_path / "mine.jsonl", HARNESS_ROWS)
    r = compare(a, b)
    assert r["first_divergence"] is None and set(r["metrics"]) == {"loss", "reward", "grad_norm"}
    assert r["not_compared"] == []  # trl/epoch is ignored like the harness's own, not "one-sided"
    # 2e-3 off at step 2: the lockstep fp32 tolerance (1e-5 + 1.3e-6 * |b|) catches it there
    rows = [dict(r) for r in HARNESS_ROWS]
    rows[1]["loss"] = 0.402
    r = compare(a, write_jsonl(tmp_path / "off.jsonl", rows))
    assert r["first_divergence"] == {"step": 2, "metric": "loss"}
    assert r["metrics"]["loss"]["max_abs"] == pytest.approx(0.002)


def test_map_renames_columns_in_both_logs(tmp_path):
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"iter": s["step"], "my_loss": s["loss"], "R": s["reward"],
                                                  "grad_norm": s["grad_norm"]} for s in HARNESS_ROWS])
    ref = write_jsonl(tmp_path / "ref.jsonl", HARNESS_ROWS)
    mapping = parse_map(["step=iter", "loss=my_loss", "reward=R"])
    assert mapping == {"step": "iter", "loss": "my_loss", "reward": "R"}
    r = compare(mine, ref, mapping=mapping)
    assert r["first_divergence"] is None and set(r["metrics"]) == {"loss", "reward", "grad_norm"}
    # without the reward map, R and reward are each logged by one side: not compared, never a divergence
    r = compare(mine, ref, mapping={"step": "iter", "loss": "my_loss"})
    assert r["first_divergence"] is None and r["not_compared"] == ["R", "reward"]
    with pytest.raises(CompareInputError, match="expected OURS=THEIRS"):
        parse_map(["loss"])
    with pytest.raises(CompareInputError, match=r"--map loss=my_los: neither log has a column 'my_los'.*my_loss"):
        load_inputs(mine, ref, mapping={"step": "iter", "loss": "my_los"})
    # steps that never meet (a log counting 101, 102, ...): said so, not a parity over nothing
    late = write_jsonl(tmp_path / "late.jsonl", [{**r, "step": r["step"] + 100} for r in HARNESS_ROWS])
    with pytest.raises(CompareInputError, match=r"share no step \(101..103 and 1..3\)"):
        compare(late, ref)


def test_trainer_state_against_a_wandb_export(tmp_path):
    history = [{**r, "epoch": 0.1 * r["step"], "learning_rate": 1e-6} for r in HARNESS_ROWS]
    history += [{"step": 3, "eval_loss": 0.7, "epoch": 0.3},  # an eval row and the end-of-training summary
                {"step": 3, "train_runtime": 12.0, "train_loss": 0.4, "total_flos": 1.0, "epoch": 0.3}]
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    wandb = write_csv(tmp_path / "wandb.csv", WANDB_HEADER, WANDB_ROWS)
    r = compare(tmp_path / "trl", wandb)
    assert r["first_divergence"] is None
    assert set(r["metrics"]) == {"loss", "reward", "grad_norm"} and r["not_compared"] == ["learning_rate"]
    assert r["names"] == ["trl", "wandb.csv"]


def test_nan_and_inf_are_divergences_absent_values_are_not(tmp_path):
    # NaN on both sides at step 2: a divergence, never parity (the frames carry no record of absent values)
    nan = float("nan")
    a = pd.DataFrame({"step": [1, 2, 3], "loss": [0.5, nan, 0.3]}).set_index("step", drop=False)
    assert compare_frames(a, a.copy())["first_divergence"] == {"step": 2, "metric": "loss"}
    # files: NaN on both sides at step 2 (loss), inf on one side at step 3 (grad_norm), and a reward both logs
    # leave out at step 2 (absent, not computed): not compared there, the rest agrees
    rows_a = [{"step": 1, "loss": 0.5, "grad_norm": 1.0, "reward": 0.1},
              {"step": 2, "loss": nan, "grad_norm": 0.9},
              {"step": 3, "loss": 0.3, "grad_norm": 0.8, "reward": 0.3}]
    rows_b = [dict(r) for r in rows_a]
    rows_b[2]["grad_norm"] = float("inf")
    r = compare(write_jsonl(tmp_path / "a.jsonl", rows_a), write_jsonl(tmp_path / "b.jsonl", rows_b))
    assert r["first_divergence"] == {"step": 2, "metric": "loss"}
    assert r["metrics"]["loss"]["non_finite_steps"] == [2]
    assert r["metrics"]["grad_norm"]["first_outside"] == 3
    assert r["metrics"]["reward"]["first_outside"] is None and r["metrics"]["reward"]["steps_compared"] == 2
    assert "loss at step 2 (A=nan, B=nan)" in " ".join(r["notes"])
    # CSV: an empty cell on both sides is absent (parity), "nan" text on both is a NaN (divergence)
    header = ["step", "loss", "reward"]
    empty = write_csv(tmp_path / "empty.csv", header, [[1, 0.5, 0.1], [2, 0.4, ""], [3, 0.3, 0.3]])
    assert compare(empty, empty)["first_divergence"] is None
    nans = write_csv(tmp_path / "nans.csv", header, [[1, 0.5, 0.1], [2, 0.4, "nan"], [3, 0.3, 0.3]])
    assert compare(nans, nans)["first_divergence"] == {"step": 2, "metric": "reward"}
    # a harness log (manifest.json beside it) writes NaN and inf as null: null there is a NaN, not a gap
    run = {"side": "scratch", "spec": {"DTYPE": "float32"}}
    h = write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}], run)
    assert compare(h.parent, h.parent)["first_divergence"] == {"step": 2, "metric": "loss"}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}])
    assert compare(plain, plain)["first_divergence"] is None  # elsewhere (pandas' to_json) null is a gap


def test_one_sided_metrics_and_values_are_not_compared(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"step": s, "loss": 0.5, "reward": 0.1, "kl": 0.01} for s in (1, 2, 3, 4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"step": s, "loss": 0.5, "sampling/importance_sampling_ratio/mean": 1.0,
                                            **({"reward": 0.1} if s % 2 else {})} for s in (1, 2, 3, 4)])
    r = compare(a, b)
    assert r["first_divergence"] is None and r["outside"] == []
    assert r["not_compared"] == ["kl", "sampling/importance_sampling_ratio/mean"]
    assert r["metrics"]["reward"]["steps_compared"] == 2  # b logs it at steps 1 and 3 only
    text = format_comparison(r, ("a.jsonl", "b.jsonl"))
    assert "verdict: parity" in text and "not compared (only a.jsonl logs them): kl" in text
    assert "not compared (only b.jsonl logs them): sampling/importance_sampling_ratio/mean" in text
    # the built-in sides keep counting a metric one side logs as a divergence (the matrix relies on it)
    assert compare_frames(load_any_run(a), load_any_run(b))["first_divergence"] is not None


def seeds(root, n, shift=0.0, spread=0.02, start_seed=1):
    """n seed runs of 10 steps: reward rising, each seed offset by (i - mean) * spread, plus `shift`."""
    for i in range(n):
        rows = [{"step": s, "reward": 0.1 * s + (i - (n - 1) / 2) * spread + shift, "loss": 0.01 * ((s + i) % 3),
                 "prompts_in_step": 4} for s in range(1, 11)]
        write_jsonl(root / f"seed-{start_seed + i}" / "metrics.jsonl", rows)
    return root


def test_free_run_folders_use_the_seed_noise_statistic(tmp_path):
    a = seeds(tmp_path / "a", 3)
    # B: shifted by a quarter of the seed-to-seed spread: seed by seed far outside lockstep's tolerance, against
    # the seed-to-seed noise nothing
    b = seeds(tmp_path / "b", 3, shift=0.005)
    r = compare(a, b)
    assert r["mode"] == "free" and r["seeds"] == [3, 3] and r["first_divergence"] is None
    assert set(r["metrics"]) == {"reward", "loss"}
    lock = compare(a / "seed-1", b / "seed-1")  # one run per side: lockstep tolerances
    assert lock["mode"] == "lockstep" and lock["first_divergence"] == {"step": 1, "metric": "reward"}
    # a shift ten times the seed spread: flagged in the first window (steps 1-2)
    far = seeds(tmp_path / "far", 3, shift=0.2)
    r = compare(a, far)
    assert r["first_divergence"] == {"step": 1, "metric": "reward"} and r["metrics"]["reward"]["t"][0] > r["t_critical"]
    # the same runs as a comma-separated list, and as a quoted glob
    listed = ",".join(str(a / f"seed-{i}") for i in (1, 2, 3))
    assert compare(listed, f"{tmp_path}/far/seed-*")["first_divergence"] == {"step": 1, "metric": "reward"}
    # a NaN in one seed's reward: a divergence at that step even where the statistic would not see it
    rows = [json.loads(line) for line in (b / "seed-2" / "metrics.jsonl").read_text().splitlines()]
    rows[6]["reward"] = float("nan")
    write_jsonl(b / "seed-2" / "metrics.jsonl", rows)
    r = compare(a, b)
    assert r["first_divergence"] == {"step": 7, "metric": "reward"}
    # the report draws the first seed of each side and each side's seed band
    from reports.render import write_compare_report

    inputs = load_inputs(a, far)
    html = write_compare_report(tmp_path, compare_free_inputs(inputs), frames=(inputs.a, inputs.b)).read_text()
    assert "free runs: 3 and 3 seeds" in html and re.search(r"diverged: first at step\s+1, reward", html)
    with pytest.raises(CompareInputError, match="at least 2 seeds per side.*seed-"):
        compare(a / "seed-1", b / "seed-1", mode="free")
    with pytest.raises(CompareInputError, match="use --mode free"):
        compare(a, b, mode="lockstep")


def test_free_runs_list_one_sided_metrics_as_not_compared(tmp_path):
    a = seeds(tmp_path / "a", 2)
    b = seeds(tmp_path / "b", 2)
    for d in (b / "seed-1", b / "seed-2"):
        rows = [{**json.loads(line), "kl": 0.0} for line in (d / "metrics.jsonl").read_text().splitlines()]
        write_jsonl(d / "metrics.jsonl", rows)
    r = compare(a, b)
    assert r["first_divergence"] is None and r["not_compared"] == ["kl"]


def test_align_by_generation_round(tmp_path):
    # A logs every optimizer step, 4 per generation round; B once per round (loss: the mean of the round's steps)
    a_rows = [{"step": s, "loss": 0.1 * s, "reward": 0.5 * ((s - 1) // 4)} for s in range(1, 13)]
    b_rows = [{"step": r, "loss": 0.1 * (4 * r - 1.5), "reward": 0.5 * (r - 1)} for r in (1, 2, 3)]
    a, b = write_jsonl(tmp_path / "a.jsonl", a_rows), write_jsonl(tmp_path / "b.jsonl", b_rows)
    assert compare(a, b)["first_divergence"] == {"step": 1, "metric": "loss"}  # step 1 is not round 1
    r = compare(a, b, align="round", steps_per_round="4,1")
    assert r["first_divergence"] is None and r["steps"] == [3, 3] and r["align"] == "round"
    assert r["metrics"]["loss"]["steps_compared"] == 3
    # B's own round column wins over --steps-per-round for B
    b2 = write_jsonl(tmp_path / "b2.jsonl", [{**row, "step": 10 * row["step"], "round": row["step"]} for row in b_rows])
    assert compare(a, b2, align="round", steps_per_round="4")["first_divergence"] is None
    # a round off: the loss of round 2 parts
    b_rows[1]["loss"] += 0.05
    r = compare(a, write_jsonl(tmp_path / "b3.jsonl", b_rows), align="round", steps_per_round="4,1")
    assert r["first_divergence"] == {"step": 2, "metric": "loss"}
    assert "first divergence: round 2, loss" in format_comparison(r)
    with pytest.raises(CompareInputError, match="needs a `round` column or --steps-per-round"):
        compare(a, b, align="round")
    with pytest.raises(CompareInputError, match="add --align round"):
        compare(a, b, steps_per_round="4")


def test_suspicions_follow_the_attribution_rules(tmp_path):
    header = ["step", "loss", "reward", "prompts_in_step"]
    a = write_csv(tmp_path / "a.csv", header, [[1, 0.5, 0.1, 4], [2, 0.4, 0.2, 4]])
    batch = write_csv(tmp_path / "batch.csv", header, [[1, 0.5, 0.1, 2], [2, 0.4, 0.2, 2]])
    r = compare(a, batch)
    assert r["suspected"] == [{"check": "batch", "status": "suspected",
                               "evidence": "prompts_in_step differ from step 1"}]
    loss = write_csv(tmp_path / "loss.csv", header, [[1, 0.5, 0.1, 4], [2, 0.45, 0.2, 4]])
    r = compare(a, loss)
    assert [s["check"] for s in r["suspected"]] == ["loss_type"]
    assert "suspected: loss_type (loss parts at step 2 while the rewards agree)" in format_comparison(r)
    assert compare(a, a)["suspected"] == []
    # a NaN loss while the rewards agree says nothing about how the loss is averaged: no loss_type suspicion
    nan_loss = write_csv(tmp_path / "nan.csv", header, [[1, 0.5, 0.1, 4], [2, "nan", 0.2, 4]])
    r = compare(a, nan_loss)
    assert r["first_divergence"] == {"step": 2, "metric": "loss"} and r["suspected"] == []


def test_cli_errors_and_report(tmp_path):
    nostep = write_csv(tmp_path / "nostep.csv", ["iter", "loss"], [[1, 0.5], [2, 0.4]])
    ok = write_csv(tmp_path / "ok.csv", ["step", "loss", "reward", "prompts_in_step"],
                   [[1, 0.5, 0.1, 4], [2, 0.4, 0.2, 4]])
    r = cli(ok, nostep)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {nostep}: no step column (it has: iter, loss); name the column "
                                             "that counts optimizer steps with --map step=COLUMN"]
    theirs = write_csv(tmp_path / "theirs.csv", ["iteration", "loss", "reward", "prompts_in_step", "kl"],
                       [[1, 0.5, 0.1, 2, 0.0], [2, 0.4, 0.2, 2, 0.0]])
    r = cli(ok, theirs, "--out", tmp_path / "cmp")
    assert r.returncode == 1, r.stderr
    assert "first divergence: step 1, prompts_in_step" in r.stdout
    assert "suspected: batch (prompts_in_step differ from step 1)" in r.stdout and "confirmed" not in r.stdout
    assert "not compared (only theirs.csv logs them): kl" in r.stdout
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved["not_compared"] == ["kl"] and saved["suspected"][0]["check"] == "batch"
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert "suspected: <b>batch</b>" in html and "not compared" in html and "data:image/png;base64," in html
    r = cli(ok, ok, "--mode", "free")
    assert r.returncode == 2 and "at least 2 seeds per side" in r.stderr and "Traceback" not in r.stderr
    r = cli(ok, ok, "--map", "loss")
    assert r.returncode == 2 and "expected OURS=THEIRS" in r.stderr and "Traceback" not in r.stderr
    assert math.isfinite(saved["metrics"]["loss"]["max_abs"])


def test_tensorboard_event_folders_are_read_through_tensorboard(tmp_path):
    """TRL's default report_to writes TensorBoard events (train/loss, train/grad_norm, ...) under
    <output_dir>/runs/<date_host>/: `compare` reads the folder as a log, with TRL's names."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    from harness.cli import main
    from harness.diagnose.compare import compare_frames, load_any_run

    values = {1: (0.5, 1.25), 2: (0.25, 0.75), 3: (0.125, 0.5)}
    writer = SummaryWriter(str(tmp_path / "trl-out" / "runs" / "Dec04_host"))
    for step, (loss, gnorm) in values.items():
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/grad_norm", gnorm, step)
    writer.close()
    frame = load_any_run(tmp_path / "trl-out")
    assert frame["loss"].to_dict() == {1: 0.5, 2: 0.25, 3: 0.125}
    assert frame["grad_norm"].to_dict() == {1: 1.25, 2: 0.75, 3: 0.5}
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"step": s, "loss": lo, "grad_norm": g}) + "\n" for s, (lo, g) in values.items()))
    assert compare_frames(load_any_run(mine), frame)["first_divergence"] is None
    mine.write_text("".join(json.dumps({"step": s, "loss": lo, "grad_norm": g * (1.1 if s == 2 else 1)}) + "\n"
                            for s, (lo, g) in values.items()))
    assert main(["compare", str(mine), str(tmp_path / "trl-out"), "--out", str(tmp_path / "cmp")]) == 1
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())["first_divergence"] == \
        {"step": 2, "metric": "grad_norm"}
