"""The command line's contract (README "Exit codes"): 0 parity/ok, 1 divergence or differences, 2 bad input in one
line on stderr, 3 a run that could not finish; never a traceback for what a user can type or point at, unless
--debug. Through `harness.cli.main` on small files written here; no model loads."""

import json

import pytest

from conftest import DEFAULT_SPEC
from harness.cli import main


def write(path, text: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def logs(tmp_path):
    a = write(tmp_path / "a.csv", "step,loss\n1,0.5\n2,0.4\n")
    b = write(tmp_path / "b.csv", "step,loss\n1,0.5\n2,0.9\n")
    return a, b


def test_compare_exits_0_at_parity_and_1_on_a_divergence(logs, capsys):
    a, b = logs
    assert main(["compare", str(a), str(a)]) == 0
    assert main(["compare", str(a), str(b)]) == 1


def test_validate_exits_0_and_a_bad_spec_2(tmp_path, capsys):
    assert main(["validate", "--spec", str(DEFAULT_SPEC)]) == 0
    assert main(["validate", "--spec", str(DEFAULT_SPEC), "--set", "STEPS=0"]) == 2
    assert "STEPS" in one_line_error(capsys)


@pytest.mark.parametrize("content, words", [
    (b'NAME = "caf\xe9"\n', "not UTF-8"),  # Latin-1
    (b"\xff\xfe\x00N\x00A", "not UTF-8"),  # UTF-16 with a BOM
    (b"NAME = \n", "not valid TOML"),
])
def test_a_spec_that_is_not_utf8_or_not_toml_is_one_line(tmp_path, capsys, content, words):
    spec = write(tmp_path / "bad.toml", content)
    assert main(["validate", "--spec", str(spec)]) == 2
    line = one_line_error(capsys)
    assert str(spec) in line and words in line


def test_a_missing_file_is_one_line(tmp_path, capsys, logs):
    assert main(["validate", "--spec", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in one_line_error(capsys)
    assert main(["compare", str(logs[0]), str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv" in one_line_error(capsys)


@pytest.mark.parametrize("name, content", [
    ("bin.jsonl", bytes(range(256)) * 4),
    ("bin.csv", b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
    ("nul.jsonl", b"\x00\x00\x00\n"),
])
def test_a_binary_metric_log_is_one_line(tmp_path, capsys, logs, name, content):
    junk = write(tmp_path / name, content)
    assert main(["compare", str(logs[0]), str(junk)]) == 2
    assert name in one_line_error(capsys)


def test_a_truncated_metric_log_is_read_up_to_the_cut(tmp_path, capsys, logs):
    cut = write(tmp_path / "run" / "metrics.jsonl", '{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert main(["compare", str(logs[0]), str(cut)]) == 0
    out = capsys.readouterr().out
    assert "last line is not complete JSON" in out


def test_a_run_folder_whose_manifest_is_not_an_object_is_one_line(tmp_path, capsys, logs):
    run = tmp_path / "run"
    write(run / "metrics.jsonl", '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
    write(run / "manifest.json", "[1, 2]")
    assert main(["compare", str(logs[0]), str(run)]) == 2
    assert "manifest.json" in one_line_error(capsys)
    write(run / "manifest.json", b"\xff\xfe")
    assert main(["compare", str(logs[0]), str(run)]) == 2
    assert "manifest.json" in one_line_error(capsys)


def test_wandb_step_column_is_read_as_the_step(tmp_path, capsys, logs):
    """W&B's history export names its step `_step` (from 0): it is the step when nothing better is there."""
    wandb = write(tmp_path / "wandb.csv", "_step,_runtime,_timestamp,train/loss\n1,3.1,1700000000,0.5\n"
                                          "2,6.0,1700000003,0.4\n")
    assert main(["compare", str(logs[0]), str(wandb)]) == 0
    assert "_runtime" not in capsys.readouterr().out


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, logs, where):
    blocker = write(tmp_path / "taken", "a file")
    out = blocker if where == "a file" else blocker / "sub"
    assert main(["compare", str(logs[0]), str(logs[0]), "--out", str(out)]) == 2
    line = one_line_error(capsys)
    assert "--out" in line and str(blocker) in line
    assert main(["run", "scratch", "--spec", str(DEFAULT_SPEC), "--out", str(out)]) == 2
    assert "--out" in one_line_error(capsys)
    assert main(["parity", "--spec", str(DEFAULT_SPEC), "--out", str(out), "--matrix", "none"]) == 2
    assert "--out" in one_line_error(capsys)


def test_an_out_on_a_read_only_place_is_one_line(capsys, logs):
    assert main(["compare", str(logs[0]), str(logs[0]), "--out", "/proc/grpo-parity-x"]) == 2
    assert "/proc/grpo-parity-x" in one_line_error(capsys)


def test_a_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "only-one"])
    assert e.value.code == 2
    assert "the following arguments are required" in one_line_error(capsys)
    with pytest.raises(SystemExit) as e:
        main(["nonsense"])
    assert e.value.code == 2 and "nonsense" in one_line_error(capsys)


@pytest.mark.parametrize("doc", ['{"cells": []}', "[1, 2]", '{"base_spec": 3, "matrix": "none", "mode": "x"}'])
def test_resume_from_a_corrupt_verdict_is_one_line(tmp_path, capsys, doc):
    write(tmp_path / "run" / "verdict.json", doc)
    assert main(["parity", "--resume", str(tmp_path / "run")]) == 2
    assert "verdict.json" in one_line_error(capsys)


@pytest.mark.parametrize("raised, words", [
    (KeyboardInterrupt("SIGINT after step 3"), "--resume"),
    (FloatingPointError("non-finite loss at step 2"), "non-finite loss at step 2"),
    (MemoryError(), "out of memory"),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 90.00 GiB"), "GRAD_ACCUM"),
    (RuntimeError("a side crashed\nwith a second line"), "--debug"),
])
def test_a_run_that_could_not_finish_exits_3_in_one_line(monkeypatch, capsys, logs, raised, words):
    from harness.diagnose import compare

    def boom(*a, **k):
        raise raised

    monkeypatch.setattr(compare, "load_inputs", boom)
    assert main(["compare", str(logs[0]), str(logs[1])]) == 3
    assert words in one_line_error(capsys)


@pytest.mark.parametrize("argv", [["--debug", "compare"], ["compare", "--debug"]])
def test_debug_shows_the_traceback_and_keeps_the_code(monkeypatch, capsys, logs, argv):
    from harness.diagnose import compare

    def boom(*a, **k):
        raise RuntimeError("a side crashed")

    monkeypatch.setattr(compare, "load_inputs", boom)
    assert main([*argv, str(logs[0]), str(logs[1])]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a side crashed" in err


def test_a_crashed_preflight_exits_3_not_1(monkeypatch, capsys):
    from harness.diagnose import preflight

    def boom(*a, **k):
        raise TypeError("preflight bug")

    monkeypatch.setattr(preflight, "preflight", boom)
    assert main(["preflight", "--spec", str(DEFAULT_SPEC)]) == 3
    assert "preflight bug" in one_line_error(capsys)


@pytest.mark.parametrize("cells, complete, code", [
    ([{"ok": True, "verdict": "parity"}], True, 0),
    ([{"ok": False, "verdict": "parity"}], True, 1),
    ([{"ok": True, "verdict": "parity"}, {"ok": False, "verdict": "failed"}], True, 3),
    ([{"ok": False, "verdict": "error"}], True, 3),
    ([{"ok": True, "verdict": "parity"}], False, 3),
])
def test_parity_exit_code(cells, complete, code):
    from harness.cli import parity_exit_code

    doc = {"ok": complete and all(c["ok"] for c in cells), "complete": complete, "cells": cells}
    assert parity_exit_code(doc) == code


def test_readme_states_the_contract():
    from conftest import ROOT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Exit codes"):]
    for code in ("0", "1", "2", "3"):
        assert f"| {code} |" in section
    assert "--debug" in section


def test_compare_out_report_for_wandb_log(tmp_path, logs):
    wandb = write(tmp_path / "wandb.csv", "_step,train/loss\n1,0.5\n2,0.4\n")
    assert main(["compare", str(logs[0]), str(wandb), "--out", str(tmp_path / "cmp")]) == 0
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())["first_divergence"] is None


def test_out_dir_problem_without_write_permission(tmp_path, monkeypatch):
    """(The tests may run as root, whom chmod does not stop: os.access stands in for a folder of someone else's.)"""
    import os

    from harness.cli import out_dir_problem

    assert out_dir_problem(tmp_path / "new" / "deeper") is None
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert out_dir_problem(tmp_path / "new" / "deeper") == f"no permission to write in {tmp_path}"
