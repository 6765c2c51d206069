"""A cell's folder is read once (issue 46): once a pair has run, every later step (the comparison, your loop's
stages, the explanation, the float32 re-check, the verdict) takes the CellData, and the diagnosis opens no file of
the cell folder for reading twice. Checked on the hardest path, your loop in lockstep in bf16 at parity, so that the
cell goes to float32 (a float32 cell of its own in float32/) where your loop parts from TRL and is explained; on a
loop that chooses its completions (the built-in loop replays its selection); and on a toggle of the two built-in
sides that goes to float32 with several causes (re-runs, their shares).

What is counted: every open for reading, in this process, of a file under the run folder, by the diagnosis
(harness/diagnose, and what it calls in the run log and rollouts). What is not: what a side reads as its input (the
built-in loop reading the SELECTION file it replays, the loop runner checking your loop's files: sides, not the
diagnosis), a file copied whole (the scratch store's copies and byte comparisons, the float32 cell's copy of the
rollouts: nothing parsed), and what other processes read (your loop itself)."""

from __future__ import annotations

import builtins
import collections
import io
import json
import os
import sys
import traceback

import pytest

from conftest import ROOT, small_spec
from harness.diagnose.matrix import run_matrix


@pytest.fixture
def opens(monkeypatch, tmp_path):
    """{path under tmp_path: [who opened it for reading, ...]} while the test runs."""
    seen: dict[str, list[str]] = collections.defaultdict(list)
    real = builtins.open
    root = str(tmp_path)

    def counting(file, mode="r", *args, **kwargs):
        path = os.fspath(file) if isinstance(file, (str, os.PathLike)) else None
        if path and path.startswith(root) and not any(c in mode for c in "wax+"):
            stack = traceback.extract_stack()[:-1]
            if _by_the_diagnosis(stack) and not any(f.filename.endswith(("shutil.py", "filecmp.py"))
                                                    for f in stack[-3:]):  # a copy, not a read
                caller = next((f for f in reversed(stack) if f.filename.startswith(str(ROOT))
                               and "/.venv/" not in f.filename), stack[-1])
                seen[os.path.relpath(path, root)].append(f"{os.path.basename(caller.filename)}:{caller.lineno} "
                                                         f"{caller.name}")
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return seen


SIDES = tuple(str(ROOT / d) for d in ("scratch_grpo", "trl_runner", "loop_runner"))


def _by_the_diagnosis(stack) -> bool:
    """The innermost project frame that is the diagnosis's or a side's: the diagnosis's? (Your saved weights are
    sketched by loop_runner's final_weights_sketch for the diagnosis: that counts as the diagnosis.)"""
    for f in reversed(stack):
        if f.filename.startswith(SIDES):
            return f.name == "final_weights_sketch"
        if f.filename.startswith(str(ROOT / "harness" / "diagnose")):
            return True
    return False


def _loop(*flags: str) -> str:
    return json.dumps(f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'} " + " ".join(flags))


@pytest.mark.slow
@pytest.mark.parametrize("overrides, folder", [
    ([f"loop.command={_loop('--adam-beta2 0.9')}", 'DTYPE="bfloat16"', "STEPS=6"], "yours-vs-trl/float32"),
    ([f"loop.command={_loop('--skip-flat-groups')}", "STEPS=6"], "yours-vs-trl/explain"),
    (["STEPS=4", "trl.adam_beta2=0.9", 'trl.loss_type="dapo"'], "as-given/aligned-"),
    (['DTYPE="bfloat16"', "STEPS=6", "trl.adam_beta2=0.9"], "as-given/float32/aligned-"),
], ids=["your-loop-to-float32", "your-loop-choosing-completions", "several-causes", "a-toggle-to-float32"])
def test_each_file_of_a_cell_is_read_at_most_once(tmp_path, opens, overrides, folder):
    doc = run_matrix(small_spec(*overrides), tmp_path / "run", "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] in ("parity", "diverged"), cell.get("error")
    assert any(path.startswith(os.path.join("run", *folder.split("/"))) for path in opens), sorted(opens)[:20]
    twice = {path: who for path, who in opens.items() if len(who) > 1}
    assert not twice, "read more than once:\n" + "\n".join(f"  {p}: {w}" for p, w in sorted(twice.items()))
