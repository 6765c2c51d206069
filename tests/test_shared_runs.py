"""No scratch run done twice: cells whose scratch side is set up alike share one scratch run (and its recording
and noise twin) through `pairs.ScratchStore`, keyed by what the scratch side reads."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from conftest import DEFAULT_SPEC
from harness.diagnose.matrix import build_cells, run_matrix
from harness.diagnose.pairs import SCRATCH_BLIND, SCRATCH_CODE, SHARED_DIR, scratch_key
from harness.experiment.spec import Spec, load_spec

ROOT = Path(__file__).resolve().parents[1]


def test_the_scratch_side_reads_none_of_the_fields_its_key_leaves_out():
    """A field left out of scratch_key must not change the scratch run: its code never reads it."""
    sources = [f for name in SCRATCH_CODE for f in ((ROOT / name).rglob("*.py") if (ROOT / name).is_dir()
                                                    else [ROOT / name])]
    assert len(sources) > 10
    readers = {}
    for f in sources:
        if f.name == "limits.py":  # checks before any run (the memory floor of both sides), not the scratch run
            continue
        # the spec module checks fields against each other (not the run); its derived properties are checked below
        text = f.read_text() if f.name != "spec.py" else "\n".join(
            inspect.getsource(getattr(Spec, p).fget) for p in ("sequences_per_step", "micro_batch_size", "rounds"))
        for field in SCRATCH_BLIND:
            if re.search(rf"\b(spec|self)\.{re.escape(field)}\b", text):
                readers.setdefault(field, []).append(f.relative_to(ROOT).as_posix())
    assert not readers, f"scratch-side code reads fields scratch_key ignores: {readers}"


def test_default_matrix_needs_six_scratch_runs_not_ten():
    base = load_spec("harness/specs/default.toml")
    cells = build_cells(base, "default")
    keys = {scratch_key(c.spec) for c in cells}
    assert len(cells) == 10 and len(keys) == 6
    # the TRL-only toggles share the matched cell's scratch run
    by_name = {c.name: scratch_key(c.spec) for c in cells}
    assert by_name["matched"] == by_name["batch=naive"] == by_name["loss_type=dapo"]
    assert by_name["matched"] != by_name["matched:loss_type=dapo"]


def test_a_changed_reward_or_spec_field_changes_the_key():
    base = load_spec("harness/specs/default.toml")
    assert scratch_key(base) != scratch_key(load_spec("harness/specs/default.toml", ["LR=0.002"]))
    assert scratch_key(base) == scratch_key(load_spec("harness/specs/default.toml", ["NAME=other", "TOLERANCE=static"]))


def test_cells_share_one_scratch_run_and_resume_reuses_it(tmp_path):
    base = load_spec("harness/specs/default.toml", ["STEPS=2"])
    out = tmp_path / "m"
    doc = run_matrix(base, out, "default", only=["matched", "loss_type=dapo"], log=lambda *_: None)
    assert [c["verdict"] for c in doc["cells"]] == ["parity", "diverged"]
    assert len([p for p in (out / SHARED_DIR).iterdir() if not p.name.startswith(".")]) == 1
    dapo = doc["cells"][1]
    assert any("scratch run shared" in n for n in dapo["notes"])
    assert not (out / "loss_type-dapo" / "twin").exists()  # its envelope came with the shared run
    assert (out / "loss_type-dapo" / "noise_envelope.json").exists()
    # the attribution's re-run (loss_type aligned) has the same scratch side: shared too
    assert (out / "loss_type-dapo").is_dir()
    same = (out / "matched" / "scratch" / "metrics.jsonl").read_text()
    assert (out / "loss_type-dapo" / "scratch" / "metrics.jsonl").read_text() == same


def test_a_rerun_that_resolves_to_a_cells_own_spec_reuses_that_cells_pair(tmp_path, monkeypatch):
    """batch=naive with its batch mapping aligned is the matched cell's spec: its confirmation takes the matched
    cell's pair instead of running the same pair again (still confirmed, counted as reused)."""
    from harness.diagnose import pairs

    made = []
    real = pairs.run_pair

    def counted(spec, out_dir, *args, **kwargs):
        made.append(Path(out_dir).name)
        return real(spec, out_dir, *args, **kwargs)

    monkeypatch.setattr(pairs, "run_pair", counted)
    doc = run_matrix(load_spec(DEFAULT_SPEC, ["STEPS=2"]), tmp_path, "default", log=lambda *_: None,
                     only=["matched", "batch=naive"])
    assert doc["ok"]
    assert made == ["matched", "batch-naive"]  # no aligned-batch pair
    detail = {c["name"]: c for c in doc["cells"]}["batch=naive"]["attribution_detail"][0]
    assert detail["status"] == "confirmed" and (detail["reruns"], detail["reused"]) == (0, 1)


