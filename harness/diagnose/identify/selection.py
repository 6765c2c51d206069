"""The selection stage: which completions each optimizer step of your loop trained on (harness.loop.trained), against
TRL's one whole round per step."""

from __future__ import annotations

import numpy as np

from harness.diagnose.identify.finding import Finding

_FLAT = "every group whose rewards are all equal (advantage 0 for each of its completions; DAPO's dynamic sampling " \
        "filters them)"


def selection(chosen: dict[int, list[tuple[int, int]]], sizes: list[int], group: int, per_round: int,
              rewards: list[list[float]] | None = None, lengths: list[list[int]] | None = None,
              truncated: list[list[bool]] | None = None, path: str = "") -> Finding:
    """Which completions each optimizer step of your loop trained on (harness.loop.trained), against TRL's (step s:
    the whole round (s - 1) // per_round): how many per step, from how many rounds, each round over how many steps,
    each whole round trained in several passes (TRL's num_iterations), in an order of its own (the built-in loop
    replays it: micro-batches cut in that order), completions trained more than once, and the groups never trained
    with a rule that fits them (every group whose rewards are all equal: DAPO's dynamic sampling; every group of
    truncated completions; the groups of the lowest or highest mean reward) or none. Groups after the last one
    trained (a queue's pending groups when the run ended) are no evidence for or against a rule. `sizes`: each
    round's completions; `rewards`, `lengths`, `truncated`: per round, per completion."""
    steps = sorted(chosen)
    passes = _passes(chosen, sizes, per_round)
    if passes:
        return _whole_rounds(chosen, passes, per_round, path)
    words = []
    counts = [len(chosen[s]) for s in steps]
    per_step = f"{counts[0]}" if len(set(counts)) == 1 else f"{min(counts)} to {max(counts)}"
    rounds_per = [len({r for r, _ in chosen[s]}) for s in steps]
    words.append(f"trains each step on {per_step} completions" + (
        f" from {max(rounds_per)} rounds at once" if max(rounds_per) > 1 else ""))
    seen: dict[tuple[int, int], int] = {}
    steps_of: dict[int, set] = {}
    for s in steps:
        for r, i in chosen[s]:
            seen[(r, i)] = seen.get((r, i), 0) + 1
            steps_of.setdefault(r, set()).add(s)
    used_rounds = sorted(steps_of)
    spread = {len(v) for v in steps_of.values()}
    if max(spread) > 1 and max(rounds_per) == 1:
        words.append(f"taking each round over {min(spread)}" + (f" to {max(spread)}" if len(spread) > 1 else "")
                     + " steps, a part at a time (TRL: steps_per_generation, on shuffled slices)")
    again = sum(1 for v in seen.values() if v > 1)
    if again:
        words.append(f"trains {again} completion(s) more than once (a replay buffer, or several passes)")
    trained_groups = {(r, i // group) for r, i in seen}
    skipped = sorted({(r, i // group) for r in used_rounds for i in range(sizes[r])} - trained_groups)
    partial = [(r, g) for r, g in trained_groups if any((r, g * group + j) not in seen for j in range(group))]
    pending = [k for k in skipped if k > max(trained_groups)]  # after the last group trained: still queued, maybe
    evidence = [k for k in skipped if k not in pending]
    rule = _rule(evidence, sorted(trained_groups), pending, used_rounds, sizes, group, rewards, truncated) \
        if evidence and rewards is not None else None
    if rule == _FLAT:  # the pending groups the rule leaves out as well are skipped by it: said as such
        flat = _flat(rewards, used_rounds, sizes, group)
        evidence, pending = sorted(evidence + [k for k in pending if k in flat]), [k for k in pending if k not in flat]
    if evidence:
        words.append(f"and never trains on {len(evidence)} of the {sum(sizes[r] // group for r in used_rounds)} "
                     "groups of the rounds it reads: " + (rule if rule else "no rule on their rewards' spread, mean "
                                                          "reward or truncation fits them"))
    if pending:
        words.append(f"({len(pending)} group(s) after the last one it trained were not trained when the run ended: "
                     "still queued, or skipped, this run cannot tell, so they count for no rule)")
    if partial:
        words.append(f"({len(partial)} group(s) trained only in part)")
    return Finding("selection", None, "your loop " + ", ".join(words[:1]) + (", " if len(words) > 1 else "")
                   + ", ".join(words[1:]), {"SELECTION": path} if path else {}, True,
                   evidence={"steps": len(steps), "skipped_groups": len(evidence), "rule": rule,
                             **({"pending_groups": len(pending)} if pending else {})}, settles=("SELECTION",))


def _passes(chosen: dict, sizes: list[int], per_round: int) -> int:
    """K where step s trains on the whole round (s - 1) // K, each step on all of it (in any order), the spec's K
    first; 0 otherwise."""
    steps = sorted(chosen)
    if not steps or steps != list(range(1, len(steps) + 1)):
        return 0
    for k in dict.fromkeys([per_round, *range(1, len(steps) + 1)]):
        if all((s - 1) // k < len(sizes) and sorted(chosen[s]) == [((s - 1) // k, i) for i in range(sizes[(s - 1) // k])]
               for s in steps):
            return k
    return 0


def _whole_rounds(chosen: dict, passes: int, per_round: int, path: str) -> Finding:
    """Every step on one whole round, `passes` steps per round: TRL's num_iterations where that differs from the
    spec's, and the order the loop's micro-batches took the rows: its own (the built-in loop replays it), or, over
    several passes, the rollout's (MICRO_BATCH_ORDER); each a guess the search keeps only if it moves the metrics
    beyond rounding, as it does where a loss averages per micro-batch, or where rounding grows over a run)."""
    order = any(chosen[s] != [((s - 1) // passes, i) for i in range(len(chosen[s]))] for s in chosen)
    settings, said = {}, []
    if passes != per_round:
        settings["NUM_ITERATIONS"] = passes
        said.append(f"trains each round in {passes} optimizer passes, one whole round per step (TRL: num_iterations = "
                    f"{passes})")
    else:
        said.append("trains each step on one whole round, as TRL does")
    if passes != per_round and not order:  # (a guess: with a loss per completion, the order moves only rounding)
        settings["MICRO_BATCH_ORDER"] = "rollout"
        said.append("its micro-batches cut from the round in the rollout's order")
    if order:
        said.append("its micro-batches cut from the round in an order of its own, which harness.loop.trained gives "
                    "(TRL shuffles the round first: the built-in loop replays your order with SELECTION)")
        if path:
            settings["SELECTION"] = path
    return Finding("selection", None, "your loop " + ", ".join(said), settings, True, same_as_spec=not settings,
                   evidence={"passes": passes, "own_order": order}, settles=("NUM_ITERATIONS",) if "NUM_ITERATIONS"
                   in settings else ())


def _rule(skipped: list, kept: list, pending: list, used_rounds: list, sizes: list, group: int, rewards,
          truncated) -> str | None:
    """The rule that fits the groups never trained (`skipped`) and none of those trained (`kept`), or None;
    `pending` groups (after the last one trained) may go either way."""
    flat = _flat(rewards, used_rounds, sizes, group) - set(pending)
    if set(skipped) == flat:
        return _FLAT
    if truncated is not None and all(all(truncated[r][g * group:(g + 1) * group]) for r, g in skipped) and \
            not any(all(truncated[r][g * group:(g + 1) * group]) for r, g in kept):
        return "every group whose completions are all truncated"
    means = {(r, g): float(np.nanmean(rewards[r][g * group:(g + 1) * group]))
             for r in used_rounds for g in range(sizes[r] // group)}
    lo = max(means[k] for k in skipped)
    hi = min(means[k] for k in skipped)
    if all(means[k] > lo for k in kept):
        return f"every group whose mean reward is at most {lo:g}"
    if all(means[k] < hi for k in kept):
        return f"every group whose mean reward is at least {hi:g}"
    return None


def _flat(rewards, rounds: list, sizes: list, group: int) -> set:
    """The (round, group) pairs of `rounds` whose rewards are all equal (NaN left out)."""
    def spread_of(r, g):
        x = [v for v in rewards[r][g * group:(g + 1) * group] if v == v]
        return max(x) - min(x) if x else 0.0
    return {(r, g) for r in rounds for g in range(sizes[r] // group) if spread_of(r, g) <= 1e-9}


def read(cell, earlier: dict) -> list[Finding]:
    """The selection your loop saved (cell.trained), against TRL's: one finding for the run, or none without one."""
    spec, records = cell.spec, cell.records
    if not cell.trained:
        return []
    weights = [float(w) for w in spec.rewards.weights]
    # each completion's total as TRL and the built-in loop sum it: a failed score counts 0, all failed is NaN
    round_rewards = [[sum(w * v for w, v in zip(weights, col) if v is not None) if any(v is not None for v in col)
                      else float("nan") for col in zip(*sc.values())] for sc in cell.scores] if cell.scores else None
    eos = set(cell.eos_ids)
    return [selection(cell.trained, [len(rec["completion_ids"]) for rec in records], spec.GROUP_SIZE,
                      spec.NUM_ITERATIONS, round_rewards, [[len(c) for c in rec["completion_ids"]] for rec in records],
                      [[not c or c[-1] not in eos for c in rec["completion_ids"]] for rec in records],
                      cell.trained_path)]


def implied(cell) -> dict | None:
    """Where your loop names no selection (harness.loop.trained), the rounds its saved tensors are rows of, read from
    them: {step: the whole round, in the rollout's order} for each step saved, where some step's rows cannot be its
    round under the spec's NUM_ITERATIONS ((s - 1) // NUM_ITERATIONS) and an earlier round fits them, and the steps
    read so are whole rounds, each trained at several steps in a row (a loop with several passes over each round
    that does not say so: TRL's num_iterations); None otherwise. A round fits a step's rows where each row's mask
    counts no more tokens than that round's completion has, and completions scored alike by every reward function
    get the same reward; of several earlier rounds that fit, the one whose completions' lengths are nearest the
    mask's, where that is one."""
    if cell.trained or not cell.tensors or not cell.records:
        return None
    per_round = max(int(getattr(cell.spec, "NUM_ITERATIONS", 1)), 1)
    sizes = [len(rec["completion_ids"]) for rec in cell.records]
    rounds, moved = {}, False
    for step in sorted(s for s, t in cell.tensors.items() if isinstance(t.get("mask"), list)):  # (rows to read)
        own = (step - 1) // per_round
        fits = {r: d for r in range(min(own + 1, len(sizes))) if (d := _misfit(cell, step, r)) is not None}
        if own in fits or not fits:
            if own >= len(sizes):
                return None
            rounds[step] = own
            continue
        best = min(fits.values())
        nearest = [r for r, d in fits.items() if d == best]
        if len(nearest) != 1:
            return None
        rounds[step], moved = nearest[0], True
    chosen = {s: [(r, i) for i in range(sizes[r])] for s, r in rounds.items()}
    return chosen if moved and _passes(chosen, sizes, per_round) > 1 else None


def _misfit(cell, step: int, r: int) -> int | None:
    """How far round `r`'s completion lengths are from the tokens step `step`'s mask counts (the sum of the row-by-row
    gaps), or None where round `r` cannot be that step's rows: another number of rows, a row whose mask counts more
    tokens than its completion has, or two completions scored alike by every reward function with other rewards."""
    t, comps = cell.tensors[step], cell.records[r]["completion_ids"]
    mask, rewards = t.get("mask"), t.get("rewards")
    if not isinstance(mask, list) or len(mask) != len(comps):
        return None
    counts = [int(round(sum(float(v) for v in row))) if isinstance(row, list) else -1 for row in mask]
    if any(c < 0 or c > len(ids) for c, ids in zip(counts, comps)):
        return None
    scores = cell.scores[r] if r < len(cell.scores) else None
    if isinstance(rewards, list) and len(rewards) == len(comps) and scores:
        seen: dict = {}
        for i, value in enumerate(rewards):
            key = tuple(col[i] for col in scores.values())
            if None in key or not isinstance(value, (int, float)) or value != value:
                continue
            if abs(seen.setdefault(key, float(value)) - float(value)) > 1e-6 * max(1.0, abs(float(value))):
                return None
    return sum(len(ids) - c for c, ids in zip(counts, comps))
