"""The GPU tools (tools/*.py) run where device time is scarce: a stale import there costs a GPU call (it did once:
decode_bench imported encode_prompts from the module it had moved out of). Here every name they import from this
project must exist, and the training profile runs end to end on CPU at a toy size."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("harness", "scratch_grpo", "trl_runner", "loop_runner")
TOOLS = sorted((ROOT / "tools").glob("*.py"))


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_every_project_name_a_tool_imports_exists(tool):
    missing = []
    for node in ast.walk(ast.parse(tool.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name} (line {node.lineno})" for a in node.names if not hasattr(module, a.name)]
    assert not missing, f"{tool.name} imports names that do not exist: {missing}"


def test_train_profile_runs_on_cpu():
    out = subprocess.run([sys.executable, "tools/train_profile.py", "--spec", "harness/specs/default.toml", "--device",
                          "cpu", "--rows", "2", "--tokens", "8", "--prompt", "4", "--reps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("scratch micro-batch", "forward only", "the loss alone", "chunk functions not compiled"):
        assert line in out.stdout, out.stdout
