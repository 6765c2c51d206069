"""One pair of runs: two sides on one spec, then their comparison (lockstep or free).

The sides are `scratch` (the built-in loop), `trl` (TRL's GRPOTrainer) and `yours` (a user's loop, run through
`loop_runner`). Owns the order they run in. Lockstep: the scratch loop runs first and records every round's
rollouts (`RecordingSource`); TRL replays them (`ReplaySource`) and a user's loop reads them as
`rollouts.jsonl` (PARITY_ROLLOUTS); then the comparison (`compare_loaded`). Free: each side samples for itself,
FREE_SEEDS seeds each; then `compare_free`. The matrix and the attribution call `run_pair` for every cell and every
re-run; with `keep` it returns the cell (cell.CellData) holding what it read, so that nothing reads it back.

With TOLERANCE = "calibrated" (lockstep) the scratch side also runs as its noise twin on the same recording
(harness/diagnose/noise.py). With a `store` (a matrix's folder), the scratch run, its recording and its noise
envelope are kept by a content hash of what the scratch side reads (`scratch_key`): cells and re-runs whose
scratch side is set up alike share one scratch run, also across `--resume`. The attribution's re-runs are kept
whole there too (`PairResults`, by `pair_key`: the whole spec, the mode and all the code), so a resumed matrix
takes the re-runs an earlier run of it made.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

from harness.diagnose import noise
from harness.diagnose.cell import CellData, Sketch, read_sketch, relative_l2, your_loop_files
from harness.diagnose.compare import compare_runs, load_any_run, load_tolerances
from harness.diagnose.freerun import compare_free
from harness.diagnose.preflight import apply_alignment
from harness.runlog.log import METRICS_FILE

SIDES = ("scratch", "trl", "yours")
SHARED_DIR = "shared-scratch"  # a matrix folder's store of scratch runs
# spec fields the scratch side never reads (the TRL side's, the user's loop's, the comparison's): a change to
# them leaves the scratch run as it was (tests/test_shared_runs.py checks the scratch code reads none of them)
SCRATCH_BLIND = ("NAME", "trl", "BATCH_MAPPING", "PROCESSES", "loop", "TOLERANCE", "FREE_SEEDS")
# the code a scratch run's result depends on
SCRATCH_CODE = ("scratch_grpo", "harness/experiment", "harness/rollouts", "harness/runlog", "harness/diagnose/noise.py")
# the code a whole pair's comparison depends on: both sides, the comparison and its tolerances
PAIR_CODE = ("scratch_grpo", "trl_runner", "loop_runner", "harness", "harness/diagnose/tolerances.toml")


@functools.cache
def code_version(parts: tuple[str, ...] = SCRATCH_CODE) -> str:
    """A hash of these source files (the scratch side's by default) and the library versions: a stored run is
    reused only by the same code."""
    from harness.runlog.log import library_versions

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(json.dumps(library_versions(), sort_keys=True, default=str).encode())
    for name in parts:
        for f in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _content_key(fields: dict, code: str, spec, *extra) -> str:
    """Content hash of spec fields, a code version, the reward functions' sources and the data/checkpoint files'
    sizes and times."""
    from harness.experiment.rewards import reward_provenance

    files = []
    for path in (spec.data.path, spec.model.path):
        if path and Path(path).exists():
            st = Path(path).stat()
            files.append([str(path), st.st_size, st.st_mtime_ns])
    blob = json.dumps([fields, code, reward_provenance(spec), files, *extra], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def scratch_key(spec) -> str:
    """Content hash of everything the scratch side's run depends on (its spec fields, its code, rewards, files)."""
    fields = {k: v for k, v in spec.to_dict().items() if k not in SCRATCH_BLIND}
    fields["recorded_rounds"] = recorded_rounds(spec)  # the recording grows with [loop] rounds
    return _content_key(fields, code_version(), spec)


def recorded_rounds(spec) -> int:
    """Rounds the scratch side's recording holds: the spec's own, or more where your loop reads more ([loop] rounds)."""
    return max(spec.rounds, spec.loop.rounds if spec.loop.command else 0)


def pair_key(spec, mode: str) -> str:
    """Content hash of everything a scratch-against-TRL pair's comparison depends on: the whole spec, the mode, the
    code of both sides and of the comparison, rewards, files."""
    return _content_key(spec.to_dict(), code_version(PAIR_CODE), spec, mode)


class ScratchStore:
    """Scratch runs kept by `scratch_key` under `root`: each entry holds `scratch/`, the recording and, once a
    calibrated pair made it, the noise envelope. An entry appears as soon as its scratch run finishes (built aside,
    then renamed); its envelope is added to it later (one file, written aside, then renamed)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.pairs = PairResults(self.root / "pairs", self.root.parent)  # the matrix's finished re-runs, by pair_key

    def entry(self, spec) -> Path:
        return self.root / scratch_key(spec)

    def has(self, spec) -> bool:
        """A whole entry: the scratch run, and its noise envelope where the spec's tolerance asks for one (an entry
        without it is a scratch run whose twin was cut off: `fetch` takes it, then the twin is made)."""
        e = self.entry(spec)
        return (e / "scratch").is_dir() and (spec.TOLERANCE != "calibrated" or (e / noise.NOISE_FILE).exists())

    def fetch(self, spec, out_dir: Path) -> bool:
        """Copy a stored scratch run into out_dir (scratch/, rollouts, envelope); False when there is none."""
        from harness.rollouts.lockstep import ROLLOUTS_FILE

        src = self.entry(spec)
        if not (src / "scratch").is_dir():
            return False
        if (out_dir / "scratch").exists():
            shutil.rmtree(out_dir / "scratch")
        shutil.copytree(src / "scratch", out_dir / "scratch")
        for name in (ROLLOUTS_FILE, noise.NOISE_FILE):
            if (src / name).exists():
                shutil.copy2(src / name, out_dir / name)
        return True

    def keep(self, spec, out_dir: Path) -> None:
        """Store out_dir's scratch run (and its recording and envelope). An entry without an envelope gets out_dir's
        when both hold the same recording (the twin of that very run), else is replaced by a whole one; a whole
        entry is never replaced."""
        import filecmp

        from harness.rollouts.lockstep import ROLLOUTS_FILE

        dst = self.entry(spec)
        has_envelope = (out_dir / noise.NOISE_FILE).exists()
        if (dst / noise.NOISE_FILE).exists() or ((dst / "scratch").is_dir() and not has_envelope):
            return
        me = f"{socket.gethostname()}.{os.getpid()}"  # unique across the nodes of a cluster
        if (dst / "scratch").is_dir() and (dst / ROLLOUTS_FILE).exists() and (out_dir / ROLLOUTS_FILE).exists() \
                and filecmp.cmp(dst / ROLLOUTS_FILE, out_dir / ROLLOUTS_FILE, shallow=False):
            aside = dst / f".{noise.NOISE_FILE}.{me}.tmp"
            shutil.copy2(out_dir / noise.NOISE_FILE, aside)
            os.replace(aside, dst / noise.NOISE_FILE)  # the entry stays whole at every moment
            return
        tmp = self.root / f".{dst.name}.{me}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        shutil.copytree(out_dir / "scratch", tmp / "scratch")
        for name in (ROLLOUTS_FILE, noise.NOISE_FILE):
            if (out_dir / name).exists():
                shutil.copy2(out_dir / name, tmp / name)
        old = dst.with_name(f".{dst.name}.{me}.old")
        if dst.exists():
            if (dst / noise.NOISE_FILE).exists() or not has_envelope:  # stored whole meanwhile: it serves
                shutil.rmtree(tmp, ignore_errors=True)
                return
            dst.rename(old)
        try:
            tmp.rename(dst)
        except OSError:  # another worker stored it first: theirs serves as well
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


class PairResults:
    """Finished re-runs' comparisons kept by `pair_key` under `root`, a matrix folder's, so that a resumed matrix
    takes the re-runs an earlier run of it made instead of making them again. Run folders are written relative to
    `base` (the matrix folder: it may have moved since); an entry serves only while its folders are there."""

    def __init__(self, root: Path, base: Path):
        self.root, self.base = Path(root), Path(base)

    def get(self, spec, mode: str) -> dict | None:
        try:
            result = json.loads((self.root / f"{pair_key(spec, mode)}.json").read_text(encoding="utf-8"))
            result["runs"] = _map_runs(result["runs"], lambda p: str(self.base / p))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        runs = result["runs"]
        folders = [p for side in runs.values() for p in side] if isinstance(runs, dict) else runs
        if not folders or not all((Path(p) / METRICS_FILE).is_file() for p in folders):
            return None
        return result

    def keep(self, spec, mode: str, result: dict) -> None:
        from harness.runlog.atomic import atomic_write_text

        rel = dict(result, runs=_map_runs(result.get("runs") or [], lambda p: os.path.relpath(p, self.base)))
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / f"{pair_key(spec, mode)}.json", json.dumps(rel, default=str))


def _map_runs(runs, fn):
    """A comparison's `runs` (lockstep: [a, b]; free: {side: [seed folders]}) with fn applied to every folder."""
    if isinstance(runs, dict):
        return {k: [fn(p) for p in v] for k, v in runs.items()}
    return [fn(p) for p in runs]


