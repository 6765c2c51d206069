"""The tensor diff: a GRPO step's dataflow, compared tensor by tensor, and the first link that differs explained.

A step is a short chain (harness/runlog/tensors.py, CHAIN): rewards -> advantages -> the loss's mask -> log-probs
(policy, old, reference) -> per-token loss -> the aggregated loss -> the gradient norm. Your loop saves any subset
with `harness.loop.tensors(step, ...)`; the built-in loop, set up as TRL, saves all of them on the same rollouts.
`diff` walks the chain in order, step by step, and names the first tensor that differs: where (how many groups,
sequences and tokens; the first (group, sequence, token)) and how, from a catalog of patterns each recomputed from
the other side's own inputs rather than guessed:

- rewards: your scores differ (your reward code or weights; TRL has no setting, use the spec's reward functions);
- advantages: recomputed from the same rewards with each advantage option (scale by group / batch / none, Bessel's
  or the population std, the std epsilon, epsilon inside the square root); the one that reproduces yours names the
  field; else the shape (a constant factor per group, an offset);
- mask: one token fewer at the end of each completion that ends with an eos (the eos out of the loss), the padding
  counted, truncated completions dropped;
- log-probs: every token of every row differs (the forward pass: attention mask or positions around the prompt's
  eos, a temperature applied or not, the dtype), or only some rows;
- per-token loss with equal inputs: the KL term or the clip bounds;
- the loss with equal per-token losses and mask: recomputed under each loss_type's normalisation;
- grad_norm with an equal loss: a term equal in value but not in gradient (the KL multiplied by the policy ratio,
  use_bias_correction_kl, which is 1 in value at the first pass), or the gradient's clipping.
Each pattern maps to spec changes (`candidates`: TRL's settings or the built-in loop's quirks) that the explanation
search tries first, and to words; a pattern TRL has no setting for is said so.

Either side may be any run folder with a `tensors.jsonl`: your loop's, the built-in loop's, or TRL's own
(`trl_runner.runner.train(..., tensor_steps=N)` reads them from inside GRPOTrainer). `diff_runs` compares two such
folders on the rollouts both trained on.
"""

from __future__ import annotations

import math

from harness.diagnose.fields import FIELDS
from harness.runlog.tensors import CHAIN, PER_TOKEN

# what each link is computed from (a link that differs while all of these agree differs on its own)
DEPENDS = {"rewards": (), "advantages": ("rewards",), "mask": (), "logps": (), "old_logps": (), "ref_logps": (),
           "per_token_loss": ("advantages", "logps", "old_logps", "ref_logps"), "loss": ("per_token_loss", "mask"),
           "grad_norm": ("per_token_loss", "mask", "logps", "loss")}
# a tensor only your loop has, and what it says
ONLY_YOURS = {"ref_logps": ("your loop scores a reference model: a KL term (beta > 0; the built-in loop as TRL has none)",
                            [{"BETA": v} for v in FIELDS["BETA"].guesses["ref_logps"]]),
              "old_logps": ("your loop takes the old log-probs from a pass of their own (TRL, one pass per round: the "
                            "current ones, detached)", [{"LOGP_OLD": "forward"}])}
_WHAT = {"rewards": "the rewards", "advantages": "the advantages", "mask": "the loss's token mask",
         "logps": "the policy's per-token log-probs", "old_logps": "the old policy's log-probs",
         "ref_logps": "the reference model's log-probs", "per_token_loss": "the per-token loss",
         "loss": "the aggregated loss", "grad_norm": "the gradient norm"}


def _rows(value, lengths: list[int] | None) -> list[list[float]] | list[float] | float | None:
    """A per-token tensor cut to each completion's length; others as they are."""
    if value is None:
        return None
    if lengths is not None and isinstance(value, list) and value and isinstance(value[0], list):
        return [row[:n] for row, n in zip(value, lengths)]
    return value


def _flat(value) -> list[float]:
    if isinstance(value, list):
        return [float(x) for v in value for x in (_flat(v) if isinstance(v, list) else [v])]
    return [float(value)]


LOG_PROBS = ("logps", "old_logps", "ref_logps")