def test_a_resumed_matrix_takes_the_reruns_an_earlier_run_made(tmp_path, monkeypatch):
    """Issue 21: a re-run is kept (by a content hash of the spec, the mode and the code) in the matrix folder, so
    after a --resume the cell that needs it again takes it instead of making it; also from a moved folder."""
    import json
    import shutil

    from harness.diagnose import pairs

    base = load_spec(DEFAULT_SPEC, ["STEPS=2"])
    first = tmp_path / "first"
    doc = run_matrix(base, first, "default", only=["is=sequence_mask"], log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged" and cell["attribution_detail"][0]["reruns"] == 1
    # as if the run had been stopped after the re-run, before the cell's verdict: the cell is not finished
    verdict = json.loads((first / "verdict.json").read_text())
    verdict.update(cells=[], cells_done=0, complete=False)
    (first / "verdict.json").write_text(json.dumps(verdict))
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    made, lines = [], []
    real = pairs.run_pair

    def counted(spec, out_dir, *args, **kwargs):
        made.append(Path(out_dir).name)
        return real(spec, out_dir, *args, **kwargs)

    monkeypatch.setattr(pairs, "run_pair", counted)
    again = run_matrix(base, moved, "default", only=["is=sequence_mask"], log=lines.append, resume=True)
    assert made == ["is-sequence_mask"]  # its own pair only: no aligned-importance_sampling pair
    assert any("made by an earlier run of this matrix, reused" in line for line in lines)
    redone = again["cells"][0]
    detail = redone["attribution_detail"][0]
    assert (detail["status"], detail["reruns"], detail["reused"]) == ("confirmed", 0, 1)
    assert [(e["cause"], e["status"]) for e in redone["attribution_detail"]] == \
        [(e["cause"], e["status"]) for e in cell["attribution_detail"]]
    # a kept entry whose run folders are gone serves no more: the re-run is made again
    shutil.rmtree(next(moved.glob("is-sequence_mask/aligned-*")))
    verdict = json.loads((moved / "verdict.json").read_text())
    verdict.update(cells=[], cells_done=0, complete=False)
    (moved / "verdict.json").write_text(json.dumps(verdict))
    made.clear()
    run_matrix(base, moved, "default", only=["is=sequence_mask"], log=lambda *_: None, resume=True)
    assert made == ["is-sequence_mask", "aligned-importance_sampling"]


def test_a_rerun_that_cannot_be_kept_still_serves_its_cell(tmp_path, monkeypatch):
    """Keeping a re-run for --resume is a convenience: a full disk there leaves the cell's verdict as it was."""
    from harness.diagnose import pairs

    def full(self, spec, mode, result):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pairs.PairResults, "keep", full)
    lines = []
    doc = run_matrix(load_spec(DEFAULT_SPEC, ["STEPS=2"]), tmp_path, "default", only=["is=sequence_mask"],
                     log=lines.append)
    assert doc["ok"] and doc["cells"][0]["attribution_detail"][0]["status"] == "confirmed"
    assert any("could not be kept for --resume" in line and "No space left" in line for line in lines)


def test_a_scratch_run_whose_twin_was_cut_off_is_kept_and_only_the_twin_runs_again(tmp_path, monkeypatch):
    """The scratch run is kept in the store as soon as it finishes: a cut in its noise twin (or in the other side)
    leaves it, and the next make_scratch (a resumed matrix) copies it and makes only the twin. Until the twin is
    there the entry is not whole, so a parallel cell still waits for the run that makes it."""
    import scratch_grpo.train as scratch_train
    from harness.diagnose import noise, pairs

    spec = load_spec("harness/specs/default.toml", ["STEPS=2"])
    store = pairs.ScratchStore(tmp_path / SHARED_DIR)
    real, calls = scratch_train.train, []

    def cut_twin(*args, noise_twin=False, **kwargs):
        calls.append(noise_twin)
        if noise_twin and calls.count(True) == 1:
            raise KeyboardInterrupt("SIGTERM")
        return real(*args, noise_twin=noise_twin, **kwargs)

    monkeypatch.setattr(scratch_train, "train", cut_twin)
    with pytest.raises(KeyboardInterrupt):
        pairs.make_scratch(spec, tmp_path / "a", store=store)
    assert calls == [False, True]
    assert (store.entry(spec) / "scratch").is_dir() and not store.has(spec)  # kept, not whole
    kept = store.entry(spec) / "scratch" / "metrics.jsonl"
    first, inode = kept.read_text(), kept.stat().st_ino
    pairs.make_scratch(spec, tmp_path / "b", store=store)
    assert calls == [False, True, True]  # the twin alone
    assert store.has(spec) and (store.entry(spec) / noise.NOISE_FILE).exists()
    assert kept.stat().st_ino == inode  # the envelope was added to the entry: the run in it never left
    assert not [p.name for p in store.root.iterdir() if p.name.startswith(".")]  # nothing left aside
    assert (tmp_path / "b" / "scratch" / "metrics.jsonl").read_text() == first