def _train(side: str, spec, run_dir: Path, progress: bool, rollouts=None, replay=None) -> None:
    """One side, one seed. `replay`: a ReplaySource (TRL in lockstep); `rollouts`: the loop's rollouts file."""
    if side == "scratch":
        from scratch_grpo.train import train

        train(spec, run_dir, rollout_source=replay, progress=progress)
    elif side == "trl" and spec.PROCESSES > 1:  # TRL under torchrun/accelerate, each process replaying its slice
        from trl_runner.launch import train_processes

        train_processes(spec, run_dir, rollouts if replay is not None else None, progress)
    elif side == "trl":
        from trl_runner.runner import train

        train(spec, run_dir, rollout_source=replay, progress=progress, lockstep=replay is not None)
    else:
        from loop_runner.run import train

        train(spec, run_dir, rollouts=rollouts, progress=progress)


def run_pair(spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
             sides: tuple[str, str] = ("scratch", "trl"), store: ScratchStore | None = None, keep: bool | str = False):
    """Both sides on `spec` into out_dir/<side>; returns the comparison of sides[0] with sides[1]. `store`: where
    scratch runs are shared (a matrix's); a run stored there with the same `scratch_key` is copied, not re-made.
    `keep`: return the cell instead (CellData: the comparison with everything the pair read or holds, so that no
    later step reads the folder back); "logs": the cell without its rollout records (a re-run, whose logs and
    sketches are all its cell uses: a GPU run's records are large to hand back from a worker)."""
    from harness.rollouts.lockstep import (LOOP_ROLLOUTS_FILE, ROLLOUTS_FILE, RecordingSource, ReplaySource,
                                           write_loop_rollouts)

    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "free":
        result = run_free_pair(spec, out_dir, progress, sides=sides)
        return CellData(spec, out_dir, tuple(sides), mode, result) if keep else result
    held = ({}, {}) if keep else None  # what the pair reads on the way, for the cell: logs, sketches
    records, envelope, notes, (tok, eos, device) = _scratch_side(spec, out_dir, progress, store, held)
    broken = []
    for side in sides:
        if side == "trl":
            replay = ReplaySource(records, fallback=RecordingSource(spec, eos, tok.pad_token_id, device))
            _train("trl", spec, out_dir / "trl", progress, rollouts=out_dir / ROLLOUTS_FILE, replay=replay)
            broken = replay.broken_rounds
        elif side == "yours":
            loop_rollouts = write_loop_rollouts(spec, records, out_dir / LOOP_ROLLOUTS_FILE)
            _train("yours", spec, out_dir / "yours", progress, rollouts=loop_rollouts)
    sketches = None
    if keep:
        sketches = held[1]
        for side in sides:
            if str(out_dir / side) not in sketches:
                sketches[str(out_dir / side)] = read_sketch(out_dir / side)
    result, runs = compare_loaded(spec, out_dir / sides[0], out_dir / sides[1], "lockstep", envelope, sketches,
                                  runs={k: v for k, v in held[0].items() if k in sides} if keep else None)
    result["notes"] += notes
    if broken:
        result["notes"].append(f"lockstep broke at {len(broken)} round(s) (first: round {broken[0] + 1}): TRL asked "
                               "for prompts the scratch loop did not use, so it sampled them from its own weights")
    if not keep:
        return result
    extra = your_loop_files(out_dir / "yours", out_dir / LOOP_ROLLOUTS_FILE) if "yours" in sides else {}
    return CellData(spec, out_dir, tuple(sides), "lockstep", result, runs, tuple(records) if keep is True else (),
                    envelope, tuple(eos),
                    tok.pad_token_id, sketches=sketches, **extra)