def _masked(rows, keep) -> list[list[float]] | None:
    """Per-token rows with 0 wherever `keep` (your loop's loss mask, row by row) is 0."""
    if not isinstance(rows, list) or not isinstance(keep, list) or len(rows) != len(keep):
        return rows
    return [[x if k else 0.0 for x, k in zip(row, krow)] + row[len(krow):] if isinstance(row, list) and
            isinstance(krow, list) else row for row, krow in zip(rows, keep)]


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= atol + rtol * abs(b)


def _where(a, b, group: int, atol: float, rtol: float) -> dict | None:
    """None when equal within tolerance; else how many rows/tokens differ and the first (group, sequence, token)."""
    if isinstance(a, list) and a and isinstance(a[0], list):
        bad_rows, tokens, first = [], 0, None
        for i, (ra, rb) in enumerate(zip(a, b)):
            if len(ra) != len(rb):
                bad_rows.append(i)
                first = first or (i, min(len(ra), len(rb)))
                continue
            hits = [t for t, (x, y) in enumerate(zip(ra, rb)) if not _close(float(x), float(y), atol, rtol)]
            if hits:
                bad_rows.append(i)
                tokens += len(hits)
                first = first or (i, hits[0])
        if len(a) != len(b):
            bad_rows.append(min(len(a), len(b)))
        if not bad_rows:
            return None
        i, t = first or (bad_rows[0], 0)
        return {"rows": len(set(bad_rows)), "of_rows": len(b), "tokens": tokens,
                "groups": len({r // group for r in bad_rows}), "first": {"group": i // group, "sequence": i % group,
                                                                         "token": t}}
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return {"rows": max(len(fa), len(fb)), "of_rows": len(fb), "groups": None, "first": None,
                "shape": [len(fa), len(fb)]}
    bad = [i for i, (x, y) in enumerate(zip(fa, fb)) if not _close(x, y, atol, rtol)]
    if not bad:
        return None
    return {"rows": len(bad), "of_rows": len(fb), "groups": len({i // group for i in bad}) if len(fb) > 1 else None,
            "first": {"group": bad[0] // group, "sequence": bad[0] % group} if len(fb) > 1 else None}


def diff(yours: dict[int, dict], ref: dict[int, dict], spec, lengths: dict[int, list[int]], eos_ids: list[int],
         prompts_have_eos: bool, atol: float = 1e-5, rtol: float = 1.3e-6,
         ends_with_eos: dict[int, list[bool]] | None = None,
         scores: dict[int, dict[str, list[float]]] | None = None) -> dict | None:
    """The first differing link of the chain. `yours`, `ref`: {step: {tensor: value}} (read_tensors);
    `lengths`: {step: each completion's length}; `ends_with_eos`: {step: whether each completion ends with an eos}
    (without it a mask one token short is not named the eos); `scores`: {step: each reward function's scores} (for
    rewards weighted otherwise); returns None when your loop saved no tensor both sides have."""
    steps = sorted(set(yours) & set(ref))
    chain_at: list[dict] = []
    for step in steps:
        a, b, n = yours[step], ref[step], lengths.get(step)
        if chain_at and all(c["status"] != "differs" for c in chain_at):  # the step before agreed everywhere
            b = {**b, "_after_clean_step": True}
        chain_at = []
        first = None
        status: dict[str, str] = {}
        for name in CHAIN:
            if name not in a or name not in b:
                status[name] = "not saved" if name not in a else "not on this side"
                link = {"tensor": name, "status": status[name]}
                if name in a and name in ONLY_YOURS and step == steps[0] and not _old_is_current(a, n, spec, atol, rtol):
                    link["how"], link["candidates"] = ONLY_YOURS[name]
                    link["only_yours"] = True
                chain_at.append(link)
                continue
            if name in PER_TOKEN:
                ta, tb = _rows(a[name], n), _rows(b[name], n)
                if name in LOG_PROBS and "mask" in a:  # a token your loss does not count cannot move your training:
                    keep = _rows(a["mask"], n)  # its log-prob is not compared (a loop may save 0 where it scores none)
                    ta, tb = _masked(ta, keep), _masked(tb, keep)
            else:  # one value per completion, or one number: (N, 1) and (N,) alike
                ta, tb = _flat(a[name]), _flat(b[name])
                ta, tb = (ta[0], tb[0]) if len(ta) == len(tb) == 1 else (ta, tb)
            where = _where(ta, tb, spec.GROUP_SIZE, atol, rtol)
            if where is None:
                status[name] = "same"
                chain_at.append({"tensor": name, "status": "same"})
                continue
            status[name] = "differs"
            how = _explain(name, a, b, spec, n, eos_ids, prompts_have_eos, atol, rtol,
                           (ends_with_eos or {}).get(step), (scores or {}).get(step))
            upstream = [d for d in DEPENDS[name] if status.get(d) == "differs"]
            # what it is computed from differs: most likely a consequence, unless recomputed exactly or read from
            # your loop's own inputs to it (the loss's divisor, from your own per-token losses)
            if upstream and not how.get("exact") and not how.get("own_inputs"):
                how = {"how": f"follows from {', '.join(upstream)} before it in the chain", "candidates": []}
            else:
                how["independent"] = True  # its own inputs agree (or were not saved): a difference of its own
            chain_at.append({"tensor": name, "status": "differs", "where": where, **how})
            if first is None:
                first = {"step": step, "tensor": name, "where": where, **how}
        if first is not None:
            # every link whose difference was recomputed exactly (not a consequence guessed at) acts on its own:
            # their changes together are the first guess, then the first link's own candidates
            return {"first": first, "chain": chain_at, "steps": steps, "guesses": guesses_of(chain_at, first)}
    if not steps or not chain_at or all(c["status"] != "same" for c in chain_at):
        return None
    return {"first": None, "chain": chain_at, "steps": steps}


def _old_is_current(a: dict, lengths, spec, atol: float, rtol: float) -> bool:
    """Your loop's old log-probs are its current ones (an extra pass at the same weights, or the same ones saved
    twice): what TRL takes too, so nothing to name."""
    if "old_logps" not in a or "logps" not in a:
        return False
    return _where(_rows(a["old_logps"], lengths), _rows(a["logps"], lengths), spec.GROUP_SIZE, atol, rtol) is None


def in_rollout_order(mine: dict[int, dict], chosen: dict, sizes: list[int], per_round: int) -> tuple[dict, str | None]:
    """Your saved tensors with the rows of each step named in `chosen` (harness.loop.trained: the rows in the order
    your micro-batches took them, as your tensors hold them) put back in the rollout's order, where that step trained
    on its whole round (s - 1) // per_round in an order of its own: (tensors, None). (mine, why not) where a step
    trained on other rows (part of a round, several rounds, groups skipped): the diff compares whole rounds."""
    from harness.runlog.tensors import PER_ROW, PER_TOKEN

    out = {}
    for step, t in mine.items():
        picks, r = chosen.get(step), (step - 1) // max(per_round, 1)
        if picks is None:
            out[step] = t
            continue
        if r >= len(sizes) or sorted(picks) != [(r, i) for i in range(sizes[r])]:
            whole = picks and sorted(picks) == [(picks[0][0], i) for i in range(sizes[picks[0][0]])] \
                if picks and picks[0][0] < len(sizes) else False
            return mine, ("your loop trains on " + ("whole rounds at a pace of its own (several passes over each: "
                                                    "harness.loop.trained)" if whole else "completions of its own "
                                                    "choosing (harness.loop.trained)")
                          + ": its steps are read stage by stage from its own tensors instead")
        out[step] = dict(t)
        for name in (*PER_ROW, *PER_TOKEN):
            value = t.get(name)
            if isinstance(value, list) and len(value) == len(picks):
                back = [None] * len(picks)
                for row, (_, i) in zip(value, picks):
                    back[i] = row
                out[step][name] = back
    return out, None


def chain_facts(spec, records: list[dict], scores_by_round: list[dict] | None = None) -> dict:
    """What the diff needs besides the tensors, from the lockstep rollouts both sides trained on: each step's
    completion lengths and whether each ends with an eos, the eos ids, whether a prompt holds an eos, the
    tolerance of the spec's dtype, and (given `scores_by_round`, from your loop's rollouts file: `round_scores`)
    each step's reward functions' scores."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer

    per_round = spec.STEPS_PER_GENERATION * spec.NUM_ITERATIONS
    steps = range(1, len(records) * per_round + 1)
    lengths = {s: [len(c) for c in records[(s - 1) // per_round]["completion_ids"]] for s in steps}
    ckpt = checkpoint_dir(spec)
    tokenizer = load_tokenizer(ckpt)
    eos = eos_token_ids(generation_config(ckpt), tokenizer)
    ends = {s: [bool(c) and c[-1] in eos for c in records[(s - 1) // per_round]["completion_ids"]] for s in steps}
    has_eos = any(t in eos for ids in records[0]["prompt_ids"] for t in ids) if records else False
    atol, rtol = (1e-5, 1.3e-6) if spec.DTYPE == "float32" else (1e-2, 1.6e-2)
    scores = {s: scores_by_round[(s - 1) // per_round] for s in steps
              if scores_by_round and (s - 1) // per_round < len(scores_by_round)}
    return {"lengths": lengths, "eos_ids": eos, "ends_with_eos": ends, "prompts_have_eos": has_eos,
            "atol": atol, "rtol": rtol, "scores": scores, "pad_id": tokenizer.pad_token_id}


def round_scores(path) -> list[dict[str, list]]:
    """Each round's reward-function scores ({function: [score per completion]}) from your loop's rollouts file
    (loop_rollouts.jsonl, `write_loop_rollouts`); [] where there is none."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line).get("rewards") or {} for line in path.read_text().splitlines() if line.strip()]


def diff_runs(spec, yours_dir, ref_dir, records: list[dict]) -> dict | None:
    """`diff` of two run folders' tensors.jsonl (any sides: your loop, the built-in loop, TRL), trained on the same
    lockstep `records`; `spec` is the reference side's (the patterns are recomputed under its settings)."""
    from pathlib import Path

    from harness.runlog.tensors import TENSORS_FILE, read_tensors

    f = chain_facts(spec, records)
    return diff(read_tensors(Path(yours_dir) / TENSORS_FILE), read_tensors(Path(ref_dir) / TENSORS_FILE), spec,
                f["lengths"], f["eos_ids"], f["prompts_have_eos"], f["atol"], f["rtol"], f["ends_with_eos"])


def guesses_of(chain: list[dict], first: dict) -> list[dict]:
    """What to try first: the changes of every link whose difference was recomputed exactly (each acts on its own:
    together they are one guess), then each independent link's own candidates."""
    exact = {}
    for link in chain:
        if link.get("exact") and link.get("candidates"):
            exact.update(link["candidates"][0])
    out = [exact] if exact else []
    for link in [first] + [c for c in chain if c.get("independent") or c.get("only_yours")]:
        out += [c for c in link.get("candidates", []) if c not in out and {**exact, **c} not in out]
    return out


def round_weights(w: list[float]) -> list[float]:
    """Fitted weights to 4 significant digits, and 0 for a weight under 1e-6 of the largest (least squares leaves
    -6e-17 where a function's weight is 0, and the rounding to 4 digits keeps it)."""
    top = max((abs(v) for v in w), default=0.0)
    return [0.0 if abs(v) <= 1e-6 * top else float(f"{v:.4g}") for v in w]


def fit_reward_weights(rewards: list[float], scores: dict[str, list[float]], atol: float, rtol: float) -> list | None:
    """The weights w with rewards = sum_k w_k * scores[k] (each completion's total from the spec's reward functions'
    scores, in the spec's order), fitted by least squares and rounded to 4 significant digits; None when no weights
    give `rewards` within atol + rtol * |reward| (your loop scores otherwise), or when the scores cannot tell the
    weights apart (a function scoring like another, or too few completions)."""
    import torch

    columns = list(scores.values())
    if not columns or not rewards or any(len(c) != len(rewards) for c in columns):
        return None
    keep = [i for i, r in enumerate(rewards) if r == r and all(c[i] is not None for c in columns)]  # no NaN score
    x = torch.tensor([[c[i] for c in columns] for i in keep], dtype=torch.float64).reshape(len(keep), len(columns))
    y = torch.tensor([rewards[i] for i in keep], dtype=torch.float64)
    if int(torch.linalg.matrix_rank(x)) < len(columns):
        return None
    w = round_weights(torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist())
    fit = x @ torch.tensor(w, dtype=torch.float64)
    return w if bool(((fit - y).abs() <= atol + rtol * y.abs()).all()) else None


def _rewards(a, spec, atol, rtol, scores) -> dict:
    """Your loop's rewards: the spec's reward functions weighted otherwise (TRL's reward_weights), or other code."""
    w = fit_reward_weights(_flat(a.get("rewards")), scores or {}, atol, rtol)
    if w is not None and w != [float(v) for v in spec.rewards.weights]:
        return {"how": f"your loop weighs the reward functions ({', '.join(scores)}) {w} where the spec weighs them "
                       f"{list(spec.rewards.weights)}", "candidates": [{"rewards.weights": w}], "exact": True}
    return {"how": "your loop scores the same completions otherwise (its own reward code: no weighting of the spec's "
                   "reward functions gives its rewards)", "candidates": [],
            "trl_setting": "none: use the spec's reward functions in your loop, or name yours in [rewards] functions"}


def _explain(name, a, b, spec, lengths, eos_ids, prompts_have_eos, atol, rtol, ends=None, scores=None) -> dict:
    """How the first differing tensor differs, and what would make the built-in loop do the same."""
    if name == "rewards":
        return _rewards(a, spec, atol, rtol, scores)
    if name == "advantages":
        return _advantages(a, b, spec, atol, rtol)
    if name == "mask":
        return _mask(a["mask"], b["mask"], lengths, ends)
    if name in ("logps", "old_logps", "ref_logps") and b.get("_after_clean_step"):
        return {"how": "the log-probs part after a step whose tensors all agreed: the first update differs (the "
                       "learning rate, weight decay, Adam's epsilon, clipping, a KL term's gradient)",
                "candidates": [*({"WEIGHT_DECAY": v} for v in FIELDS["WEIGHT_DECAY"].values  # (a decay: not none)
                                 if v and v != spec.WEIGHT_DECAY),
                               *({"MAX_GRAD_NORM": v} for v in FIELDS["MAX_GRAD_NORM"].values if v != spec.MAX_GRAD_NORM),
                               *({"ADAM_EPS": v} for v in FIELDS["ADAM_EPS"].values if v != spec.ADAM_EPS)]}
    if name in ("logps", "old_logps", "ref_logps"):
        cands = []
        if prompts_have_eos:
            cands.append({"EOS_ATTENTION": "mask"})
        if spec.TEMPERATURE != 1.0:
            cands.append({"LOGP_ON_RAW_LOGITS": not spec.LOGP_ON_RAW_LOGITS})
        if name == "old_logps":
            return {"how": "the old policy's log-probs differ: taken from another pass (TRL, one pass per round: the "
                           "current log-probs, detached)", "candidates": [{"LOGP_OLD": "forward"}] + cands}
        return {"how": "the forward pass scores the same tokens otherwise (the attention mask or positions around "
                       "the prompt's eos, a temperature applied or not, another dtype)", "candidates": cands}
    if name == "per_token_loss":
        cands = [{"BETA": v} for v in FIELDS["BETA"].guesses["per_token_loss"]] if spec.BETA == 0 else \
            [{"KL_ESTIMATOR": e} for e in FIELDS["KL_ESTIMATOR"].values]
        return {"how": "the per-token loss differs with the same advantages, mask and log-probs: a KL term, or the "
                       "clip bounds", "candidates": cands}
    if name == "loss":
        return _loss(a, spec, atol, rtol)
    if name == "grad_norm":
        cands = [{"KL_IS_CORRECTION": not spec.KL_IS_CORRECTION}] if spec.BETA > 0 else []
        mine, theirs = _flat(a.get("grad_norm")), _flat(b.get("grad_norm"))
        factor = f" (yours is {mine[0] / theirs[0]:.4g}x the other's)" if len(mine) == len(theirs) == 1 and theirs[0] else ""
        return {"how": "the gradient differs with an equal loss" + factor + ": a term equal in value but not in "
                       "gradient (a KL term multiplied by the policy ratio, which is 1 in value: "
                       "use_bias_correction_kl), a factor on a loss whose value is near 0 (as at a ratio of 1), or "
                       "the gradient's clipping",
                "candidates": cands + [{"MAX_GRAD_NORM": g} for g in FIELDS["MAX_GRAD_NORM"].values
                                       if g != spec.MAX_GRAD_NORM]}
    return {"how": "differs", "candidates": []}


def _advantages(a, b, spec, atol, rtol) -> dict:
    """Recompute the advantages from the built-in loop's own rewards with each option: the one that gives yours."""
    import torch

    from scratch_grpo.core import group_advantages

    rewards = torch.tensor(b.get("rewards") or [], dtype=torch.float32)
    mine = _flat(a["advantages"])
    found = []
    if len(rewards) == len(mine) and len(mine) % spec.GROUP_SIZE == 0:
        eps_values = (FIELDS["STD_EPS"].trl_fixed, *FIELDS["STD_EPS"].values)  # TRL's own first, then the search's
        options = [("group", "bessel", spec.STD_EPS, False)]
        options += [(sc, sd, eps, inside) for sc in FIELDS["ADV_SCALE"].values for sd in FIELDS["STD"].values
                    for eps in eps_values for inside in FIELDS["STD_EPS_INSIDE"].values]
        for scale, std, eps, inside in options:
            adv, _ = group_advantages(rewards, spec.GROUP_SIZE, scale, std, eps, inside)
            if all(_close(x, y, atol, max(rtol, 1e-5)) for x, y in zip(mine, adv.tolist())):
                change = {k: v for k, v in (("ADV_SCALE", scale), ("STD", std), ("STD_EPS", eps),
                                            ("STD_EPS_INSIDE", inside)) if v != getattr(spec, k)}
                if change and change not in found:
                    found.append(change)
        found.sort(key=len)
    ratio = [x / y for x, y in zip(mine, _flat(b["advantages"])) if abs(y) > 1e-6]
    shape = ""
    if ratio:
        groups = {}
        for i, (x, y) in enumerate(zip(mine, _flat(b["advantages"]))):
            if abs(y) > 1e-6:
                groups.setdefault(i // spec.GROUP_SIZE, []).append(x / y)
        if all(max(v) - min(v) <= 1e-4 * max(1.0, abs(max(v))) for v in groups.values()):
            shape = "a constant factor per group (the std or its epsilon)"
    if found:
        words = ", ".join(f"{k} = {v!r}" for k, v in found[0].items())
        alike = [", ".join(f"{k} = {v!r}" for k, v in f.items()) for f in found[1:3]]
        return {"how": (shape + "; " if shape else "") + f"recomputed from the same rewards with {words} they are "
                       "yours" + (f" ({'; '.join(alike)} give the same to the tolerance)" if alike else ""),
                "candidates": found[:3], "exact": True}
    return {"how": shape or "not one of the advantage options the built-in loop has", "candidates": []}


def _mask(mine, theirs, lengths, ends=None) -> dict:
    rows_mine = [sum(int(x) for x in r[:n]) for r, n in zip(mine, lengths or [len(r) for r in theirs])]
    rows_theirs = [sum(int(x) for x in r[:n]) for r, n in zip(theirs, lengths or [len(r) for r in theirs])]
    fewer = [t - m for m, t in zip(rows_mine, rows_theirs)]
    if lengths and ends and fewer and all(f in (0, 1) for f in fewer) and any(fewer):
        # exactly the completions that end with an eos lose exactly their last token
        last_off = all((f == 1) == bool(e) and (f == 0 or int(r[n - 1]) == 0)
                       for r, n, f, e in zip(mine, lengths, fewer, ends))
        if last_off:
            return {"how": "one token fewer at the end of each completion that ends with an eos: "
                           + FIELDS["COMPLETION_MASK"].diff_words["no_eos"],
                    "candidates": [{"COMPLETION_MASK": "no_eos"}], "exact": True}
    if all(m == 0 or m == t for m, t in zip(rows_mine, rows_theirs)) and any(m == 0 < t for m, t in
                                                                             zip(rows_mine, rows_theirs)):
        return {"how": "some completions are out of the loss entirely (truncated ones?)",
                "candidates": [{"MASK_TRUNCATED": True}]}
    return {"how": "your loop counts other tokens in the loss", "candidates": [{"COMPLETION_MASK": "all"}]}


def _loss(a, spec, atol, rtol) -> dict:
    """Recompute your step's loss from your own per-token loss and mask under each normalisation."""
    if "per_token_loss" not in a or "mask" not in a or "loss" not in a:
        return {"how": "the loss differs (save per_token_loss and mask to have its normalisation named)",
                "candidates": [{"LOSS_NORM": n} for n in FIELDS["LOSS_NORM"].guesses["loss"] if n != spec.LOSS_NORM]}
    rows = [[(float(x), float(m)) for x, m in zip(r, mr)] for r, mr in zip(a["per_token_loss"], a["mask"])]
    sums = [sum(x * m for x, m in r if not math.isnan(x)) for r in rows]
    counts = [sum(m for _, m in r) for r in rows]
    n = len(rows)
    values = {"sequence": sum(s / max(c, 1.0) for s, c in zip(sums, counts)) / max(n, 1),
              "token_global": sum(sums) / max(sum(counts), 1.0),
              "constant": sum(sums) / max(n * spec.MAX_TOKENS, 1)}
    if spec.GRAD_ACCUM == 1:
        values["token_local"] = values["token_global"]
    target = float(a["loss"])
    same = lambda v: _close(target, v, max(atol, 1e-7), 1e-4)  # noqa: E731
    if spec.LOSS_NORM in values and same(values[spec.LOSS_NORM]):  # yours aggregates as the spec does: not this link
        return {"how": "your per-token losses aggregate as the spec's own loss_type does: the difference is upstream",
                "candidates": []}
    hits = [k for k, v in values.items() if same(v) and k != spec.LOSS_NORM
            and not (spec.LOSS_NORM in values and math.isclose(v, values[spec.LOSS_NORM]))]
    if hits:
        return {"how": f"your per-token losses, aggregated as LOSS_NORM = {hits[0]!r}, give your loss",
                "candidates": [{"LOSS_NORM": h} for h in hits], "exact": True}
    how = "the loss's normalisation is none the built-in loop has" + (
        " (a mean per micro-batch, token_local, is not recomputed with GRAD_ACCUM above 1: its micro-batches may be "
        "shuffled)" if spec.GRAD_ACCUM > 1 else "")
    said, read = divisor_words(sums, counts, target, spec.GRAD_ACCUM)
    return {"how": f"{how}: {said}", "candidates": [], **({"own_inputs": True} if read else {})}


def divisor_words(sums: list[float], counts: list[float], loss: float, grad_accum: int) -> tuple[str, bool]:
    """(What your loss divides the masked per-token losses' sum by, in words; whether a divisor was read.) Against
    the tokens the mask holds (TRL's dapo divides by those) and the longest completion: a divisor above that per
    completion counts positions outside the completions, or is a fixed length (nano-aha-moment once divided by every
    position of its padded batch, prompt and padding included)."""
    total, tokens, n = sum(sums), sum(counts), max(len(counts), 1)
    if not math.isfinite(loss) or loss == 0:
        return f"your loss is {loss:g}: no divisor can be read from it", False
    if abs(total) < 1e-3 * max(sum(abs(x) for x in sums), 1e-30):
        return "the masked per-token losses sum to nearly 0 (they cancel): no divisor can be read from it", False
    k = total / loss
    if not math.isfinite(k) or k <= 0:
        return "it is not a positive multiple of the masked per-token losses' sum", False
    longest = max(counts, default=0)
    smallest = k / grad_accum
    out = f"your loss is the masked per-token losses' sum divided by {k:.4g}"
    if grad_accum > 1:
        out += f" ({smallest:.4g} if what you log is the mean of your {grad_accum} micro-batches' losses)"
    out += (f"; the mask holds {tokens:.0f} tokens in {n} completion{'s' * (n != 1)}, the longest {longest:.0f} "
            "(TRL's dapo divides by the tokens)")
    if smallest / n > longest + 0.5:
        out += (f"; {smallest:.4g} is {smallest / n:.3g} per completion, more than the longest completion: positions "
                "outside the completions (the prompt, the padding) counted, or a fixed length")
    return out, True


def words(found: dict | None) -> str | None:
    """One sentence: the first differing tensor, where and how."""
    if not found or not found.get("first"):
        return None
    f = found["first"]
    w = f.get("where") or {}
    at = w.get("first") or {}
    where = ""
    if w.get("of_rows"):
        where = f" in {w['rows']} of {w['of_rows']} " + ("rows" if f["tensor"] in PER_TOKEN else "values")
        if w.get("groups") is not None:
            where += f" ({w['groups']} groups)"
        if at:
            where += f", first at group {at.get('group')}, sequence {at.get('sequence')}" + (
                f", token {at['token']}" if "token" in at else "")
    return f"the first tensor that differs is {_WHAT[f['tensor']]} at step {f['step']}{where}: {f.get('how')}"
