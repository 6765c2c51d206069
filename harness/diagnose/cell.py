"""One cell of a parity run, read once: what the pair left in its folder, as one frozen object.

A cell's folder holds each side's run, the lockstep rollouts, the noise twin's envelope and, for your loop, its
saved tensors, selection and rewards. `run_pair` has most of it in hand when it returns; `CellData` keeps it, so that
every later step (the attribution, your loop's stages read by `identify`, the explanation, the float32 re-check, the
verdict, the report) takes this object and no module reads a file of the cell folder back. The folder itself is
still where later steps write (a search's runs, the written TRL table).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

EXPLAIN_FILE = "your_loop_in_trl.toml"  # beside verdict.json: the TRL table the explanation of your loop writes


@dataclasses.dataclass(frozen=True, eq=False)
class Sketch:
    """A run's parameter sketch (harness/runlog/params.py): a fixed slice of the weights after each step."""
    rows: np.ndarray  # steps x width
    meta: dict
    init: np.ndarray | None = None  # the same coordinates before the first step (None: not recorded)


def read_sketch(run_dir: Path) -> Sketch | None:
    """A run folder's sketch, read once (None when it recorded none)."""
    from harness.runlog.params import SKETCH_INIT, read_sketch as read

    found = read(run_dir)
    if found is None:
        return None
    init_path = Path(run_dir) / SKETCH_INIT
    init = np.fromfile(init_path, dtype=np.float32) if init_path.exists() else None
    return Sketch(found[0], found[1], init if init is not None and len(init) == found[1]["width"] else None)


def relative_l2(a: Sketch | None, b: Sketch | None) -> list[float] | None:
    """Per step ||a - b|| / ||b|| over the sketched coordinates (harness/runlog/params.relative_l2, on sketches in
    hand); None when either has none or they differ in width."""
    from harness.runlog.params import relative_l2_of

    return relative_l2_of(*((s.rows, s.meta) if s is not None else None for s in (a, b)))


def your_loop_files(yours_dir: Path, loop_rollouts: Path | None) -> dict:
    """What your loop saved besides its log, read once: its tensors, its selection (and where it is) and the
    reward functions' scores of each round it was given (from `loop_rollouts`; none when None), as CellData's
    fields."""
    from harness.diagnose.tensordiff import round_scores
    from harness.runlog.tensors import TENSORS_FILE, TRAINED_FILE, read_tensors, read_trained

    yours_dir = Path(yours_dir)
    trained = read_trained(yours_dir / TRAINED_FILE)
    return {"tensors": read_tensors(yours_dir / TENSORS_FILE), "trained": trained,
            "trained_path": str((yours_dir / TRAINED_FILE).resolve()) if trained else "",
            "scores": tuple(round_scores(loop_rollouts)) if loop_rollouts is not None else ()}


@dataclasses.dataclass(frozen=True, eq=False)
class CellData:
    """A pair's cell, loaded once. Sequences are tuples; make a changed copy with `dataclasses.replace` (the cell as
    TRL configures it: `replace(cell, spec=base)`). One field grows: `sketches` takes the sketch of each run a later
    step compares with the cell (a search's, TRL's with the written table) as it is read, so that it is read once.
    It pickles (a worker process or a Ray task hands it back whole); arrays and frames are never written to."""
    spec: object  # the spec the pair ran (harness.experiment.spec.Spec)
    folder: Path = Path(".")  # the cell folder: written to by later steps, never read back
    sides: tuple = ("scratch", "trl")  # the pair compared: ("yours", "trl") for your loop against TRL
    mode: str = "lockstep"  # lockstep | free
    comparison: dict = dataclasses.field(default_factory=dict)  # compare's result: the `compare` command's JSON
    runs: dict = dataclasses.field(default_factory=dict)  # side -> its metric log (a pandas DataFrame, step index)
    records: tuple = ()  # the lockstep rounds both sides trained on: {"round", "prompt_ids", "completion_ids",
    #                      "logprobs"} each (rollouts.jsonl)
    envelope: object = None  # the noise twin's envelope (noise.Envelope) for the calibrated tolerance, or None
    eos_ids: tuple = ()  # the checkpoint's eos token ids
    pad_id: int | None = None  # the tokenizer's pad token id
    scores: tuple = ()  # your loop's rounds: each {reward function: [score per completion]} (loop_rollouts.jsonl)
    tensors: dict = dataclasses.field(default_factory=dict)  # your loop's saved tensors {step: {name: value}}
    trained: dict | None = None  # your loop's selection {step: [(round, index), ...]} (harness.loop.trained)
    trained_path: str = ""  # where that selection is (the built-in loop's SELECTION replays it)
    sketches: dict = dataclasses.field(default_factory=dict)  # a run folder's path (str) -> its parameter sketch
    #   (Sketch) or None: the sides', then those of the runs later steps compare (a search's), added as read, once each

    @property
    def yours(self):
        """Your loop's metric log (None for a pair of the built-in sides)."""
        return self.runs.get("yours")

    def sketch(self, side: str) -> Sketch | None:
        """A side's parameter sketch (None when it recorded none)."""
        return self.sketches.get(str(Path(self.folder) / side))

    def grad_norms(self) -> dict[int, float]:
        """Your loop's logged pre-clip gradient norm per step ({} when it logs none)."""
        yours = self.yours
        if yours is None or "grad_norm" not in yours.columns:
            return {}
        return {int(s): float(v) for s, v in yours["grad_norm"].dropna().items()}


def load(spec, folder: Path, comparison: dict, sides: tuple = ("yours", "trl")) -> CellData:
    """A lockstep cell from its folder, for a caller that holds no pair (a test, a report made again): each file read
    once, here. The pair's own path is `pairs.run_pair(keep=True)`, which reads none of them back."""
    from harness.diagnose import noise
    from harness.diagnose.runs import load_any_run
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer
    from harness.rollouts.lockstep import LOOP_ROLLOUTS_FILE, ROLLOUTS_FILE, ReplaySource

    folder = Path(folder)
    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    extra = your_loop_files(folder / "yours", folder / LOOP_ROLLOUTS_FILE) if "yours" in sides else {}
    return CellData(spec, folder, tuple(sides), "lockstep", comparison,
                    {side: load_any_run(folder / side) for side in sides if (folder / side).is_dir()},
                    tuple(ReplaySource.from_file(folder / ROLLOUTS_FILE).records),
                    noise.load(folder) if spec.TOLERANCE == "calibrated" else None,  # (as the pair judged it)
                    tuple(eos_token_ids(generation_config(ckpt), tok)), tok.pad_token_id,
                    sketches={str(folder / side): read_sketch(folder / side) for side in sides}, **extra)
