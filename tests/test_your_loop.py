"""Your own loop as a side: the file-and-environment contract, the example loop at parity with TRL, the
explanation search naming two simultaneous differences, and a loop that breaks the contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DEFAULT_SPEC, ROOT
from first_screen import check_report
from harness.diagnose.matrix import run_matrix
from harness.experiment.spec import load_spec
from loop_runner.run import LoopError, read_loop_metrics

EXAMPLE = f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'}"
QUIET = {"log": lambda *_: None}


def loop_spec(command: str, *overrides: str):
    return load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(command)}", *overrides])


def test_helper_imports_without_torch():
    code = "import sys, harness.loop; assert not {'torch', 'numpy', 'transformers'} & set(sys.modules), sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_example_loop_reaches_parity_with_trl(tmp_path):
    """The example loop, at the spec's matched settings, over the default spec's 30 steps."""
    doc = run_matrix(loop_spec(EXAMPLE), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["name"] == "yours-vs-trl" and cell["verdict"] == "parity", (cell.get("error"), cell["first_divergence"])
    assert doc["ok"]
    metrics = cell["metrics"]
    assert {"loss", "grad_norm", "reward", "learning_rate"} <= set(metrics)  # compared, not just present
    assert 0 < metrics["param_rel_l2"]["max_abs"] < 1e-5  # the weights it saved, against TRL's at step 30
    rounds = [json.loads(line) for line in (tmp_path / "yours-vs-trl" / "loop_rollouts.jsonl").read_text().splitlines()]
    assert len(rounds) == 30
    first = rounds[0]
    n = len(first["completion_ids"])
    assert n == 16 and len(first["prompts"]) == n and len(first["rows"]) == n and len(first["completions"]) == n
    assert set(first["rewards"]) == {"reward_correct", "reward_format"} and first["reward_weights"] == [1.0, 0.5]
    spec_json = json.loads((tmp_path / "yours-vs-trl" / "yours" / "spec.json").read_text())
    assert spec_json["derived"]["sequences_per_step"] == 16 and spec_json["STEPS"] == 30


def test_two_differences_are_explained_in_trl_terms_and_the_table_gives_parity(tmp_path):
    doc = run_matrix(loop_spec(f"{EXAMPLE} --loss-agg token --adv-scale none", "STEPS=12"), tmp_path / "a", "none",
                     **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged"
    found = cell["attribution_detail"][0]
    assert found["status"] == "confirmed", found
    assert found["fix"]["trl"] == {"loss_type": "dapo", "scale_rewards": "none"}
    table = (tmp_path / "a" / "your_loop_in_trl.toml").read_text()
    assert 'loss_type = "dapo"' in table and 'scale_rewards = "none"' in table
    check_report(tmp_path / "a", "my_grpo-loss-agg-token-adv-scale-none")  # the answer on its first screen
    # TRL with the written table against the same loop: parity
    fields = [line.replace(" = ", "=") for line in table.splitlines() if " = " in line and not line.startswith("#")]
    again = run_matrix(loop_spec(f"{EXAMPLE} --loss-agg token --adv-scale none", "STEPS=12",
                                 *(f"trl.{f}" for f in fields)), tmp_path / "b", "none", **QUIET)
    assert again["cells"][0]["verdict"] == "parity", again["cells"][0]["first_divergence"]


def test_a_loop_on_a_separate_samplers_completions_is_at_parity_with_the_correction_and_confirmed_without(tmp_path):
    """The lesson's third check on your loop: TRL corrects for the sampler (IS_CORRECTION, its default with vLLM); the
    rollouts carry the sampler's log-probs (here the emulated sampler's: vLLM's arrive the same way). The example
    loop applying TRL's correction from them is at parity; without it, the correction is read from its per-token loss
    and confirmed as the cause; with another mode, the mode."""
    sampler = ['sampler.kind="emulated"', "sampler.noise_scale=0.02", "IS_CORRECTION=true", "STEPS=12"]
    doc = run_matrix(loop_spec(EXAMPLE, *sampler), tmp_path / "on", "none", **QUIET)
    assert doc["cells"][0]["verdict"] == "parity", doc["cells"][0]["first_divergence"]
    rounds = (tmp_path / "on" / "yours-vs-trl" / "loop_rollouts.jsonl").read_text().splitlines()
    assert json.loads(rounds[0])["logprobs"]  # the sampler's log-probs reached the loop
    for flag, fix in (("off", {"vllm_importance_sampling_correction": False}),
                      ("token_truncate", {"vllm_importance_sampling_mode": "token_truncate"})):
        doc = run_matrix(loop_spec(f"{EXAMPLE} --is-correction {flag}", *sampler), tmp_path / flag, "none", **QUIET)
        cell = doc["cells"][0]
        assert cell["verdict"] == "diverged"
        found = cell["attribution_detail"][0]
        assert found["status"] == "confirmed" and found["fix"]["trl"] == fix, found


def test_free_mode_runs_your_loop_once_per_seed(tmp_path):
    doc = run_matrix(loop_spec(EXAMPLE, "STEPS=4", "FREE_SEEDS=2"), tmp_path, "none", mode="free", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity", cell.get("first_divergence") or cell.get("error")
    seeds = sorted(p.name for p in (tmp_path / "yours-vs-trl" / "yours").glob("seed-*"))
    assert seeds == ["seed-42", "seed-43"]
    assert not (tmp_path / "yours-vs-trl" / "loop_rollouts.jsonl").exists()  # it sampled for itself


def test_against_both_and_scratch(tmp_path):
    doc = run_matrix(loop_spec(EXAMPLE, "STEPS=4", 'loop.against="both"'), tmp_path, "none", **QUIET)
    assert [c["name"] for c in doc["cells"]] == ["yours-vs-trl", "yours-vs-scratch"]
    assert all(c["verdict"] == "parity" for c in doc["cells"]), [c.get("first_divergence") for c in doc["cells"]]


@pytest.mark.parametrize("command, words", [
    ("import sys; sys.exit('my loop broke')", "exited with status 1: my loop broke"),
    ("import time; time.sleep(30)", "ran past loop.timeout_s = 2 s"),
    ("pass", "wrote no metrics to PARITY_METRICS"),
    ("import os; open(os.environ['PARITY_METRICS'], 'a').write('step 1 loss 0.5\\n')", "loop_metrics.jsonl:1: not JSON"),
])
def test_a_loop_that_breaks_the_contract_is_an_error_and_the_run_goes_on(tmp_path, command, words):
    doc = run_matrix(loop_spec(f"{sys.executable} -c {json.dumps(command)}", "STEPS=2", "loop.timeout_s=2",
                               'loop.against="both"'), tmp_path, "none", **QUIET)
    assert [c["verdict"] for c in doc["cells"]] == ["error", "error"]  # each cell said so; neither sank the run
    assert words in doc["cells"][0]["error"], doc["cells"][0]["error"]
    assert not doc["ok"] and (tmp_path / "verdict.json").exists()
    assert (tmp_path / "yours-vs-trl" / "scratch" / "metrics.jsonl").read_text().count("\n") == 2  # kept


@pytest.mark.parametrize("lines, words", [
    (['{"step": 1, "loss": 0.1}', '[1, 2]'], ":2: a line must be a JSON object"),
    (['{"loss": 0.1}'], ':1: no integer "step"'),
    (['{"step": 1, "loss": 0.1}', '{"step": 1, "loss": 0.2}'], ":2: step 1 after step 1"),
    (['{"step": 1, "mean_loss": 0.1}'], ':1: no numeric "loss" (keys: step, mean_loss)'),
    (['{"step": 1, "loss": 0.1, "reward": "high"}'], ":1: 'reward' must be a number or null, got str"),
    (['{"step": 1, "loss": "nan"}'], ":1: your loop logged a non-finite loss (nan) at step 1"),
])
def test_bad_metric_lines_name_the_line(tmp_path, lines, words):
    path = tmp_path / "loop_metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LoopError, match=None) as err:
        read_loop_metrics(path, {})
    assert words in str(err.value), str(err.value)


def test_metric_names_are_mapped(tmp_path):
    path = tmp_path / "loop_metrics.jsonl"
    path.write_text('{"iteration": 1, "policy_loss": 0.25, "mean_reward": 0.5}\n')
    rows = read_loop_metrics(path, {"step": "iteration", "loss": "policy_loss", "reward": "mean_reward"})
    assert rows == [{"step": 1, "loss": 0.25, "reward": 0.5}]


def test_run_replays_a_rollout_file(tmp_path):
    """`run trl --rollouts FILE` and `run scratch --rollouts FILE` train on a recorded round file."""
    doc = run_matrix(load_spec(DEFAULT_SPEC, ["STEPS=3"]), tmp_path / "pair", "none", **QUIET)
    rollouts = tmp_path / "pair" / "as-given" / "rollouts.jsonl"
    assert doc["cells"][0]["verdict"] == "parity"
    for side in ("trl", "scratch"):
        r = subprocess.run([sys.executable, "-m", "harness", "run", side, "--spec", str(DEFAULT_SPEC), "--set",
                            "STEPS=3", "--rollouts", str(rollouts), "--out", str(tmp_path / side), "--quiet"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    cmp = subprocess.run([sys.executable, "-m", "harness", "compare", str(tmp_path / "trl"),
                          str(tmp_path / "pair" / "as-given" / "trl"), "--out", str(tmp_path / "cmp")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0 and "parity" in cmp.stdout, cmp.stdout + cmp.stderr


def test_the_docs_commands_run_as_written(tmp_path):
    """docs/your-loop.md: every `$ python -m harness ...` line runs from the repository root with the exit code
    its comment states (output folders moved under tmp_path)."""
    import re
    import shlex

    doc = (ROOT / "docs" / "your-loop.md").read_text()
    commands = re.findall(r"^\$ (python -m harness .+?)\s+# exit (\d)$", doc, flags=re.M)
    assert len(commands) == 5
    for line, code in commands:
        argv = shlex.split(line.replace("runs/", f"{tmp_path}/"))
        argv = [sys.executable if a == "python" else a for a in argv]
        argv = [a.replace("python examples/", f"{sys.executable} examples/") for a in argv]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == int(code), f"{line}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    assert (tmp_path / "my-loop-2" / "your_loop_in_trl.toml").exists()
    four = json.loads((tmp_path / "my-loop-4" / "verdict.json").read_text())["cells"][0]["attribution_detail"][0]
    assert four["status"] == "confirmed" and four["fix"]["trl"] == {"beta": 0.01, "adam_beta2": 0.999}, four
    assert four["fix"]["scratch"] == {"STD_EPS": 1e-08, "COMPLETION_MASK": "no_eos"}


def test_a_loop_that_stops_early_is_an_error_not_parity(tmp_path):
    """Three steps of a 4-step spec compared as far as they went would pass: it is an error instead."""
    doc = run_matrix(loop_spec(EXAMPLE, "STEPS=4", "loop.metrics.unused=\"x\""), tmp_path / "ok", "none", **QUIET)
    assert doc["cells"][0]["verdict"] == "parity"
    short = ("import json, os; [open(os.environ['PARITY_METRICS'], 'a').write(json.dumps({'step': s, 'loss': 0.0}) "
             "+ '\\n') for s in (1, 2, 3)]")
    doc = run_matrix(loop_spec(f"{sys.executable} -c {json.dumps(short)}", "STEPS=4"), tmp_path / "short", "none",
                     **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "error" and "asks for STEPS = 4" in cell["error"], cell.get("error")


def test_the_loop_is_stopped_with_the_harness(tmp_path):
    """SIGINT/SIGTERM to the harness (the STOP flag) takes the loop's process group down within a second or so."""
    import time

    from harness.runlog.stops import STOP, Interrupted
    from loop_runner.run import train

    spec = loop_spec(f"{sys.executable} -c \"import time; time.sleep(60)\"", "STEPS=2")
    STOP.requested = "SIGTERM"
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            train(spec, tmp_path)
    finally:
        STOP.requested = None
    assert time.monotonic() - t0 < 10
