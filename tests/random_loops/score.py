"""The scorer: run the harness's explanation on a drawn loop (the CLI, as a user would: `python -m harness parity
--spec harness/specs/default.toml --loop "python LOOP" --steps 12 --matrix none --out DIR`) and set what it wrote
(verdict.json, your_loop_in_trl.toml, summary.txt) against the answer known by construction.

Right (issue 47): the explanation is confirmed (the built-in loop or TRL set up as written reproduces the loop over
12 steps: the verdict's own confirmation is the reading here), every TRL field is in the table with its value as the
loop writes it (a schedule: the rates the table gives over the 12 steps are the loop's), every switch TRL cannot set
is named with its value, nothing wrong is in the table or among the switches, what 12 steps cannot show is said as
such, and a loop drawn with a choice no switch reproduces is a failure (`inexpressible:<what>`), whatever the verdict.
Fields the answer marks unsure (their effect may stay under the tolerance) may be left out, said or not; written,
they must be right. Each miss is a short, stable category string.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from tests.random_loops.vocab import SPEC_TRL, STEPS

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "harness" / "specs" / "default.toml"
# what every drawn loop does (template.py), said or not where it does not act: its micro-batches cut in the rollout's
# order (unsure where the loss does not depend on it)
TRUE_OF_EVERY_LOOP = {"MICRO_BATCH_ORDER": "rollout"}
SCHEDULE_FIELDS = ("lr_scheduler_type", "warmup_steps", "warmup_ratio", "lr_scheduler_kwargs")


def run_explanation(loop_path: Path, out_dir: Path, steps: int = STEPS, timeout_s: float = 1800.0) -> dict:
    """The harness's CLI on the loop; returns rc, wall seconds and the tail of its output."""
    cmd = [sys.executable, "-m", "harness", "parity", "--spec", str(SPEC), "--loop", f"python {loop_path}",
           "--steps", str(steps), "--matrix", "none", "--out", str(out_dir), "--force"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, "timed out"
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), "tail": tail}


