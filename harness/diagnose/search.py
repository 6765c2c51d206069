"""The explanation's search: runs of the built-in loop (scratch_grpo) on your loop's recorded rollouts, with candidate
spec changes, each judged step by step against your loop's log (explain.py says where it stands in the explanation;
docs/your-loop.md how a round goes).

- `options`: every candidate change of a spec, in the order a round tries them, each with the first step whose
  logged metrics it can move;
- `Judge`: a candidate's logged rows against your loop's, on the metrics training computes (compare's tolerances,
  the noise envelope);
- `Trial`: one candidate run, judged (how long it agrees, what parts it, how far);
- `Search`: the runs (each only as far as needed, reused when asked again), greedy over fields, and what it tried
  (`search.json`);
- `trl_moves`: the GRPOConfig fields a change moves (none: a quirk TRL cannot set).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

from harness.diagnose import noise
from harness.diagnose.compare import is_derived, load_tolerances, tolerance_for
from harness.diagnose.fields import FIELDS, toml_value
from harness.diagnose.preflight import apply_alignment
from harness.runlog.atomic import atomic_write_text

MAX_FIELDS = 10
LOOKAHEAD = 2  # steps a candidate runs past the first step it must fix
SEARCH_FILE = "search.json"  # in the cell's explain/ folder: every round, every candidate, each step's judgement


@dataclasses.dataclass(frozen=True)
class Option:
    """One candidate: a spec field and a value, the first step whose logged metrics it can change, and whether TRL
    has a setting for it."""
    key: str
    value: object
    acts_from: int
    also: tuple = ()  # (key, value) pairs that come with it (a KL penalty without TRL's ratio factor, say)

    def changes(self) -> dict:
        return {self.key: self.value, **dict(self.also)}


# ---------------------------------------------------------------------------------------------
# the candidates: spec fields (fields.FIELDS: their values, and when each can act)
# ---------------------------------------------------------------------------------------------
def options(spec, logged: set[str]) -> list[Option]:
    """Every candidate change of `spec` (the search's current spec), in the order they are tried: the loss's shape
    and the advantages (step 1), then what acts through the first update (step 2), then through the second
    (step 3). `logged`: the metrics your loop logs (a logged learning rate is read, not searched)."""
    out = _others(spec, "LOSS_NORM") + _others(spec, "ADV_SCALE") + _others(spec, "MASK_TRUNCATED")
    if spec.MASK_TRUNCATED:  # what counts as truncated: a completion ending in a sampled pad id, at any step
        out += _others(spec, "TRUNCATED_IF")
    if spec.NUM_ITERATIONS > 1 or spec.STEPS_PER_GENERATION > 1 or spec.IS_CORRECTION:  # the ratio leaves 1
        # ... but not before the first update: step 1 trains the policy that generated (ratio 1), so a clip bound can
        # first bind at step 2 (a second pass, or the round's next slice)
        out += _others(spec, "CLIP_HIGH") + _others(spec, "CLIP_LOW")
    if spec.sampler.kind != "policy":  # a separate sampler's completions: corrected for, or not, and how
        out += _others(spec, "IS_CORRECTION") + (_others(spec, "IS_MODE") if spec.IS_CORRECTION else [])
    if spec.BETA > 0:
        out += _others(spec, "KL_ESTIMATOR")  # k3's gradient is 0 at 1
        out += _others(spec, "KL_IS_CORRECTION") + _each("KL_IN_REWARD")
    else:  # a KL penalty, with TRL's factor of the policy ratio and (most hand-written loops) without it
        out += _each("BETA") + _each("BETA", also=(("KL_IS_CORRECTION", not spec.KL_IS_CORRECTION),))
    if "learning_rate" not in logged:  # else read from the log (settings_from_log), not searched
        out += [o for o in _each("LR") if not math.isclose(o.value, spec.LR, rel_tol=1e-9)]
    out += _others(spec, "WEIGHT_DECAY")
    if not spec.WEIGHT_DECAY_ALL:  # torch's AdamW(model.parameters()): norms and biases decay too
        out += _each("WEIGHT_DECAY", [v for v in FIELDS["WEIGHT_DECAY"].values if v], (("WEIGHT_DECAY_ALL", True),))
    out += _others(spec, "MAX_GRAD_NORM") + _others(spec, "ADAM_EPS")
    out += _others(spec, "ADAM_BETA2") + _others(spec, "ADAM_BETA1")
    if spec.MASTER_WEIGHTS != "float32":  # the AdamW kernels part on low-precision weights only (float32: rounding)
        out += _others(spec, "OPTIM")
    if "learning_rate" not in logged:
        out += _others(spec, "LR_SCHEDULE")
    # the quirks: TRL has no setting for any of these (the scratch loop does)
    out += _others(spec, "STD_EPS") + _others(spec, "STD") + _others(spec, "STD_EPS_INSIDE")
    out += _others(spec, "COMPLETION_MASK") + _others(spec, "EOS_ATTENTION") + _others(spec, "EMPTY_SKIP")
    if spec.MASK_TOKEN_ID >= 0:  # the masked token out of the sequence too, or only out of the loss
        out += _others(spec, "MASK_TOKEN_DROP")
    out += _others(spec, "LOGP_OLD") + _others(spec, "LOSS_SUM")
    if spec.LOSS_NORM == "token_local" and spec.GRAD_ACCUM > 1 and spec.MICRO_BATCH_ORDER == "shuffled":
        out += _others(spec, "MICRO_BATCH_ORDER")
    if spec.TEMPERATURE != 1.0:
        out += _others(spec, "LOGP_ON_RAW_LOGITS")
    return out


def _each(key: str, values=None, also: tuple = ()) -> list[Option]:
    """An option for each candidate value of the field (`values`, or its own in FIELDS), in order."""
    field = FIELDS[key]
    return [Option(key, v, field.acts_from, also) for v in (field.values if values is None else values)]


def _others(spec, key: str) -> list[Option]:
    """An option for each candidate value of the field other than the spec's, in order."""
    return [o for o in _each(key) if o.value != getattr(spec, key)]


_TOGETHER = ("LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS")  # a schedule's parameters mean nothing alone


def one_change(changes: dict, key: str) -> dict:
    """The change of `key`, with those of `changes` it cannot be set without (a schedule and its warmup and
    lr_scheduler_kwargs: cosine_with_min_lr needs its min_lr_rate)."""
    if key in _TOGETHER:
        return {k: v for k, v in changes.items() if k in _TOGETHER}
    return {key: changes[key]}


# a change and what it cannot be set without (the spec check refuses bf16 weights computed in float32): trl_moves
# sets the second on both sides, so that the first is judged by what it moves itself (bf16 weights: nothing, TRL's
# model_init_kwargs dtype, which the table does not write: a quirk with the built-in loop's switch)
_NEEDS = {("MASTER_WEIGHTS", "bfloat16"): {"DTYPE": "bfloat16"}}


def trl_moves(base, changes: dict) -> dict:
    """The GRPOConfig fields `changes` move in the spec's own translation, `[trl]` left out (an override would hide
    the move: `[trl] learning_rate` makes LR move nothing), with their new values: empty for a quirk TRL cannot
    express."""
    from harness.experiment.spec import SpecError
    from trl_runner.translate import translate

    bare = apply_alignment(base, {"drop_trl": list(base.trl)}) if base.trl else base
    needs = {k: v for (key, value), need in _NEEDS.items() if changes.get(key) == value
             for k, v in need.items() if k not in changes and getattr(bare, k) != v}
    if needs:  # a field it cannot be set without, set on both sides: what the change alone moves
        bare = apply_alignment(bare, {"set": needs})
    try:
        before = translate(bare).kwargs
    except SpecError:  # the table makes the translation valid (a batch it fixes): judged with it, as before
        bare, before = base, translate(base).kwargs
    after = translate(apply_alignment(bare, {"set": changes})).kwargs
    return {k: getattr(v, "value", v) for k, v in after.items() if k not in before or not _same(before[k], v)}


def _same(a, b) -> bool:
    a, b = getattr(a, "value", a), getattr(b, "value", b)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


# ---------------------------------------------------------------------------------------------
# agreement, step by step
# ---------------------------------------------------------------------------------------------
class Judge:
    """Holds a candidate's logged rows against your loop's, step by step, on the metrics training computes."""

    def __init__(self, yours, dtype: str, envelope=None):
        self.rows = {int(s): row for s, row in yours.iterrows()}
        self.dtype, self.tol, self.envelope = dtype, load_tolerances(), envelope
        ignore = set(self.tol.get("ignore", {}).get("metrics", [])) | {"step"}  # timing and bookkeeping, as compare
        self.columns = [c for c in yours.columns if c not in ignore and not is_derived(c)]
        self.k = noise.k_of(self.tol)

    def step(self, row: dict) -> tuple[list[str], float, float]:
        """(the metrics outside tolerance at this step, how far outside in all: sum of log10(1 + excess), and how
        near within it: the sum of |a - b| / tolerance over the metrics inside, each below 1)."""
        mine = self.rows.get(int(row["step"]))
        if mine is None:  # a step your loop did not log: not compared
            return [], 0.0, 0.0
        return self.apart(mine, row)

    def moved(self, before: Trial, after: Trial, upto: int) -> list[str]:
        """'metric@step' for each metric that `after` moves beyond the bound from `before` over the steps both ran
        up to `upto`: a change that moves nothing beyond the bound is below the run's own rounding, whatever it does
        to the agreement with your loop (bf16 noise can push a step back inside tolerance)."""
        mine = {int(r["step"]): r for r in before.rows}
        out = []
        for row in after.rows:
            step = int(row["step"])
            if step <= upto and step in mine:
                out += [f"{m}@{step}" for m in self.apart(mine[step], row)[0]]
        return out

    def apart(self, mine: dict, row: dict) -> tuple[list[str], float, float]:
        """`step`'s judgement of `row` against `mine` (a row of the same step)."""
        step = int(row["step"])
        outside, far, near = [], 0.0, 0.0
        for m in self.columns:
            a, b = mine.get(m), row.get(m)
            if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
                continue
            try:
                a, b = float(a), float(b)
            except (TypeError, ValueError):
                continue
            if not (math.isfinite(a) and math.isfinite(b)):
                outside.append(m)
                far += 6.0
                continue
            t = tolerance_for(self.tol, "lockstep", self.dtype, m)
            limit = t.get("atol", 0.0) + t.get("rtol", 0.0) * abs(b)
            env = self.envelope.at(m, [step], [b]) if self.envelope is not None else None
            limit = float(noise.bound(limit, env[0] if env is not None else None, self.k))  # compare's bound
            d = abs(a - b)
            if d > limit:
                outside.append(m)
                far += math.log10(1 + d / max(limit, 1e-30))
            else:
                near += d / max(limit, 1e-30)
        return outside, far, near


@dataclasses.dataclass
class Trial:
    changes: dict
    agree: int  # leading steps within tolerance (-1: the run failed)
    outside: list  # the metrics outside at the first step where it parts ([] when it never parted)
    far: float  # how far outside in all, over every step it ran (sum of log10(1 + excess))
    ran: int  # steps it ran
    folder: str
    error: str | None = None
    trl: bool = True  # every change has a TRL setting
    near: float = 0.0  # how near within tolerance over the steps it agreed (a tie-break among look-alikes)
    per_step: tuple = ()  # (outside, far, near) of each step it ran: the same trial judged over fewer steps
    rows: tuple = ()  # the judged metrics it logged, a dict a step (what it moved against another trial)

    def score(self):
        """Agreement first; then fewer metrics outside where it parts; then nearer over the steps it ran (outside,
        then within tolerance: of two look-alikes the one nearer your loop); at a tie, TRL's settings before the
        quirks."""
        return (self.agree, -len(self.outside), -self.far, -round(self.near, 3), self.trl)

    def better_than(self, other: "Trial") -> bool:
        """It extends the agreement, or at equal agreement leaves fewer metrics outside, or (as many) brings them
        at least twice closer on the whole (`far` sums log10 excesses: 0.3 is a factor of 2) and by a tenth."""
        if self.agree != other.agree:
            return self.agree > other.agree
        if len(self.outside) != len(other.outside):
            return len(self.outside) < len(other.outside)
        return self.far < other.far - math.log10(2) and self.far < 0.9 * other.far


# ---------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------
PAIR_POOL = 8  # the closest single changes a round combines in pairs when none alone extends the agreement


class Search:
    """Runs of the built-in loop on the recorded rollouts with spec changes, each only as far as needed."""

    def __init__(self, base, yours, records, root: Path, envelope=None, log=print):
        self.base, self.records, self.root, self.log = base, records, Path(root), log
        self.judge = Judge(yours, base.DTYPE, envelope)
        self.steps = base.STEPS
        self.runs, self.steps_run, self.seconds = 0, 0, 0.0
        self.cache: dict[tuple, Trial] = {}
        self.rounds: list[dict] = []  # each round of the search: the current set, every candidate, what was kept
        self.below_rounding: dict | None = None  # where it stopped because only changes below rounding did better
        self.escalated_from: dict | None = None  # a float32 search: where the bf16 one stopped (in_float32)
        self.settled: set[str] = set()  # fields the tensor diff's exact findings settle: not searched (SETTLES)
        # candidates a stage handed on that no list of options holds (a forward rule on the pad id step 1 could not
        # show): offered from the step they can first act at, as any option
        self.extra: list[Option] = []
        self.value_only: int | None = None  # the step from which the loss is judged out: it differs in value alone
        self._trl: dict[tuple, bool] = {}
        self._saved: dict[Path, tuple[int, dict | None]] = {}  # tensors- folder -> (steps saved, their tensors once read)
        from harness.experiment.models import Warm

        self.warm = Warm()  # one loaded model for every candidate (restored to the checkpoint's weights each run)

    def _folder(self, changes: dict, prefix: str = "") -> Path:
        """One run folder per set of changes: its fields in the name (cut short), a hash of them after it."""
        name = "+".join(f"{k}={v}" for k, v in sorted(changes.items())).replace("/", "_") or "base"
        return self.root / f"{prefix}{name[:100]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"

    def is_trl(self, changes: dict) -> bool:
        """Every change has a TRL setting (translated once per field and value, with what it is set with: a
        schedule with its parameters); a set the spec check refuses has none."""
        from harness.experiment.spec import SpecError

        for k in changes:
            one = one_change(changes, k)
            key = json.dumps(one, sort_keys=True)
            if key not in self._trl:
                try:
                    self._trl[key] = bool(trl_moves(self.base, one))
                except SpecError:
                    self._trl[key] = False
            if not self._trl[key]:
                return False
        return True

    def tensors(self, changes: dict, steps: int) -> Path:
        """The built-in loop with `changes` over the first `steps` steps, saving their tensors: its run folder."""
        from harness.rollouts.lockstep import ReplaySource
        from scratch_grpo.train import train

        t0 = time.perf_counter()
        folder = self._folder(changes, "tensors-")
        if self._saved.get(folder, (0, None))[0] >= steps:  # (this run saved as many steps already)
            return folder
        if folder in self._saved:  # a longer run than the one there: its own folder (what was read stays as read)
            folder = folder.with_name(f"{folder.name}-{steps}steps")
            if folder in self._saved:
                return folder
        spec = apply_alignment(self.base, {"set": changes})
        train(spec, folder, rollout_source=ReplaySource(self.records), progress=False, tensor_steps=steps,
              warm=self.warm, stop_when=lambda row: int(row["step"]) >= steps)
        self.runs, self.steps_run, self.seconds = self.runs + 1, self.steps_run + steps, \
            self.seconds + time.perf_counter() - t0
        self._saved[folder] = (steps, None)
        return folder

    def tensor_values(self, changes: dict, steps: int) -> dict:
        """The tensors `tensors(changes, steps)` saved ({step: {tensor: value}}, steps 1 to `steps`), the file read
        once however often they are asked for."""
        from harness.runlog.tensors import TENSORS_FILE, read_tensors

        folder = self.tensors(changes, steps)
        saved, values = self._saved[folder]
        if values is None:
            values = read_tensors(folder / TENSORS_FILE)
            self._saved[folder] = (saved, values)
        return {s: v for s, v in values.items() if s <= steps}

    def trial(self, changes: dict, horizon: int, stop_at_parting: bool = False) -> Trial:
        """The built-in loop with `changes`, run to `horizon` (or, `stop_at_parting`, until it parts from your loop):
        how long it agrees, what is outside where it parts, and how far outside over the steps it ran. A trial run
        before is reused, judged over the same steps (never more than it ran, never fewer than asked)."""
        from harness.rollouts.lockstep import ReplaySource
        from scratch_grpo.train import train

        key = tuple(sorted((k, json.dumps(v)) for k, v in changes.items()))
        known = self.cache.get(key)
        if known is not None:
            if known.error:
                return known
            parted_at = next((i + 1 for i, (out, _f, _n) in enumerate(known.per_step) if out), None)
            if known.ran >= horizon or known.ran >= self.steps:
                return _judged(known, min(horizon, known.ran), stop_at_parting)
            if stop_at_parting and parted_at is not None:
                return _judged(known, parted_at, True)
        folder = self._folder(changes)
        judged: list = []
        rows: list = []

        def stop_when(row):
            outside, far, near = self.judge.step(row)
            judged.append((outside, far, near))
            rows.append({m: row.get(m) for m in ("step", *self.judge.columns)})
            return int(row["step"]) >= horizon or (stop_at_parting and bool(outside))

        t0 = time.perf_counter()
        error = None
        try:
            spec = apply_alignment(self.base, {"set": changes})
            train(spec, folder, rollout_source=ReplaySource(self.records), progress=False, stop_when=stop_when,
                  warm=self.warm)
        except Exception as e:  # noqa: BLE001 - a candidate the loop refuses is no explanation
            error = f"{type(e).__name__}: {str(e)[:100]}"
        self.seconds += time.perf_counter() - t0
        self.runs += 1
        self.steps_run += len(judged)
        out = Trial(changes, -1, [], 0.0, len(judged), str(folder), error, self.is_trl(changes), 0.0, tuple(judged),
                    tuple(rows))
        if error is None:
            out = _judged(out, len(judged), stop_at_parting)
        self.cache[key] = out
        return out

    def save(self) -> None:
        """search.json in the search's folder: every round so far (rewritten after each, so a run cut short keeps
        what it tried)."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / SEARCH_FILE, json.dumps(
            {"runs": self.runs, "steps": self.steps_run, "seconds": round(self.seconds, 1), "rounds": self.rounds,
             "stopped_below_rounding": self.below_rounding, "loss_in_value_only_from": self.value_only}, indent=1,
            default=str))

    def without_loss(self, step: int) -> None:
        """Judge from now on without the logged loss (it differs in value alone from `step`): what the first search
        cached, settled and stopped on was judged with it, so it goes; a marker in the rounds says where."""
        self.value_only = step
        if "loss" in self.judge.columns:
            self.judge.columns.remove("loss")
        self.cache.clear()
        self.settled, self.below_rounding = set(), None
        self.rounds.append({"value_only_from": step})

    def whole(self, changes: dict) -> Trial:
        """Over every step, stopping where it parts."""
        return self.trial(changes, self.steps, stop_at_parting=True)

    def run(self, start: dict, guesses: list[dict] = (), exact_first: bool = False,
            guessed_by: str = "", settles: tuple = ()) -> tuple[Trial, list[dict]]:
        """Greedy over fields, judged by agreement: returns the best trial and the trace of kept fields. `guesses`:
        changes the tensor diff points at (or, `guessed_by` names it, another source: a bf16 search's answer), tried
        first (the one that extends the agreement most is kept). `settles`: the fields the exact guess (the first)
        settles, added to `self.settled` (left out of the search) when it is kept."""
        state = self.whole(start)
        trace = []
        self.log(f"    explain: the built-in loop as TRL{_with(start)}: " + _said(state, self.steps))
        tried = [self.whole({**start, **g}) for g in guesses]
        exact = [t for t in tried[:1] if t.error is None and exact_first]  # recomputed from tensors: kept as found
        tried = [t for t in tried if t.error is None and t.better_than(state)]
        if tried or exact:
            best = max(tried, key=Trial.score) if tried else exact[0]
            if exact and not best.better_than(exact[0]):
                best = exact[0]  # every exact finding, unless another guess does better on the steps
            if exact and best is exact[0]:
                self.settled |= set(settles)
            added = {k: v for k, v in best.changes.items() if k not in start}
            trace.append({"at_step": state.agree + 1, "changes": added, "agree_before": state.agree,
                          "agree_after": best.agree, "from_tensors": bool(exact) and best is exact[0],
                          "guessed_from_tensors": not guessed_by, **({"guessed_by": guessed_by} if guessed_by else {})})
            self.log(f"    explain: {guessed_by + chr(39) + 's' if guessed_by else 'the tensors' + chr(39)} "
                     f"{_with(added, 'guess,')}: "
                     + _said(best, self.steps))
            state = best
        while state.agree < self.steps and len(state.changes) - len(start) < MAX_FIELDS:
            first = state.agree + 1
            current = apply_alignment(self.base, {"set": state.changes})
            opts = [o for o in options(current, set(self.judge.columns)) + self.extra
                    if o.acts_from <= first and not set(o.changes()) & (set(state.changes) | self.settled)]
            horizon = min(self.steps, first + LOOKAHEAD)
            here = self.trial(state.changes, horizon, stop_at_parting=True)  # judged as the candidates are
            # each stops where it parts (as the docstring says): one that does not fix step `first` runs no further
            singles = [t for t in (self.trial({**state.changes, **o.changes()}, horizon, stop_at_parting=True)
                                   for o in opts) if t.error is None]
            singles.sort(key=Trial.score, reverse=True)
            # a change is a difference only if it moves some metric beyond the bound from where it starts: below
            # that it is rounding, and in bf16 rounding alone can bring a step back inside tolerance
            tried = [(t, self.judge.moved(here, t, horizon)) for t in singles]
            best = next((t for t, seen in tried if seen), None)
            if best is None or best.agree <= here.agree:  # none alone extends it: two at once (the closest few)
                pairs = self.pairs(singles, state, here, horizon)
                tried += pairs
                pairs = [t for t, seen in pairs if seen]
                if pairs:
                    best = max(pairs, key=Trial.score)
            rounding = [t for t, seen in tried if not seen and t.better_than(here)
                        and (best is None or Trial.score(t) > Trial.score(best))]
            self.rounds.append({"at_step": first, "current": _record(here), "kept": _record(best) if best is not None
                                and best.better_than(here) else None,
                                "tried": [{**_record(t), "moves": seen[:6]} for t, seen in tried]})
            if rounding:
                self.below_rounding = {"at_step": first, "changes": [_changed(t, state) for t in rounding[:3]],
                                       "outside": here.outside}
                self.log(f"    explain: at step {first}, {len(rounding)} change(s) would do better but move no metric "
                         f"beyond the bound from the current set (rounding, not a difference; not kept): "
                         + "; ".join(_with(_changed(t, state), '').strip() for t in rounding[:3]))
            self.save()
            if best is None or not best.better_than(here):
                break
            self.below_rounding = None
            added = _changed(best, state)
            trace.append({"at_step": first, "changes": added, "agree_before": state.agree, "agree_after": best.agree,
                          "moves": next(seen for t, seen in tried if t is best)[:6]})
            self.log(f"    explain: at step {first}, {_with(added, 'with')}: " + _said(best, horizon))
            state = self.whole(best.changes)
            if state.agree > horizon or state.agree == self.steps:
                self.log(f"    explain: over the whole run{_with(state.changes)}: " + _said(state, self.steps))
        if state.agree == self.steps:  # what the tensor diff recomputed exactly stays: it was seen, not inferred
            state = self.prune(state, {**start, **{k: v for t in trace if t.get("from_tensors")
                                                   for k, v in t["changes"].items()}})
        return state, trace

    def pairs(self, singles: list[Trial], state: Trial, here: Trial, horizon: int) -> list[tuple[Trial, list]]:
        """Two changes at once, from the `PAIR_POOL` closest single ones (`singles`, best first), two fields each:
        every pair that extends the agreement, with what it moves beyond the bound from the current set (`here`),
        or [] where a half moves nothing from the other alone."""
        pool = singles[:PAIR_POOL]
        added = [set(t.changes) - set(state.changes) for t in pool]
        pairs = []
        for i, a in enumerate(pool):
            for b in (b for j, b in enumerate(pool[i + 1:], i + 1) if not added[i] & added[j]):  # two fields
                t = self.trial({**a.changes, **b.changes}, horizon, True)
                if t.error is None and t.agree > here.agree:  # each half moves it from the other alone
                    seen = [self.judge.moved(x, t, horizon) for x in (here, a, b)]
                    pairs.append((t, seen[0] if all(seen) else []))
        return pairs

    def prune(self, state: Trial, start: dict) -> Trial:
        """Drop every kept field that parity holds without (a partial match kept on the way, say)."""
        for key in [k for k in state.changes if k not in start]:
            rest = {k: v for k, v in state.changes.items() if k != key}
            t = self.whole(rest)
            if t.agree == self.steps:
                self.log(f"    explain: {key} is not needed (parity holds without it): dropped")
                state = t
        return state


def _judged(t: Trial, steps: int, stop_at_parting: bool) -> Trial:
    """A trial judged over its first `steps` steps (to where it parts, with `stop_at_parting`): agreement, the
    metrics outside where it parts, how far outside over those steps, how near within them before it parts."""
    agree, outside, far, near = 0, [], 0.0, 0.0
    for i, (out, f, n) in enumerate(t.per_step[:steps]):
        far += f
        if out and not outside:
            outside = list(out)
            if stop_at_parting:
                break
        if not outside:
            agree, near = i + 1, near + n
    return dataclasses.replace(t, agree=agree, outside=outside, far=far, near=near)


def _changed(t: Trial, state: Trial) -> dict:
    """What `t` adds to the current set."""
    return {k: v for k, v in t.changes.items() if k not in state.changes}


def _record(t: Trial) -> dict:
    """A trial as search.json keeps it: what it changed, how long it agreed, what parted it, each step's judgement."""
    return {"changes": t.changes, "agree": t.agree, "outside": t.outside, "ran": t.ran, "error": t.error,
            "far": round(t.far, 4), "steps": [{"outside": o, "far": round(f, 4), "near": round(n, 4)}
                                              for o, f, n in t.per_step]}


def _with(changes: dict, lead: str = " with") -> str:
    return f"{lead} " + ", ".join(f"{k} = {toml_value(v)}" for k, v in changes.items()) if changes else ""


def _said(t: Trial, horizon: int) -> str:
    if t.error:
        return f"not applicable ({t.error})"
    if not t.outside and t.agree >= horizon:
        return f"agrees through step {t.agree}"
    parts = f"parts at step {t.agree + 1} on {', '.join(t.outside[:4])}"
    return parts if t.agree == 0 else f"agrees through step {t.agree}, then {parts}"