TENSOR_WALK_STEPS = 6  # at most this many steps' tensors when an unexplained pair is walked link by link


def tensor_walk(spec, pair_dir: Path, steps: int, out: Path) -> dict | None:
    """Both built-in sides again on a lockstep pair's recorded rollouts, saving their first `steps` steps' tensors
    (`out/{scratch,trl}`), and the tensor diff of TRL's against the built-in loop's (tensordiff.diff:
    the first link that differs, where and how). None when the pair has no recording or runs on several processes.
    TRL's run spans STEPS (its schedule with it); the built-in loop stops after `steps`."""
    from harness.diagnose.tensordiff import diff_runs
    from harness.rollouts.lockstep import ROLLOUTS_FILE, ReplaySource
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    pair_dir = Path(pair_dir)
    if spec.PROCESSES > 1 or spec.STEPS_PER_GENERATION > 1 or not (pair_dir / ROLLOUTS_FILE).exists():
        return None
    records = ReplaySource.from_file(pair_dir / ROLLOUTS_FILE).records
    out = Path(out)
    train_scratch(spec, out / "scratch", rollout_source=ReplaySource(records), progress=False, tensor_steps=steps,
                  stop_when=lambda row: int(row["step"]) >= steps)
    train_trl(spec, out / "trl", rollout_source=ReplaySource(records), progress=False, lockstep=True,
              tensor_steps=steps)
    return diff_runs(spec, out / "trl", out / "scratch", records)


