"""Your own reward functions: `"file.py:name"` and `"package.module:name"` in a spec, the same objects on both
sides, and `validate` refusing broken ones with exit 2 and one line."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import DEFAULT_SPEC
from harness.cli import main
from harness.experiment.rewards import reward_functions, reward_provenance
from harness.experiment.spec import SpecError, load_spec

GOOD = '''
def short_and_right(prompts, completions, answer, **kwargs):
    """1 for the right number, minus a length penalty: a reward a user might write."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(float(a in text) - 0.01 * len(text.split()))
    return out
'''


def write_spec(folder, functions, extra=""):
    base = DEFAULT_SPEC.read_text().replace('functions = ["correctness", "format"]',
                                            f"functions = {json.dumps(functions)}")
    base = base.replace("weights = [1.0, 0.5]", f"weights = {json.dumps([1.0] * len(functions))}")
    path = folder / "spec.toml"
    path.write_text(base.replace("STEPS = 30", "STEPS = 3") + extra)
    return path


def test_file_entry_is_relative_to_the_spec_and_scores_both_sides(tmp_path, monkeypatch):
    from harness.diagnose.matrix import run_matrix
    from harness.runlog.log import read_run

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(GOOD)
    spec_path = write_spec(tmp_path, ["rewards/mine.py:short_and_right", "format"])
    monkeypatch.chdir(tmp_path.parent)  # another working directory: the path still means the spec's folder
    spec = load_spec(spec_path)
    assert spec.rewards.functions[0] == f"{tmp_path / 'rewards' / 'mine.py'}:short_and_right"
    fns = reward_functions(spec)
    assert fns[0].__name__ == "short_and_right" and reward_functions(spec)[0] is fns[0]  # one object per process
    prov = reward_provenance(spec)[0]
    assert prov["file"].endswith("mine.py") and len(prov["source_sha256"]) == 64

    doc = run_matrix(spec, tmp_path / "out", "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity", cell.get("first_divergence")
    scratch = read_run(tmp_path / "out" / "as-given" / "scratch")
    trl = read_run(tmp_path / "out" / "as-given" / "trl")
    key = "rewards/short_and_right/mean"
    assert key in scratch and key in trl
    assert scratch[key].tolist() == trl[key].tolist()  # same function, same completions, same scores
    assert scratch[key].nunique() > 1  # it really scored (the length term varies)
    manifest = json.loads((tmp_path / "out" / "as-given" / "trl" / "manifest.json").read_text())
    assert manifest["rewards"][0]["name"] == "short_and_right"
    assert manifest["rewards"][0]["source_sha256"] == prov["source_sha256"]


EXACT = '''
def exact(prompts, completions, answer, **kwargs):
    """The README's reward file: 1 when the completion states the answer."""
    return [float(a in (c[0]["content"] if isinstance(c, list) else c)) for c, a in zip(completions, answer)]
'''


def test_a_reward_file_alone_is_at_parity_and_counters_are_compared_on_both_sides(tmp_path):
    """Only the user's function (no built-in one, which logs its failures): the scratch loop and TRL both log
    reward_errors (0), and nothing one side alone logs makes a divergence."""
    from harness.diagnose.matrix import run_matrix
    from harness.runlog.log import read_run

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "functions.py").write_text(EXACT)
    spec = load_spec(write_spec(tmp_path, ["rewards/functions.py:exact"]))
    doc = run_matrix(spec, tmp_path / "out", "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity", (cell.get("first_divergence"), cell.get("error"))
    for side in ("scratch", "trl"):
        assert read_run(tmp_path / "out" / "as-given" / side)["reward_errors"].tolist() == [0.0] * 3, side
    assert "reward_errors" in cell["metrics"]


def test_module_entry(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(write_spec(tmp_path, ["myrewards.scoring:short_and_right"]))
    assert reward_functions(spec)[0].__name__ == "short_and_right"
    assert main(["validate", "--spec", str(tmp_path / "spec.toml")]) == 0


BROKEN = {
    "wrong name": ("def other(completions, **kw):\n    return [0.0] * len(completions)\n", "has no 'mine'"),
    "import error": ("import no_such_module_here\n\ndef mine(completions, **kw):\n    return []\n",
                     "importing"),
    "raises": ("def mine(completions, **kw):\n    return [1 / 0 for _ in completions]\n", "raised ZeroDivisionError"),
    "wrong length": ("def mine(completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
    "wrong type": ("def mine(completions, **kw):\n    return ['high' for _ in completions]\n", "returned str 'high'"),
    "not a list": ("def mine(completions, **kw):\n    return 1.0\n", "returned float, not a list"),
    "positional only": ("def mine(completions):\n    return [1.0 for _ in completions]\n", "accept **kwargs"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validate_refuses_a_broken_reward_with_one_line(tmp_path, capsys, case):
    body, words = BROKEN[case]
    (tmp_path / "bad.py").write_text(textwrap.dedent(body))
    spec = write_spec(tmp_path, ["bad.py:mine"])
    assert main(["validate", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.py:mine" in err and words in err, err


def test_spec_refuses_a_missing_file_or_a_malformed_entry(tmp_path):
    with pytest.raises(SpecError, match=r"rewards.functions\[0\].*no file .*nowhere.py"):
        load_spec(write_spec(tmp_path, ["nowhere.py:mine"]))
    with pytest.raises(SpecError, match=r"rewards.functions\[0\].*unknown reward .correctnes.: use a built-in name"):
        load_spec(write_spec(tmp_path, ["correctnes"]))
