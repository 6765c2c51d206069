"""Golden verdicts: what the diagnosis says, recorded before a change to its code and compared after (issue 46).

Each case is one parity run on CPU (the embedded default): the default matrix, the lesson's three mistakes, the
public loops of tests/test_public_loops.py, examples/my_grpo.py with some of its switches, and the several-causes
cases of tests/test_several_causes.py. What is kept of each run is what a user reads: `verdict.json`, the summary
text (`format_verdict`), and `your_loop_in_trl.toml` where there is one, with what changes from run to run taken
out (timings, folders, versions) and nothing else.

    python tests/golden_verdicts.py record [CASE ...]   # write tests/golden/verdicts/<case>.json
    python tests/golden_verdicts.py check [CASE ...]    # run and compare, printing the first differences

tests/test_golden_verdicts.py runs `check` on every case.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = ROOT / "tests" / "golden" / "verdicts"
DEFAULT_SPEC = ROOT / "harness" / "specs" / "default.toml"
PUBLIC = ROOT / "examples" / "public"
MY_GRPO = ROOT / "examples" / "my_grpo.py"


def _loop(script: Path, *flags: str) -> str:
    return json.dumps(f"{sys.executable} {script}" + "".join(f" {f}" for f in flags))


def _public(name: str, *flags: str, tensor_steps: int | None = 6) -> dict:
    sets = [f"loop.command={_loop(PUBLIC / name, *flags)}", "STEPS=12"]
    return {"spec": DEFAULT_SPEC, "set": sets + ([f"loop.tensor_steps={tensor_steps}"] if tensor_steps else []),
            "matrix": "none"}


# examples/my_grpo.py with six differences of its own (docs/benchmarks.md's explain_bench case)
SIX = "--std-eps 0.0037 --std population --lr 0.0021 --adam-beta2 0.995 --max-grad-norm 0 --loss-divisor 57.3"

# name -> {spec, set (KEY=VALUE overrides), matrix}: the runs whose verdicts must not change
CASES: dict[str, dict] = {
    "default-matrix": {"spec": DEFAULT_SPEC, "set": [], "matrix": "default"},
    "lesson-mistakes": {"spec": ROOT / "harness" / "specs" / "lesson-mistakes.toml", "set": [], "matrix": "none"},
    "public-verl": _public("verl_grpo.py", tensor_steps=None),
    "public-openrlhf": _public("openrlhf_grpo.py"),
    "public-nemorl": _public("nemorl_grpo.py"),
    "public-nemorl-is": {**_public("nemorl_grpo.py", "--is-correction"),
                         "set": _public("nemorl_grpo.py", "--is-correction")["set"] + [
                             'sampler.kind="emulated"', "sampler.noise_scale=0.02", "IS_CORRECTION=true"]},
    "public-openinstruct": _public("openinstruct_grpo.py"),
    "public-raschka": _public("raschka_grpo.py"),
    "mine-as-trl": {"spec": DEFAULT_SPEC, "set": [f"loop.command={_loop(MY_GRPO)}", "STEPS=12"], "matrix": "none"},
    "mine-six-differences": {"spec": DEFAULT_SPEC, "set": [f"loop.command={_loop(MY_GRPO, SIX)}", "STEPS=12"],
                             "matrix": "none"},
    "mine-skip-flat-groups": {"spec": DEFAULT_SPEC, "set": [f"loop.command={_loop(MY_GRPO, '--skip-flat-groups')}",
                                                            "STEPS=12"], "matrix": "none"},
    "mine-is-off": {"spec": DEFAULT_SPEC, "set": [f"loop.command={_loop(MY_GRPO, '--is-correction off')}",
                                                  "STEPS=12", 'sampler.kind="emulated"', "sampler.noise_scale=0.02",
                                                  "IS_CORRECTION=true"], "matrix": "none"},
    # bf16 (as on a GPU): a parity that float32 checks and a toggle under bf16's rounding, each on to float32
    "mine-bf16-beta2": {"spec": DEFAULT_SPEC, "set": [f"loop.command={_loop(MY_GRPO, '--adam-beta2 0.9')}", "STEPS=6",
                                                      'DTYPE="bfloat16"'], "matrix": "none"},
    "bf16-beta2-toggle": {"spec": DEFAULT_SPEC, "set": ["STEPS=6", 'DTYPE="bfloat16"', "trl.adam_beta2=0.9"],
                          "matrix": "none"},
    "causes-two": {"spec": DEFAULT_SPEC, "set": ["STEPS=4", 'trl.loss_type="dapo"', 'trl.scale_rewards="none"'],
                   "matrix": "none"},
    "causes-four": {"spec": DEFAULT_SPEC, "set": ["STEPS=4", 'BATCH_MAPPING="naive"', 'trl.loss_type="dapo"',
                                                  "trl.adam_beta2=0.9", "trl.top_k=5"], "matrix": "none"},
}

# keys whose values change from run to run of the same code: wall-clock times, and the library versions
_VOLATILE = re.compile(r"(^|_)(s|wall_s|elapsed_s|search_s|seconds|time|wall|eta)$|^versions$|_s$")


def _strip(value, out: str):
    """`value` with timings and versions dropped, and the run's folder, the model cache and the interpreter written
    as placeholders."""
    if isinstance(value, dict):
        return {k: _strip(v, out) for k, v in value.items() if not _VOLATILE.search(k)}
    if isinstance(value, list):
        return [_strip(v, out) for v in value]
    if isinstance(value, str):
        from harness.experiment.embedded import cache_root

        value = value.replace(out, "<OUT>").replace(str(cache_root()), "<CACHE>").replace(sys.executable, "<PY>")
        value = value.replace(str(ROOT), "<ROOT>")
        # a shared scratch run's key hashes the reward file's absolute path: another checkout, another key
        value = re.sub(r"(re-run of this matrix) \([0-9a-f]{20}\)", r"\1 (<KEY>)", value)
        return re.sub(r"\b\d+(\.\d+)? s\b", "<T> s", value)  # durations in prose ("35 runs, 2.6 s of search")
    return value


# Every case runs in this one folder, whoever runs it: a folder's path is in the verdict's words (wrapped across
# lines, where no placeholder can replace it) and in the names of the search's run folders (hashed).
RUN_DIR = Path(tempfile.gettempdir()) / "grpo-golden-verdicts"


def _unwrapped(text: str) -> str:
    """The summary as one line of words: where a wrapped line breaks depends on the durations in it (a run of 10 s
    is a character longer than one of 9 s), which the comparison leaves out. A break at a hyphen (textwrap breaks
    long words there) is joined back."""
    return " ".join(re.sub(r"(?<=\S-)[ \t]*\n\s*", "", text).split())


def run_case(name: str) -> dict:
    """Run one case in its folder (emptied first) and return what is kept of it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from harness.diagnose.matrix import run_matrix
    from harness.diagnose.verdict import format_verdict
    from harness.experiment.spec import load_spec

    case = CASES[name]
    out = RUN_DIR / name
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / ".lock", "w") as lock:  # one run at a time in the shared folder (checks in two checkouts)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_in(case, out, format_verdict, run_matrix, load_spec)