def make_scratch(spec, out_dir: Path, progress: bool = False, store: ScratchStore | None = None) -> None:
    """The scratch side of a lockstep pair alone (its run, recording and noise envelope) into out_dir and `store`:
    a backend runs it once for every cell that shares it, before their pairs (harness/diagnose/backends.py)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _scratch_side(spec, Path(out_dir), progress, store)


def _scratch_side(spec, out_dir: Path, progress: bool, store: ScratchStore | None, held: tuple | None = None):
    """The scratch run of a lockstep pair, copied from `store` when it holds one: (its rollout records, the noise
    envelope or None, notes, (tokenizer, eos ids, device)). `held`: see twin_envelope."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer, resolve_device
    from harness.rollouts.lockstep import ROLLOUTS_FILE, RecordingSource, ReplaySource
    from scratch_grpo.train import train as train_scratch

    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    device = resolve_device(spec)
    eos = eos_token_ids(generation_config(ckpt), tok)  # no weights loaded just for this
    notes = []
    # an earlier run in this folder (--force) must not lend this one its noise twin
    (out_dir / noise.NOISE_FILE).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "twin", ignore_errors=True)
    if store is not None and store.fetch(spec, out_dir):
        records = ReplaySource.from_file(out_dir / ROLLOUTS_FILE).records
        notes.append(f"scratch run shared with another cell or re-run of this matrix ({store.entry(spec).name})")
    else:
        # the recorder: the scratch loop samples each round from its own weights (also when it is not compared)
        source = RecordingSource(spec, eos, tok.pad_token_id, device, out_dir / ROLLOUTS_FILE)
        train_scratch(spec, out_dir / "scratch", rollout_source=source, progress=progress,
                      record_rounds=recorded_rounds(spec))
        source.release()
        records = source.records
        if store is not None:  # kept now: a cut in its twin or in the other side leaves it to --resume
            store.keep(spec, out_dir)
    envelope = None
    if spec.TOLERANCE == "calibrated":
        envelope = noise.load(out_dir)
        if envelope is None:  # the noise twin: the same scratch run on the same rollouts, changed only in rounding
            train_scratch(spec, out_dir / "twin", rollout_source=ReplaySource(records), progress=progress,
                          noise_twin=True)
            envelope = twin_envelope(out_dir / "scratch", out_dir / "twin", held)
            noise.save(envelope, out_dir, noise.k_of(load_tolerances()),
                       str(out_dir / "twin"))
    if store is not None:
        store.keep(spec, out_dir)
    return records, envelope, notes, (tok, eos, device)