def read_outputs(out_dir: Path) -> dict | None:
    verdict = out_dir / "verdict.json"
    if not verdict.is_file():
        return None
    doc = json.loads(verdict.read_text())
    cell = doc["cells"][0] if doc.get("cells") else {}
    detail = (cell.get("attribution_detail") or [{}])[0]
    table = out_dir / "your_loop_in_trl.toml"
    trl = tomllib.loads(table.read_text()).get("trl", {}) if table.is_file() else {}
    summary = (out_dir / "summary.txt").read_text() if (out_dir / "summary.txt").is_file() else ""
    cell_dir = Path(cell.get("dir", out_dir / "yours-vs-trl"))
    metrics = [json.loads(x) for x in (cell_dir / "yours" / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (cell_dir / "yours" / "metrics.jsonl").is_file() else []
    return {"verdict": cell.get("verdict"), "status": detail.get("status"), "trl": trl,
            "quirks": dict(detail.get("quirks") or {}), "text": summary + "\n" + "\n".join(detail.get("notes") or []),
            "metrics": metrics}


def schedule_rates(name: str, lr: float, warmup: int, horizon: int, kwargs: dict, steps: int = STEPS) -> list[float]:
    """The rate of each of the first `steps` optimizer steps under transformers' named schedule."""
    import torch
    import transformers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=horizon,
                                       scheduler_specific_kwargs=dict(kwargs) or None)
    rates = []
    for _ in range(steps):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return rates


def table_rates(trl: dict, steps: int = STEPS) -> list[float]:
    """The rates TRL would use with the table's fields over the spec's run (max_steps = steps)."""
    lr = float(trl.get("learning_rate", SPEC_TRL["learning_rate"]))
    warmup = int(trl.get("warmup_steps", 0) or 0)
    if not warmup and trl.get("warmup_ratio"):
        warmup = math.ceil(float(trl["warmup_ratio"]) * steps)
    return schedule_rates(trl.get("lr_scheduler_type", "constant"), lr, warmup, steps,
                          trl.get("lr_scheduler_kwargs") or {}, steps)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _said(text: str, *words: str) -> bool:
    """Some sentence of the verdict's words (wrapped lines joined) holds all `words`, case-insensitive; a word may
    be alternatives joined by `|`."""
    sentences = re.split(r"[.;]\s|\s-\s", " ".join(text.split()).lower())
    return any(all(any(alt in line for alt in w.lower().split("|")) for w in words) for line in sentences)


# a gradient norm the loop logs below this at every step is its own float32 rounding: the embedded model's real
# gradients are 1e-2 and up, the rounding residue of a loss whose every term cancels (a micro-batch's mean advantage
# of 0: its micro-batches hold whole groups of centred advantages) about 1e-8
ROUNDING_NORM = 1e-6


def decide_from_run(answer: dict, out: dict) -> dict:
    """What construction left to the run: a clipping threshold no logged (pre-clip) norm reached cannot act (the
    loop's 0.5, or, where the loop clips nothing, TRL's max_grad_norm of the spec); a loop whose logged gradient is
    rounding at every step (`rounding_only`) trains on its own arithmetic's rounding, which Adam turns into whole
    steps: no other loop reproduces those bit for bit, so its final weights cannot be confirmed, only said."""
    answer = json.loads(json.dumps(answer))
    norms = [float(m["grad_norm"]) for m in out["metrics"] if isinstance(m.get("grad_norm"), (int, float))]
    threshold = {"0.5": 0.5, "none": SPEC_TRL["max_grad_norm"]}.get(answer["choices"].get("grad_clip"))
    if threshold is not None and norms and max(norms) > threshold:  # it binds at some step: the run must show it
        answer["unsure"] = [u for u in answer["unsure"] if u != "max_grad_norm"]
    answer["rounding_only"] = bool(norms) and max(norms) < ROUNDING_NORM
    return answer


def score(answer: dict, out: dict | None, run: dict) -> dict:
    """{"right": bool, "misses": [category, ...]} for one loop."""
    if out is None or run["rc"] not in (0, 1):
        return {"right": False, "misses": [f"crash:rc={run['rc']}"]}
    answer = decide_from_run(answer, out)
    misses = [f"inexpressible:{code}" for code, _ in answer["inexpressible"]]
    unsure = set(answer["unsure"])
    if out["verdict"] == "error":
        return {"right": False, "misses": ["verdict_error", *misses]}
    # a warmup the run ends inside shows its rise per step only: the peak is judged with the schedule, by its rates
    in_warmup = answer["stated"]["schedule"]["warmup_steps"] >= STEPS
    by_rates = SCHEDULE_FIELDS + (("learning_rate",) if in_warmup else ())
    expected_trl = {k: v for k, v in answer["trl"].items() if k not in by_rates}
    needed = [k for k in expected_trl if k not in unsure] + [k for k in answer["quirks"] if k not in unsure]
    if out["verdict"] == "parity" and needed:
        misses.append("parity_claimed")
    elif needed and out["status"] != "confirmed" and not answer["inexpressible"]:
        # a loop that trains on rounding alone: right where every value is (below) and the verdict says that the
        # final weights part because the gradient is rounding, the one thing left unconfirmed
        if not (answer["rounding_only"] and _said(out["text"], "final weights", "rounding alone")):
            misses.append(f"not_confirmed:{out['status']}")
    for key, want in expected_trl.items():
        if key not in out["trl"]:
            if key not in unsure:
                misses.append(f"trl_missing:{key}")
        elif not _same(out["trl"][key], want):
            misses.append(f"trl_value:{key}")
    for key, got in out["trl"].items():
        if key in expected_trl or key in by_rates:
            continue
        if key in SPEC_TRL and _same(got, SPEC_TRL[key]):
            continue  # the spec's own value: harmless
        misses.append(f"trl_extra:{key}")
    misses += _schedule_misses(answer, out)
    for key, want in answer["quirks"].items():
        if key not in out["quirks"]:
            if key not in unsure:
                misses.append(f"quirk_missing:{key}")
        elif key != "SELECTION" and not _same(out["quirks"][key], want) and not _lookalike(key, out["quirks"][key],
                                                                                              want, unsure):
            misses.append(f"quirk_value:{key}")
    for key in out["quirks"]:
        if key not in answer["quirks"] and not (key == "LR_STEPS") and not (
                key in unsure and _same(out["quirks"][key], TRUE_OF_EVERY_LOOP.get(key))):
            misses.append(f"quirk_extra:{key}")
    for what, word in answer["cannot_show"]:
        if not (_said(out["text"], word, "could not tell") or _said(out["text"], word, "cannot")):
            misses.append(f"cannot_show_unsaid:{_short(word)}")
    for what, word in answer["logged"]:
        if not _said(out["text"], word, "loss"):
            misses.append(f"logged_unsaid:{_short(word)}")
    return {"right": not misses, "misses": misses}


def _short(word: str) -> str:
    return word.split("|")[0].replace(" ", "_")


def _lookalike(key: str, got, want, unsure: set) -> bool:
    """An epsilon below the rewards' resolution written as another value that small (both under 1e-6)."""
    return key in unsure and key == "STD_EPS" and float(got) <= 1e-6 and float(want) <= 1e-6


def _schedule_misses(answer: dict, out: dict) -> list[str]:
    sched = answer["stated"]["schedule"]
    extra = {k: v for k, v in sched.items() if k not in ("name", "warmup_steps", "horizon")}
    want = schedule_rates(sched["name"], answer["stated"]["learning_rate"], sched["warmup_steps"], sched["horizon"],
                          extra)
    if "LR_STEPS" in out["quirks"]:
        return ["schedule_as_lr_steps"]  # every drawn schedule has TRL fields that reproduce it
    got = table_rates({**{k: v for k, v in SPEC_TRL.items() if k in ("learning_rate",)}, **out["trl"]})
    if any(not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(got, want)):
        return ["schedule_rates"]
    return []


def rescore(row: dict, work: Path) -> dict:
    """A finished seed scored again from its run folder (the scorer changed, not the run)."""
    from tests.random_loops.generator import generate

    folder = work / f"seed-{row['seed']}"
    out = read_outputs(folder / "run")
    result = score(generate(row["seed"])[1], out, {"rc": row["rc"], "wall_s": row["wall_s"], "tail": ""})
    return {**row, **result}


def score_seed(seed: int, work: Path, keep: bool = True) -> dict:
    """Generate, run and score one seed; its loop, answer and run folder under work/seed-N."""
    from tests.random_loops.generator import generate

    folder = work / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    source, answer = generate(seed)
    loop = folder / "loop.py"
    loop.write_text(source)
    (folder / "answer.json").write_text(json.dumps(answer, indent=1))
    run = run_explanation(loop, folder / "run")
    out = read_outputs(folder / "run")
    result = score(answer, out, run)
    row = {"seed": seed, **result, "differences": answer["differences"], "rc": run["rc"], "wall_s": run["wall_s"],
           "verdict": out and out["verdict"], "status": out and out["status"], "table": out and out["trl"],
           "quirks": out and out["quirks"]}
    if run["rc"] not in (0, 1):
        row["tail"] = run["tail"]
    return row


TRL_TO_SPEC = {"loss_type": ("LOSS_NORM", {"grpo": "sequence", "bnpo": "token_local", "dapo": "token_global",
                                           "dr_grpo": "constant"}),
               "scale_rewards": ("ADV_SCALE", None), "beta": ("BETA", None),
               "use_bias_correction_kl": ("KL_IS_CORRECTION", None), "num_iterations": ("NUM_ITERATIONS", None),
               "mask_truncated_completions": ("MASK_TRUNCATED", None), "learning_rate": ("LR", None),
               "adam_beta2": ("ADAM_BETA2", None), "weight_decay": ("WEIGHT_DECAY", None),
               "max_grad_norm": ("MAX_GRAD_NORM", None), "epsilon": ("CLIP_LOW", None),
               "epsilon_high": ("CLIP_HIGH", None), "reward_weights": ("rewards.weights", None)}


def answer_as_spec(answer: dict) -> list[str] | None:
    """The answer as `--set` overrides of the built-in loop (the schedule as LR_STEPS, its rates); None where the
    built-in loop cannot be set up from the answer alone (a selection: it replays the loop's own trained.jsonl)."""
    if "SELECTION" in answer["quirks"] or answer["inexpressible"]:
        return None
    sets = {}
    for key, value in answer["trl"].items():
        if key in SCHEDULE_FIELDS:
            continue
        field, values = TRL_TO_SPEC[key]
        sets[field] = values[value] if values else value
    sched = answer["stated"]["schedule"]
    extra = {k: v for k, v in sched.items() if k not in ("name", "warmup_steps", "horizon")}
    if sched["name"] != "constant":
        sets["LR_STEPS"] = schedule_rates(sched["name"], answer["stated"]["learning_rate"], sched["warmup_steps"],
                                          sched["horizon"], extra)
    sets.update(answer["quirks"])
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


def _logs_otherwise(answer: dict, outside: dict) -> bool:
    """Every metric outside is one the loop logs otherwise by construction."""
    allowed = {"loss"} if answer["logged"] else set()
    if answer["choices"]["lr_logged"] == "after_scheduler_step":
        allowed.add("learning_rate")
    return set(outside) <= allowed


def verify_answer(seed: int, work: Path) -> dict:
    """The built-in loop set up as the answer says, against the drawn loop: parity (exit 0) checks the answer itself,
    independently of the explanation (which is not run when they agree)."""
    from tests.random_loops.generator import generate

    source, answer = generate(seed)
    sets = answer_as_spec(answer)
    if sets is None:
        return {"seed": seed, "verified": None}
    folder = work / f"verify-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loop.py").write_text(source)
    cmd = [sys.executable, "-m", "harness", "parity", "--spec", str(SPEC), "--loop", f"python {folder / 'loop.py'}",
           "--against", "scratch", "--steps", str(STEPS), "--matrix", "none", "--out", str(folder / "run"), "--force"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    out = read_outputs(folder / "run")
    doc = json.loads((folder / "run" / "verdict.json").read_text()) if out else {}
    metrics = (doc.get("cells") or [{}])[0].get("metrics") or {}
    outside = {k: v.get("first_outside") for k, v in metrics.items() if v.get("first_outside")}
    # training agrees: the gradient and the weights at every step (a loss or rate the loop logs otherwise, drawn on
    # purpose, parts in value only)
    training = bool(out) and not ({"grad_norm", "param_rel_l2"} & outside.keys())
    return {"seed": seed, "verified": proc.returncode == 0 or (training and _logs_otherwise(answer, outside)),
            "outside": outside, "rc": proc.returncode, "sets": sets,
            "verdict": out and out["verdict"], "wall_s": round(time.time() - t0, 1),
            "tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]}
