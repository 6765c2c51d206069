"""The rewards stage: your per-completion rewards as a weighting of the spec's reward functions' scores (TRL's
reward_weights), or reward code of your own."""

from __future__ import annotations

import math

import numpy as np

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.numerics import _arr
from harness.diagnose.identify.steps import steps


def rewards_stage(rewards, scores: dict[str, list], spec=None, step=None) -> Finding:
    """Your per-completion rewards against the spec's reward functions' scores of the same completions: the weights
    that give them (TRL's reward_weights), by least squares and checked exactly, or your own reward code."""
    from harness.diagnose.tensordiff import fit_reward_weights

    r = [float(x) for x in _arr(rewards)]
    w = fit_reward_weights(r, scores, atol=1e-5, rtol=1e-4)
    spec_w = [float(v) for v in spec.rewards.weights] if spec is not None else None
    cols = np.array([[np.nan if v is None else float(v) for v in col] for col in scores.values()]).T
    cols = cols[~np.isnan(cols).any(axis=1)] if cols.size else cols
    if w is None and (not cols.size or np.linalg.matrix_rank(cols) < len(scores)):
        return Finding("rewards", step, "cannot be read at this step: a reward function scores every completion alike, "
                       "so no weights can be told apart", {}, False, readable=False)
    if w is None:
        return Finding("rewards", step, "your loop scores the completions with reward code of its own: no weighting of "
                       f"the spec's reward functions ({', '.join(scores)}) gives its rewards", {}, False, no_switch=True)
    w = [0.0 if abs(x) < 1e-12 else x for x in w]  # (no -0.0 in the words)
    if spec_w is not None and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(w, spec_w)):
        return Finding("rewards", step, "your loop weighs the reward functions as the spec does", {}, True,
                       same_as_spec=True, settles=("rewards.weights",))
    return Finding("rewards", step, f"your loop weighs the reward functions ({', '.join(scores)}) {w}",
                   {"rewards.weights": w}, True, settles=("rewards.weights",))


def read(cell, earlier: dict) -> list[Finding]:
    """Your rewards at every step that saved them, against the spec's reward functions' scores of the same
    completions (your loop's rollouts file, cell.scores)."""
    scores, found = cell.scores, []
    if not scores:
        return found
    for s in steps(cell):
        if "rewards" in s.tensors and all(r < len(scores) for r, _ in s.rows) and \
                len(_arr(s.tensors["rewards"])) == len(s.rows):
            found.append(rewards_stage(s.tensors["rewards"], {k: [scores[r][k][i] for r, i in s.rows] for k in scores[0]},
                                       cell.spec, step=s.step))
    return found
