"""A cell's folder is read once (issue 46): once a pair has run, every later step (the comparison, your loop's
stages, the explanation, the float32 re-check, the verdict) takes the CellData, and no file of the cell folder is
opened for reading twice. Checked on the hardest path: your loop in lockstep, in bf16, at parity there, so the cell
goes to float32 (a float32 cell of its own in float32/), where your loop parts from TRL and is explained.

What is counted: every open for reading, by this process, of a file under the run folder. What is not: a file
copied whole (the scratch store's copies, the float32 cell's copy of the rollouts: shutil reads bytes, parses
nothing), and what other processes read (your loop's own reading of its inputs)."""

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
            if not any(f.filename.endswith("shutil.py") for f in stack[-3:]):  # a copy, not a read
                caller = next((f for f in reversed(stack) if f.filename.startswith(str(ROOT))
                               and "/.venv/" not in f.filename), stack[-1])
                seen[os.path.relpath(path, root)].append(f"{os.path.basename(caller.filename)}:{caller.lineno} "
                                                         f"{caller.name}")
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return seen


@pytest.mark.slow
def test_each_file_of_a_cell_is_read_at_most_once(tmp_path, opens):
    command = f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'} --adam-beta2 0.9"
    spec = small_spec(f"loop.command={json.dumps(command)}", 'DTYPE="bfloat16"', "STEPS=6")
    doc = run_matrix(spec, tmp_path / "run", "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity" and cell["precision"]["first_divergence"], cell.get("precision")  # float32 ran
    assert any(path.startswith(os.path.join("run", "yours-vs-trl", "float32")) for path in opens)
    twice = {path: who for path, who in opens.items() if len(who) > 1}
    assert not twice, "read more than once:\n" + "\n".join(f"  {p}: {w}" for p, w in sorted(twice.items()))