def _run_in(case: dict, out: Path, format_verdict, run_matrix, load_spec) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    try:
        doc = run_matrix(load_spec(case["spec"], list(case["set"])), out, case["matrix"], log=lambda *_: None)
        table = out / "your_loop_in_trl.toml"
        kept = {"verdict": doc, "summary": _unwrapped(format_verdict(doc)),
                "your_loop_in_trl": table.read_text(encoding="utf-8") if table.exists() else None}
        return _strip(json.loads(json.dumps(kept, default=str)), str(out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def differences(want, got, where: str = "", limit: int = 20) -> list[str]:
    """Where `got` differs from `want`, as paths into the document (at most `limit`)."""
    out: list[str] = []

    def walk(a, b, path):
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                if k not in a or k not in b:
                    out.append(f"{path}/{k}: {'only in the golden' if k in a else 'only in this run'}")
                else:
                    walk(a[k], b[k], f"{path}/{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif isinstance(a, str) and isinstance(b, str) and "\n" in a + b:
            for i, (x, y) in enumerate(zip(a.splitlines() + [""] * 999, b.splitlines() + [""] * 999)):
                if x != y:
                    out.append(f"{path} line {i + 1}: golden {x!r}, now {y!r}")
                    break
        elif isinstance(a, str) and isinstance(b, str) and a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"{path} at character {i}: golden ...{a[max(0, i - 80):i + 60]!r}, now ...{b[max(0, i - 80):i + 60]!r}")
        elif a != b or type(a) is not type(b):
            out.append(f"{path}: golden {json.dumps(a)[:200]}, now {json.dumps(b)[:200]}")

    walk(want, got, where)
    return out


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


# the float arithmetic a golden was recorded on (tests/cpu_arithmetic.py fingerprint): its floats hold to the last bit
# only where the same arithmetic runs
ARITHMETIC = "arithmetic"


def golden(name: str) -> dict:
    """What was recorded of a case, without the arithmetic it was recorded on."""
    doc = json.loads(golden_path(name).read_text(encoding="utf-8"))
    doc.pop(ARITHMETIC, None)
    return doc


def recorded_on(name: str) -> str | None:
    """The fingerprint of the arithmetic the case's golden was recorded on (None: recorded before the fingerprint)."""
    return json.loads(golden_path(name).read_text(encoding="utf-8")).get(ARITHMETIC)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    names = argv[1:] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"no case named {', '.join(unknown)}; cases: {', '.join(CASES)}")
        return 2
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    bad = 0
    from cpu_arithmetic import fingerprint

    here = fingerprint()
    compared = 0
    for name in names:
        at = recorded_on(name) if argv[0] == "check" else here
        if at != here:
            print(f"{name}: not compared: recorded on the arithmetic {at}, this machine computes {here} "
                  "(tests/cpu_arithmetic.py)")
            continue
        got = run_case(name)
        if argv[0] == "record":
            golden_path(name).write_text(json.dumps({**got, ARITHMETIC: here}, indent=1, sort_keys=True) + "\n",
                                         encoding="utf-8")
            print(f"recorded {name}: {got['verdict']['cells'][0].get('verdict')}")
        else:
            diff = differences(golden(name), got)
            bad += bool(diff)
            print(f"{name}: " + ("same" if not diff else "DIFFERS\n  " + "\n  ".join(diff)))
        compared += 1
    if not compared:
        print("nothing compared: no golden was recorded on this machine's arithmetic")
    return 1 if bad or not compared else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import cpu_arithmetic  # before torch runs a kernel: the arithmetic the goldens were recorded in

    cpu_arithmetic.pin()
    raise SystemExit(main(sys.argv[1:]))
