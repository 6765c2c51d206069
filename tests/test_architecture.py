"""The layout rule (docs/architecture.md): data flows one way, experiment -> runlog -> rollouts -> sides ->
diagnose -> reports and front ends. Read from every module's imports (function-level ones included), and
every module must import."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "scratch_grpo", "trl_runner", "loop_runner", "reports")

# stage of a module -> the stages it may import (itself included)
STAGES = {
    "experiment": {"experiment"},
    "runlog": {"experiment", "runlog"},
    "rollouts": {"experiment", "runlog", "rollouts"},
    "scratch": {"experiment", "runlog", "rollouts", "scratch"},
    "trl": {"experiment", "runlog", "rollouts", "trl"},
    "loop": {"experiment", "runlog", "rollouts", "loop"},
    "diagnose": {"experiment", "runlog", "rollouts", "scratch", "trl", "loop", "diagnose"},
    "reports": {"experiment", "runlog", "rollouts", "scratch", "trl", "loop", "diagnose", "reports"},
    "front": {"experiment", "runlog", "rollouts", "scratch", "trl", "loop", "diagnose", "reports", "front"},
}


def stage_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "scratch_grpo":
        return "scratch"
    if parts[0] == "trl_runner":
        return "trl"
    if parts[0] == "loop_runner":
        return "loop"
    if parts[0] == "reports":
        return "reports"
    if len(parts) > 1 and parts[1] in ("experiment", "runlog", "rollouts", "diagnose"):
        return parts[1]
    return "front"  # harness.cli, pytest_plugin, bench, record, loop (your loop's helpers), __main__


def all_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that `module` imports anywhere in its file (`from pkg import mod` counted as pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_imports_and_says_what_it_owns():
    for module, path in all_modules().items():
        if module == "harness.__main__":
            continue
        mod = importlib.import_module(module)
        assert (mod.__doc__ or "").strip(), f"{module} ({path.relative_to(ROOT)}) has no opening docstring"


def test_no_stage_imports_a_later_one():
    bad = []
    for module, deps in graph().items():
        allowed = STAGES[stage_of(module)]
        for dep in sorted(deps):
            if stage_of(dep) not in allowed:
                bad.append(f"{module} ({stage_of(module)}) imports {dep} ({stage_of(dep)})")
    assert not bad, "imports against the data flow (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_circle():
    g = graph()
    # package __init__ files are their modules' parents, not edges of the data flow
    g = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_rule_catches_a_side_importing_the_diagnosis():
    """The checker itself: a made-up edge from a side into the diagnosis is reported."""
    assert stage_of("harness.diagnose.compare") not in STAGES[stage_of("scratch_grpo.train")]
    assert stage_of("trl_runner.runner") not in STAGES[stage_of("harness.rollouts.lockstep")]
    assert stage_of("scratch_grpo.core") not in STAGES[stage_of("trl_runner.translate")]


# the diagnosis in small parts (issue 46): a stage is a small file, and a function does one job
DIAGNOSE = ROOT / "harness" / "diagnose"
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80


def too_long(path: Path) -> list[str]:
    """What in one file breaks the size rule: the file itself, and each function (its nested ones inside it)."""
    text = path.read_text()
    found = [f"{path.name}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_the_diagnosis_is_in_small_files_and_functions():
    bad = [b for path in sorted(DIAGNOSE.rglob("*.py")) for b in too_long(path)]
    assert not bad, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function:\n  " + "\n  ".join(bad)


def test_the_size_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    assert too_long(tmp_path / "long.py") == [f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    (tmp_path / "short.py").write_text(f"def f():\n{body[:body.rindex(chr(10))]}\n")
    assert too_long(tmp_path / "short.py") == []