def twin_envelope(plain_dir: Path, twin_dir: Path, held: tuple[dict, dict] | None = None):
    """The noise envelope of a plain scratch run and its noise twin (both run folders). `held`: (metric logs by side
    folder name, sketches by run folder path), a cell's in the making: the plain run's log and sketch read here go
    there, for the comparison after."""
    plain, plain_sketch = load_any_run(plain_dir), read_sketch(plain_dir)
    if held is not None:
        held[0][Path(plain_dir).name], held[1][str(plain_dir)] = plain, plain_sketch
    return noise.envelope(plain, load_any_run(twin_dir), relative_l2(read_sketch(twin_dir), plain_sketch))


def compare_loaded(spec, a_dir: Path, b_dir: Path, mode: str, envelope=None, sketches: dict | None = None,
                   runs: dict | None = None) -> tuple[dict, dict]:
    """The comparison of two sides' runs, and each side's metric log ({side folder name: frame}; {} when neither
    `sketches` nor `runs` is given and compare_runs reads two built-in sides itself). For a user's loop only the
    metrics both sides log are compared (the rest are listed as not compared), and the final weights it saved are
    held against the other side's at that step. `envelope`: the noise twin's, for the calibrated tolerance
    (lockstep). `sketches` ({run folder path: cell.Sketch}, CellData's) and `runs` (metric logs by side folder
    name): what the caller holds already, not read again; a sketch read here is added to `sketches`."""
    from harness.diagnose.compare import compare_frames

    if "yours" not in (a_dir.name, b_dir.name) and sketches is None and runs is None:
        return compare_runs(a_dir, b_dir, mode=mode, dtype=spec.DTYPE, envelope=envelope), {}
    runs = dict(runs or {})
    for d in (a_dir, b_dir):
        if d.name not in runs:
            runs[d.name] = load_any_run(d)
    a, b = runs[a_dir.name], runs[b_dir.name]
    if "yours" not in (a_dir.name, b_dir.name):  # compare_runs, on what is in hand
        rel = relative_l2(sketches.get(str(a_dir)), sketches.get(str(b_dir))) if sketches is not None else None
        return compare_runs(a_dir, b_dir, mode=mode, dtype=spec.DTYPE, envelope=envelope, held=(a, b, rel)), runs
    result = compare_frames(a, b, mode=mode, dtype=spec.DTYPE, tolerances=load_tolerances(), one_sided="not_compared",
                            envelope=envelope)
    result["runs"] = [str(a_dir), str(b_dir)]
    not_compared = sorted(set(a.columns) ^ set(b.columns))
    if not_compared:
        result["notes"].append(f"not compared (logged by one side only): {', '.join(not_compared[:12])}"
                               + (" ..." if len(not_compared) > 12 else ""))
    yours, other = (a_dir, b_dir) if a_dir.name == "yours" else (b_dir, a_dir)
    from harness.diagnose.compare import steps_logged_words

    skipped = steps_logged_words(runs[yours.name], spec)
    if skipped:
        result["notes"].append(skipped)
    _held_to_final_weights(result, spec, yours, other, runs[yours.name], mode, envelope, sketches)
    return _defined_differently(result), runs


FINAL = "#final"  # in a cell's sketches, your run's folder + FINAL: the sketch of the final weights it saved


