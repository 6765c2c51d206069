"""A difference that shows no effect in bf16: the same pair again in float32 before "cannot show here".

In bf16 each side rounds its own way, and the calibrated tolerance (k times the noise twin's difference) is wide
enough to hide a small setting: Adam's beta2 0.9 against 0.98, a learning rate 2% apart, weight decay 0.01 at a
small learning rate. So before a cell says it cannot show a difference the preflight lists, `escalate` runs the
same pair in float32 (fp32 weights and arithmetic; torch leaves TF32 off unless asked, and nothing here asks) on
the same device, at least `MIN_STEPS` steps (the loss shape acts at step 1, the first update at step 2, Adam's
betas at step 3). Where the float32 pair parts, the attribution confirms the cause by a float32 re-run with it
aligned: "shows in float32 at step N on METRIC; in bfloat16 the sides' own rounding hides it". Where it does not:
"no effect even in float32 over N steps", with the reason when the harness knows one.

Detection power (`steps_to_show`): after how many steps the difference would leave a bound. The effect is the
float32 pair's relative L2 distance between the two sides' weights per step (the difference itself, free of bf16
rounding); the bound is the weights' bound of the run in question per step (the larger of the floor and k times
its noise twin's distance). The effect is fitted as c * step^p over the last half of the steps (least squares in
log-log), the bound as its step-1 value plus c' * (step - 1)^q (its growth from where the twin started, fitted the
same way), and the estimate is the first step where the effect's fit passes the bound's. None when the bound grows
at least as fast as the effect: running longer at that precision would not show it.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np

from harness.diagnose import noise
from harness.diagnose.cell import EXPLAIN_FILE

MIN_STEPS = 3  # Adam's betas change nothing before the second update (step 3)
HORIZON = 10 ** 6  # past this many steps an estimate is "not within reach"
FOLDER = "float32"


# ---------------------------------------------------------------------------------------------
# re-running in float32 what ran in bf16 (the float32 pair of your loop below, and the explanation's float32 search)
# ---------------------------------------------------------------------------------------------
FLOAT32 = {"DTYPE": "float32", "MASTER_WEIGHTS": "float32"}  # fp32 weights and arithmetic (torch leaves TF32 off)


def your_loop_in_float32(spec32, data, root: Path, name: str = "yours"):
    """Your loop in float32 into root/name, on the cell's own loop rollouts (`data`: the cell, CellData): (its metric
    log, whether it logged exactly what its run in the cell did, so that it does not read DTYPE). The second is None
    when nothing both log can tell: the step-1 loss is the same in any dtype (the ratio is 1 and the KL 0 there, so
    it is the advantages' mean), so one step needs grad_norm. LoopError when your loop fails."""
    from harness.diagnose.compare import load_any_run
    from harness.rollouts.lockstep import LOOP_ROLLOUTS_FILE
    from loop_runner.run import train as train_loop

    train_loop(spec32, root / name, rollouts=Path(data.folder) / LOOP_ROLLOUTS_FILE, log=lambda *_: None)
    mine, before = load_any_run(root / name), data.yours
    steps = mine.index.intersection(before.index)
    cols = [c for c in ("grad_norm", "loss") if c in mine and c in before and (c != "loss" or len(steps) > 1)]
    return mine, (same_log(mine, before, cols) if cols else None)


def same_log(a, b, columns: list[str]) -> bool:
    """Two runs logged exactly the same values of `columns` at every step both logged."""
    steps = a.index.intersection(b.index)
    return bool(len(steps) and columns) and all(
        a.loc[steps, c].astype(float).equals(b.loc[steps, c].astype(float)) for c in columns)


def float32_twin(spec32, records, root: Path, plain: str = "scratch"):
    """The built-in loop on `records` in float32 (root/plain) and its noise twin (root/twin): their envelope,
    the tolerance of a float32 pair on those rollouts."""
    from harness.diagnose.pairs import twin_envelope
    from harness.rollouts.lockstep import ReplaySource
    from scratch_grpo.train import train as train_scratch

    for name, twin in ((plain, False), ("twin", True)):
        train_scratch(spec32, root / name, rollout_source=ReplaySource(records), progress=False, noise_twin=twin)
    return twin_envelope(root / plain, root / "twin")


def wants_float32(cell, mode: str) -> bool:
    """Whether a cell's no-effect is worth a float32 pair: a bf16 pair of the two built-in sides, in lockstep (free
    runs compare seeds, whose spread hides more than rounding does), where FLOAT32_CHECK allows it (`auto`: on CPU
    and GPU alike, since an H100 run checked the float32 pair there: docs/benchmarks.md, issue 28)."""
    if cell.spec.FLOAT32_CHECK == "off":
        return False
    return mode == "lockstep" and cell.spec.DTYPE != "float32" and tuple(cell.sides) == ("scratch", "trl")


# ---------------------------------------------------------------------------------------------
# detection power
# ---------------------------------------------------------------------------------------------
def power_fit(values) -> tuple[float, float, int] | None:
    """(log c, p, the first step fitted) with values[i] ~ c * (i + 1)^p, fitted in log-log over the last half of the
    steps whose value is positive and finite (all of them when there are fewer than 4); None with fewer than 2."""
    pts = [(i + 1, float(v)) for i, v in enumerate(values) if v is not None and math.isfinite(v) and v > 0]
    if len(pts) >= 4:
        pts = pts[len(pts) // 2:]
    if len(pts) < 2:
        return None
    x, y = np.log([s for s, _ in pts]), np.log([v for _, v in pts])
    p, log_c = np.polyfit(x, y, 1)
    return float(log_c), float(p), pts[0][0]


def steps_to_show(effect, bound) -> dict:
    """When `effect` (per step) would first exceed `bound` (per step, or one number). The effect is fitted as
    c * step^p; the bound as its step-1 value plus a growth c' * (step - 1)^q (the noise twin starts one unit in the
    last place away, an offset that dominates its first steps, so a power law fitted to the bound itself takes it for
    slow growth and the estimate comes too early: on an H100 and on a CPU, 60 bf16 steps stayed inside the bound
    where that fit had said about 50). {"step": the first step it is already beyond the bound, or the fitted
    crossing (None: not within HORIZON steps, or the bound grows as fast), "seen": whether it is beyond within the
    steps run, "effect_p" and "bound_p": the fitted powers (p, and q of the bound's growth; 0 for a bound that does
    not grow), "fitted_from": the first step of the effect's fit, "as_fast": whether the bound grows at least as
    fast as the effect}."""
    effect = [float(v) for v in effect]
    bound = np.broadcast_to(np.asarray(bound, dtype=float), (len(effect),)).tolist()
    over = [i + 1 for i, (e, b) in enumerate(zip(effect, bound)) if math.isfinite(e) and e > b]
    out = {"step": over[0] if over else None, "seen": bool(over), "effect_p": None, "bound_p": None,
           "fitted_from": None, "as_fast": None}
    if over or not bound or not math.isfinite(bound[0]):
        return out
    fe = power_fit(effect)
    if fe is None:
        return out
    ce, pe, first = fe
    growth = power_fit([b - bound[0] for b in bound[1:]])  # index i is step i + 2: (step - 1)^q
    cb, pb = (growth[0], growth[1]) if growth is not None else (None, 0.0)
    out.update(effect_p=round(pe, 2), bound_p=round(pb, 2), fitted_from=first, as_fast=pe <= pb)
    if pe <= pb:
        return out
    flat = max(b for b in bound if math.isfinite(b))  # no growth seen: the bound as it stood

    def beyond(step: int) -> bool:
        at = bound[0] + math.exp(cb) * (step - 1) ** pb if cb is not None else flat
        return ce + pe * math.log(step) > math.log(at)

    lo, hi = len(effect), len(effect) + 1  # the effect is inside at lo (and before), beyond at hi once found
    while not beyond(hi):
        if hi >= HORIZON:
            return out
        lo, hi = hi, min(2 * hi, HORIZON)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if beyond(mid) else (mid, hi)
    out["step"] = hi
    return out


def estimate_words(est: dict, dtype: str, on: str = "the weights") -> str:
    """steps_to_show's answer in words, for the float32 effect `on` the weights (or a metric)."""
    if est["seen"]:
        return f"its float32 effect on {on} is already beyond the {dtype} bound at step {est['step']}"
    if est["effect_p"] is None:
        return f"the float32 effect on {on} is too small or too short to say after how many steps it would show"
    how = (f"the float32 effect on {on} grew as step^{est['effect_p']:g} from step {est['fitted_from']} on and the "
           f"{dtype} bound on it, beyond its step-1 value, as step^{est['bound_p']:g}")
    if est["step"] is None:
        if est["as_fast"]:
            return f"running longer in {dtype} would not show it on {on}: {how}"
        return f"{how}: at that pace it would show in {dtype} only after more than {HORIZON:,} steps"
    return (f"{how}: at that pace it would leave the {dtype} bound after about {est['step']:,} steps (an extrapolation: "
            "it may show sooner on another metric, or much later)")


# ---------------------------------------------------------------------------------------------
# the float32 pair
# ---------------------------------------------------------------------------------------------
def weights_bound(envelope, mode: str, dtype: str, k: float, steps: int) -> np.ndarray:
    """The bound a pair held the weights' distance to, per step: its noise twin's `envelope` (calibrated), else the
    static one (`envelope` None)."""
    from harness.diagnose.compare import load_tolerances, param_limit

    limit = param_limit(load_tolerances(), mode, dtype, calibrated=envelope is not None)
    at = envelope.at("param_rel_l2", range(1, steps + 1)) if envelope is not None else None
    return np.broadcast_to(np.asarray(noise.bound(limit, at, k), dtype=float), (steps,)).copy()


def against_bound(effect: list[float], envelope, mode: str, dtype: str, k: float, steps: int) -> dict:
    """A float32 effect on the weights held against the bound of the `dtype` pair with noise `envelope` over the
    steps both cover: {"bound": per step, "estimate": steps_to_show}."""
    low = weights_bound(envelope, mode, dtype, k, min(len(effect), steps))
    return {"bound": low.tolist(), "estimate": steps_to_show(effect[:len(low)], low)}


def escalate(cell, data, mode: str, progress: bool, log, store, backend, attribute, own_pair) -> dict:
    """The cell's pair (`data`, its CellData) again in float32 into its folder's float32/, attributed there by
    `attribute` (the same flow as the cell: matrix.run_cell passes attribution's `attribute` and `own_pair`, which
    import the explanation, which imports this module); what it found, in words too."""
    from harness.diagnose.cell import relative_l2
    from harness.diagnose.preflight import apply_alignment

    dtype, steps = cell.spec.DTYPE, max(cell.spec.STEPS, MIN_STEPS)
    spec32 = apply_alignment(cell.spec, {"set": {**FLOAT32, "STEPS": steps}})
    folder = Path(data.folder) / FOLDER
    log(f"    {cell.name}: no effect in {dtype}; the same pair in float32 ({steps} steps) before saying it cannot show")
    data32 = own_pair(spec32, mode, lambda: backend.run_pair(spec32, folder, mode, progress, store=store, keep=True))
    result32 = data32.comparison
    details = attribute(dataclasses.replace(cell, spec=spec32), result32, folder, mode, progress, log, store, backend,
                        data=data32)
    effect = relative_l2(data32.sketch("scratch"), data32.sketch("trl")) or []
    k = data.comparison.get("k_noise") or 10.0
    out = {"dtype": dtype, "steps": steps, "dir": str(folder), "first_divergence": result32["first_divergence"],
           "attribution_detail": details, "effect": [float(e) for e in effect],
           "confirmed": [d["cause"] for d in details if d.get("status") == "confirmed"]}
    if not effect:
        out["words"] = _words(out, None, None)
        return out
    out.update(against_bound(out["effect"], data.envelope, mode, dtype, k, cell.spec.STEPS))
    high = None
    if result32["first_divergence"] is None:  # how far float32 itself is from showing it
        high = steps_to_show(effect, weights_bound(data32.envelope, mode, "float32", result32.get("k_noise") or k,
                                                   len(effect)))
        out["estimate_float32"] = high
    out["words"] = _words(out, out["estimate"], high)
    return out


def _words(found: dict, est: dict | None, est32: dict | None) -> str:
    dtype, fd = found["dtype"], found["first_divergence"]
    if fd is not None:
        who = " + ".join(found["confirmed"])
        text = (f"shows in float32 at step {fd['step']} on {fd['metric']}"
                + (f" ({who}, confirmed by a float32 re-run with it aligned)" if who else
                   ", but no float32 re-run with a difference aligned brings the sides back together")
                + f"; in {dtype} the sides' own rounding hides it")
    else:
        last = found["effect"][-1] if found["effect"] else None
        text = f"no effect even in float32 over {found['steps']} steps" + (
            f" (the weights end {last:.2g} apart, relative L2)" if last is not None else "")
        why = [d.get("evidence") for d in found["attribution_detail"] if d.get("evidence")]
        from harness.diagnose.showable import AGREE_WITHIN

        why = [w for w in why if w != AGREE_WITHIN]
        if why:
            text += f": {why[0]}"
        if est32 is not None and est32["step"] is not None:
            text += f"; in float32 it would show after about {est32['step']:,} steps"
    if est is not None:
        text += f"; {estimate_words(est, dtype)}"
    return text


# ---------------------------------------------------------------------------------------------
# your loop at parity in bf16
# ---------------------------------------------------------------------------------------------
def wants_float32_loop(cell, mode: str, result: dict) -> bool:
    """Whether your loop's bf16 parity with TRL is worth a float32 pair: lockstep, one process, FLOAT32_CHECK not
    `off`. At parity in bf16 a setting of your loop may still differ from TRL's below bf16's rounding over these
    steps (Adam's beta2 0.9 against 0.98, a learning rate 2% apart) and part the curves later."""
    return (cell.spec.FLOAT32_CHECK != "off" and mode == "lockstep" and cell.spec.DTYPE != "float32"
            and tuple(cell.sides) == ("yours", "trl") and cell.spec.PROCESSES == 1
            and result.get("first_divergence") is None)


def escalate_loop(cell, data, log, explain) -> dict:
    """Your loop and TRL again in float32 into the cell folder's float32/, on the bf16 pair's own rollouts
    (`data`: the cell, CellData; training only, as the explanation's float32 search runs), with a float32 noise twin
    of the built-in loop for the tolerance. Where the two part, `explain` (the explanation: matrix.run_cell passes
    it, since it imports this module) runs on that float32 cell (what TRL setting makes it your loop); a finding is
    one it confirms with a difference named. Where it names none, your loop runs once more in float32: if it parts
    from itself, it is not deterministic and float32 cannot tell. Where your loop's float32 run logs exactly what its
    bf16 run did, it does not read DTYPE and float32 can tell nothing. `words` says which; `finding` whether the
    bf16 parity hides a difference."""
    from harness.diagnose.preflight import apply_alignment

    dtype, steps = cell.spec.DTYPE, cell.spec.STEPS
    spec32 = apply_alignment(cell.spec, {"set": FLOAT32})
    folder = _fresh_folder(data.folder)
    log(f"    {cell.name}: parity in {dtype}; your loop and TRL again in float32 on the same rollouts "
        f"({_steps(steps)}), since {dtype}'s rounding can hide a setting over a few steps")
    out = {"dtype": dtype, "steps": steps, "dir": str(folder), "first_divergence": None, "attribution_detail": [],
           "effect": [], "confirmed": [], "loop": True, "finding": False}
    mine, same = your_loop_in_float32(spec32, data, folder)
    if same is not False:
        out["loop_ignores_dtype"] = same
        out["words"] = _ignores_dtype_words(same, dtype)
        return out
    data32 = _loop_cell32(spec32, data, folder, mine)
    out["first_divergence"] = fd = data32.comparison["first_divergence"]
    if fd is None:
        out["words"] = (f"your loop and TRL agree in float32 too over {_steps(steps)}: no difference that {dtype}'s "
                        "rounding hides shows at this length (one smaller still may part them over more steps)")
        return out
    out["attribution_detail"] = details = explain(spec32, folder, data32.comparison, log, table=(
        Path(data.folder).parent / EXPLAIN_FILE, f"{cell.name}, its float32 pair"), data=data32)
    return _loop_finding(out, details[0], cell, data, data32, mine)


def _loop_cell32(spec32, data, folder: Path, mine):
    """The float32 cell of your loop: TRL in float32 on the cell's records into folder/trl, a float32 noise twin of
    the built-in loop for the tolerance, compared with your float32 run (`mine`, its log): a CellData."""
    from harness.diagnose.cell import read_sketch, your_loop_files
    from harness.diagnose.compare import load_tolerances
    from harness.diagnose.pairs import compare_loaded
    from harness.rollouts.lockstep import ReplaySource
    from trl_runner.runner import train as train_trl

    records = list(data.records)
    envelope = None
    if spec32.TOLERANCE == "calibrated":
        envelope = float32_twin(spec32, records, folder)
        noise.save(envelope, folder, noise.k_of(load_tolerances()), str(folder / "twin"))
    train_trl(spec32, folder / "trl", rollout_source=ReplaySource(records), progress=False, lockstep=True)
    sketches = {str(folder / "trl"): read_sketch(folder / "trl")}
    result32, runs = compare_loaded(spec32, folder / "yours", folder / "trl", "lockstep", envelope, sketches,
                                    runs={"yours": mine})
    mine32 = your_loop_files(folder / "yours", None)  # (its rollouts are the cell's: the scores are in hand)
    return dataclasses.replace(data, spec=spec32, folder=folder, comparison=result32, runs=runs, envelope=envelope,
                               sketches=sketches, **{k: v for k, v in mine32.items() if k != "scores"})


def _loop_finding(out: dict, lead: dict, cell, data, data32, mine) -> dict:
    """What the explanation of your loop's float32 pair found (`lead`, its verdict entry), in `out`."""
    from harness.diagnose.cell import read_sketch, relative_l2
    from harness.diagnose.compare import compare_frames, load_tolerances

    dtype, steps, fd = cell.spec.DTYPE, cell.spec.STEPS, out["first_divergence"]
    out["confirmed"] = [lead["cause"]] if lead.get("status") == "confirmed" else []
    where = f"in float32 your loop parts from TRL at step {fd['step']} on {fd['metric']}"
    hidden = f"in {dtype} the sides' own rounding hides it over {_steps(steps)}"
    if lead.get("status") == "confirmed" and lead.get("differences"):
        out["finding"] = True
        # your loop saves its weights at its last step only: the built-in loop with what the explanation found,
        # which matched your loop at every step, stands in for it on the weights per step
        matched = lead.get("matched_by")
        effect = relative_l2(data32.sketches.get(str(Path(matched))) or read_sketch(Path(matched)),
                             data32.sketch("trl")) if matched else None
        said = ", ".join(f"{d['field']} = {d['value']}" for d in lead["differences"])
        text = f"{where} ({lead['cause']}, confirmed); {hidden}"
        if effect:
            out["effect"] = [float(e) for e in effect]
            k = data.comparison.get("k_noise") or noise.k_of(load_tolerances())
            out.update(against_bound(out["effect"], data.envelope, "lockstep", dtype, k, steps))
            text += (f"; estimated on the weights of the built-in loop with {said}, which matched your loop at every "
                     f"step (yours saves only its final weights): {estimate_words(out['estimate'], dtype)}")
        out["words"] = text
        return out
    if lead.get("status") == "confirmed":  # the built-in loop as TRL is your loop, TRL is not: not yours to fix
        out["words"] = (f"{where}, but the built-in loop set up as TRL matches your loop there: the difference is "
                        "between the built-in loop and TRL in float32, not in your loop's settings")
        return out
    again, _same = your_loop_in_float32(data32.spec, data, data32.folder, "yours-again")
    itself = compare_frames(mine, again, mode="lockstep", dtype="float32", tolerances=load_tolerances(),
                            one_sided="not_compared", envelope=data32.envelope)["first_divergence"]
    if itself is not None:
        out["loop_nondeterministic"] = itself
        out["words"] = (f"{where}, but two float32 runs of your loop on the same rollouts part from each other too "
                        f"(at step {itself['step']} on {itself['metric']}): it is not deterministic, so float32 cannot "
                        f"tell a setting from its own noise; the {dtype} parity holds over {_steps(steps)}")
        return out
    out["finding"] = True  # a real difference, repeatable, that no setting the search knows explains
    out["words"] = f"{where} and no setting the search knows explains it ({lead['cause']}, {lead['status']}); {hidden}"
    return out


def _fresh_folder(cell_dir: Path) -> Path:
    """cell_dir/float32, emptied, with the cell's two rollout files copied in (a float32 cell's own copy, for
    whoever reads the folder later; your float32 runs read the cell's)."""
    from harness.rollouts.lockstep import LOOP_ROLLOUTS_FILE, ROLLOUTS_FILE

    folder = Path(cell_dir) / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in (ROLLOUTS_FILE, LOOP_ROLLOUTS_FILE):
        shutil.copyfile(Path(cell_dir) / name, folder / name)
    return folder


def _ignores_dtype_words(same: bool | None, dtype: str) -> str:
    """Why float32 can tell nothing: your loop's float32 run logged what its `dtype` run did (`same`), or nothing
    it logs can tell (None)."""
    return (f"your loop's float32 run logged exactly what its {dtype} run did, step for step: it does not "
            f"read DTYPE from PARITY_SPEC, so float32 cannot show what {dtype}'s rounding may hide (read "
            "DTYPE as examples/my_grpo.py does to have it checked)" if same else
            "nothing your loop logs tells whether it read DTYPE over one step (the step-1 loss is the same "
            "in any dtype): log grad_norm, or run more steps, to have the parity checked in float32")


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")
