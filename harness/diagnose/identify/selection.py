"""The selection stage: which completions each optimizer step of your loop trained on (harness.loop.trained), against
TRL's one whole round per step."""

from __future__ import annotations

import numpy as np

from harness.diagnose.identify.finding import Finding


def selection(chosen: dict[int, list[tuple[int, int]]], sizes: list[int], group: int, per_round: int,
              rewards: list[list[float]] | None = None, lengths: list[list[int]] | None = None,
              truncated: list[list[bool]] | None = None, path: str = "") -> Finding:
    """Which completions each optimizer step of your loop trained on (harness.loop.trained), against TRL's (step s:
    the whole round (s - 1) // per_round): how many per step, from how many rounds, each round over how many steps,
    completions trained more than once, and the groups never trained with a rule that fits them (every group whose
    rewards are all equal: DAPO's dynamic sampling; every group of truncated completions; the groups of the
    lowest or highest mean reward) or none. `sizes`: each round's completions; `rewards`, `lengths`, `truncated`:
    per round, per completion."""
    steps = sorted(chosen)
    default = {s: [((s - 1) // per_round, i) for i in range(sizes[(s - 1) // per_round])] for s in steps
               if (s - 1) // per_round < len(sizes)}
    if all(sorted(chosen[s]) == default.get(s) for s in steps):
        order = any(chosen[s] != default.get(s) for s in steps)
        return Finding("selection", None, "your loop trains each step on one whole round, as TRL does" + (
            " (in an order of its own)" if order else ""), {}, True, same_as_spec=True)
    words, unsettled = [], []
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
    skipped = sorted({(r, i // group) for r in used_rounds for i in range(sizes[r])} - {(r, i // group) for r, i in seen})
    partial = [(r, g) for r, g in {(r, i // group) for r, i in seen} if any((r, g * group + j) not in seen
                                                                            for j in range(group))]
    rule = None
    if skipped and rewards is not None:
        def spread_of(r, g):
            x = [v for v in rewards[r][g * group:(g + 1) * group] if v == v]
            return max(x) - min(x) if x else 0.0
        kept = sorted({(r, i // group) for r, i in seen})
        flat = {(r, g) for r in used_rounds for g in range(sizes[r] // group) if spread_of(r, g) <= 1e-9}
        if set(skipped) == flat:
            rule = "every group whose rewards are all equal (advantage 0 for each of its completions; DAPO's dynamic " \
                   "sampling filters them)"
        elif truncated is not None and all(all(truncated[r][g * group:(g + 1) * group]) for r, g in skipped) and \
                not any(all(truncated[r][g * group:(g + 1) * group]) for r, g in kept):
            rule = "every group whose completions are all truncated"
        else:
            means = {(r, g): float(np.nanmean(rewards[r][g * group:(g + 1) * group]))
                     for r in used_rounds for g in range(sizes[r] // group)}
            lo = max(means[k] for k in skipped)
            hi = min(means[k] for k in skipped)
            if all(means[k] > lo for k in kept):
                rule = f"every group whose mean reward is at most {lo:g}"
            elif all(means[k] < hi for k in kept):
                rule = f"every group whose mean reward is at least {hi:g}"
    if skipped:
        words.append(f"and never trains on {len(skipped)} of the {sum(sizes[r] // group for r in used_rounds)} "
                     "groups of the rounds it reads: " + (rule if rule else "no rule on their rewards' spread, mean "
                                                          "reward or truncation fits them"))
    if partial:
        words.append(f"({len(partial)} group(s) trained only in part)")
    return Finding("selection", None, "your loop " + ", ".join(words[:1]) + (", " if len(words) > 1 else "")
                   + ", ".join(words[1:]), {"SELECTION": path} if path else {}, True, unsettled=tuple(unsettled),
                   evidence={"steps": len(steps), "skipped_groups": len(skipped), "rule": rule},
                   settles=("SELECTION",))


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
