"""generate(seed) -> (loop_source, answer): a self-contained GRPO loop with each stage's choice drawn from
vocab.STAGES, and the answer known by construction (the TRL fields, the built-in loop's switches, what no switch
reproduces, what 12 steps cannot show, the values the loop states)."""

from __future__ import annotations

import random

from tests.random_loops import template
from tests.random_loops.vocab import DEPENDS, REQUIRES, SCHEDULES, STAGES

DEFAULT_BOOST = 1.8  # a typical loop differs from TRL in 0-4 places


def draw(seed: int) -> dict[str, str]:
    """One choice per stage, by the vocabulary's weights; a stage that depends on another is left at its default
    where that one makes it moot, and a choice's requirements force the stages they name."""
    rng = random.Random(f"random-loops-{seed}")
    picked = {}
    for stage, choices in STAGES.items():
        names = [c[0] for c in choices]
        weights = [c[1] * (DEFAULT_BOOST if i == 0 and stage not in DEPENDS else 1) for i, c in enumerate(choices)]
        picked[stage] = rng.choices(names, weights=weights)[0]
    for stage, (other, moot) in DEPENDS.items():
        if picked[other] == moot:
            picked[stage] = STAGES[stage][0][0]
    for (stage, name), forced in REQUIRES.items():
        if picked[stage] == name:
            picked.update(forced)
    for stage, (other, moot) in DEPENDS.items():  # again: a forced choice may make a stage moot
        if picked[other] == moot:
            picked[stage] = STAGES[stage][0][0]
    return picked


def answer_of(picked: dict[str, str], seed: int) -> dict:
    trl, quirks, inexpressible, cannot_show, unsure, logged = {}, {}, [], [], [], []
    for stage, name in picked.items():
        if stage in DEPENDS and picked[DEPENDS[stage][0]] == DEPENDS[stage][1]:
            continue  # moot: no KL, no std
        part = next(c[2] for c in STAGES[stage] if c[0] == name)
        trl.update(part.get("trl", {}))
        quirks.update(part.get("quirks", {}))
        inexpressible += [[f"{stage}={name}", words] for words in part.get("inexpressible", [])]
        cannot_show += [list(x) for x in part.get("cannot_show", [])]
        unsure += part.get("unsure", [])
        logged += [list(x) for x in part.get("logged", [])]
    if picked["selection"] == "group_per_step" and "LOSS_DIVISOR" in quirks:  # the sum over the step's completions:
        quirks["LOSS_DIVISOR"] = 4.0  # one group of 4 (template: GROUP_SIZE 4), not a round's 16
    moot = []  # drawn, but with no effect on this loop by construction: nothing to name
    acts = {"adv_extra=drop_zero_adv": picked["agg"] in ("dapo", "bnpo_in_order") or picked["kl"] != "none"}
    if picked["forward"] == "ce_ignore_pad" and picked["mask"] == "ids_ne_pad":  # the pad id is out of the loss
        moot.append(f"log-prob 0 at the pad id {quirks.pop('LOGP_ZERO_ID')} (cross_entropy ignore_index)")
    moot += [words for code, words in inexpressible if not acts.get(code, True)]
    inexpressible = [[code, words] for code, words in inexpressible if acts.get(code, True)]
    if "DROP_ZERO_ADV" in quirks and not acts["adv_extra=drop_zero_adv"]:  # the mask shows it, the loss cannot
        moot.append("completions whose advantage is exactly 0 left out of the loss (their terms are 0 either way)")
        unsure.append("DROP_ZERO_ADV")
    if picked["passes"] == "1" or picked["passes"] == "2_old_each_pass":  # the ratio is 1 at every step
        for key in ("epsilon", "epsilon_high"):
            if key in trl:
                cannot_show.append([f"the clip bound {key} = {trl.pop(key)} (the ratio is always 1)", "clip"])
    elif "epsilon" in trl or "epsilon_high" in trl:
        unsure += [k for k in ("epsilon", "epsilon_high") if k in trl]  # bound reached or not: the run decides
    if picked["kl"] != "none" and picked["passes"] != "2" and picked["kl_ratio"] == "no_ratio":
        unsure.append("use_bias_correction_kl")
    if "MICRO_BATCH_ORDER" not in quirks:  # every drawn loop cuts its micro-batches in the rollout's order: true to
        unsure.append("MICRO_BATCH_ORDER")  # name, needed only where a micro-batch's own count divides (bnpo)
    if picked["grad_clip"] in ("0.5", "none"):  # (none: TRL's clip at 1 acts only where a norm reaches 1)
        unsure.append("max_grad_norm")  # a threshold no step's norm reaches cannot act: the scorer reads the norms
    name, warmup, horizon, kwargs = SCHEDULES[picked["schedule"]]
    stated = {"learning_rate": {"spec": 3e-3, "1e-3": 1e-3, "5e-3": 5e-3}[picked["lr"]],
              "schedule": {"name": name, "warmup_steps": warmup, "horizon": horizon, **kwargs}}
    differences = sorted(s for s, n in picked.items() if n != STAGES[s][0][0]
                         and not (s in DEPENDS and picked[DEPENDS[s][0]] == DEPENDS[s][1]))
    return {"seed": seed, "choices": picked, "differences": differences, "trl": trl, "quirks": quirks,
            "inexpressible": inexpressible, "cannot_show": cannot_show, "unsure": sorted(set(unsure)),
            "logged": logged, "moot": moot, "stated": stated}


def generate(seed: int) -> tuple[str, dict]:
    picked = draw(seed)
    return template.render(picked, seed), answer_of(picked, seed)