def _held_to_final_weights(result: dict, spec, yours: Path, other: Path, log, mode: str, envelope,
                           sketches: dict | None) -> None:
    """The final weights your loop saved against the other side's sketch at that step, into `result`."""
    from loop_runner.run import final_weights_distance, final_weights_sketch

    if sketches is not None and str(other) in sketches:
        sketch = sketches[str(other)]
    else:
        sketch = read_sketch(other)
        if sketches is not None:
            sketches[str(other)] = sketch  # (a search's run: read here once, for whoever needs it after)
    last = int(log.index.max()) if len(log.index) else 0
    if sketch is None or not 1 <= last <= len(sketch.rows):  # nothing to hold your saved weights against
        return
    if sketches is not None and str(yours) + FINAL in sketches:
        mine = sketches[str(yours) + FINAL]
    else:
        found = final_weights_sketch(yours, spec.SEED)
        mine = Sketch(*found) if found is not None else None
        if sketches is not None:
            sketches[str(yours) + FINAL] = mine  # your final weights, sketched once per cell
    if mine is None or mine.meta["width"] != sketch.meta["width"]:
        return
    step, dist = last, final_weights_distance(mine.rows[-1], sketch.rows[last - 1])
    from harness.diagnose.compare import param_limit

    tol = load_tolerances()
    limit = param_limit(tol, mode, spec.DTYPE, calibrated=envelope is not None)
    env_at = envelope.at("param_rel_l2", [step]) if envelope is not None else None
    if env_at is not None:
        limit = float(noise.bound(limit, env_at[0], noise.k_of(tol)))
    result["metrics"]["param_rel_l2"] = {"max_abs": dist, "step_max_abs": step, "max_rel": dist, "mean_delta": dist,
                                         "first_outside": step if dist > limit else None,
                                         "tolerance": {"max": limit}}
    result["notes"].append(f"final weights (step {step}): relative L2 distance {dist:.3g} (tolerance {limit:g})")
    if dist > limit and mode == "lockstep":
        if result["first_divergence"] is None or result["first_divergence"]["step"] > step:
            result["first_divergence"] = {"step": step, "metric": "param_rel_l2"}
        result["outside"] = sorted(set(result["outside"]) | {"param_rel_l2"})


def _defined_differently(result: dict) -> dict:
    """Your loop against another side: when only statistics of the completions or the policy part (kl, entropy,
    clip ratios, rewards, lengths) while what training computes agrees (the loss, and grad_norm or the final
    weights, compared and within tolerance), the runs train alike and those metrics are defined differently in your
    loop (a kl averaged over the round's tokens where TRL averages per micro-batch, say): listed in
    `defined_differently`, not a divergence."""
    from harness.diagnose.compare import is_derived

    outside = result.get("outside", [])
    metrics = result.get("metrics", {})
    if not outside or not all(is_derived(m) for m in outside):
        return result
    trains = [m for m in ("loss", "grad_norm", "param_rel_l2") if m in metrics]
    if "loss" not in trains or len(trains) < 2:  # the loss alone agreeing says too little
        return result
    result["defined_differently"] = sorted(outside)
    steps = {m: metrics[m].get("first_outside") for m in outside}
    result["notes"].append(
        "defined differently in your loop: " + ", ".join(f"{m} (from step {s})" for m, s in steps.items())
        + f"; training agrees ({', '.join(trains)} within tolerance at every compared step)")
    result["first_divergence"], result["outside"] = None, []
    return result


def run_free_pair(spec, out_dir: Path, progress: bool = False, seeds: int | None = None,
                  sides: tuple[str, str] = ("scratch", "trl")) -> dict:
    """Both sides, `seeds` (default: the spec's FREE_SEEDS) seeds each (SEED, SEED+1, ...), each sampling for
    itself; then compare_free."""
    runs = {side: [] for side in sides}
    for i in range(seeds or spec.FREE_SEEDS):
        seeded = apply_alignment(spec, {"set": {"SEED": spec.SEED + i}})
        for side in sides:
            d = Path(out_dir) / side / f"seed-{spec.SEED + i}"
            _train(side, seeded, d, progress)
            runs[side].append(d)
    # a user's loop logs what it logs: metrics only one side has are listed, not counted as a divergence
    result = compare_free(runs[sides[0]], runs[sides[1]],
                          one_sided="not_compared" if "yours" in sides else "divergence")
    result["runs"] = {k: [str(p) for p in v] for k, v in runs.items()}
    return result
