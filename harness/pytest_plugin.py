"""pytest plugin: metric-tolerance checks on your own runs (registered through the `pytest11` entry point).

In a test:

    from harness.pytest_plugin import assert_metrics_close

    def test_my_loop_matches_trl(load_run):
        assert_metrics_close(load_run("runs/mine"), load_run("runs/trl"), metrics=["loss", "grad_norm"])

From the command line, on two runs written by `python -m harness run` (or a TRL trainer_state.json):

    pytest --parity-runs RUN_A RUN_B [--parity-tolerances my_tolerances.toml]

which runs one check per shared metric (and nothing else), each failing with the metric, the first
step outside tolerance, both values, the tolerance, and the worst step with its difference.
Tolerances are TOML, per mode and dtype, in the format of harness/diagnose/tolerances.toml.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest


class MetricMismatch(AssertionError):
    pass


def _fmt(v) -> str:
    return f"{v:.9g}" if isinstance(v, float) else repr(v)


def assert_metrics_close(run_a, run_b, metrics=None, rtol: float | None = None, atol: float | None = None,
                         steps=None, tolerances: str | Path | dict | None = None, mode: str = "lockstep",
                         dtype: str | None = None) -> None:
    """Assert two runs agree, per metric and step, within |a - b| <= atol + rtol * |b|.

    `run_a`/`run_b`: DataFrames from `harness.diagnose.compare.load_any_run` (or paths). `metrics`: names to check
    (default: every metric both runs log, minus timing). `rtol`/`atol` override the tolerance file for all
    metrics; `steps`: an iterable of steps to check (default: all shared steps). Counts and hashes compare
    exactly.
    """
    from pandas.api.types import is_numeric_dtype

    from harness.diagnose.compare import absent_at, load_any_run, load_tolerances, tolerance_for

    a = load_any_run(run_a) if not hasattr(run_a, "columns") else run_a
    b = load_any_run(run_b) if not hasattr(run_b, "columns") else run_b
    tol = tolerances if isinstance(tolerances, dict) else load_tolerances(tolerances)
    dtype = dtype or (a.attrs.get("manifest", {}).get("spec") or {}).get("DTYPE", "float32")
    ignore = set(tol.get("ignore", {}).get("metrics", [])) | {"step"}
    exact = set(tol.get("exact", {}).get("metrics", []))
    shared = a.index.intersection(b.index)
    if steps is not None:
        shared = shared.intersection(list(steps))
    if len(shared) == 0:
        raise MetricMismatch(f"no shared steps to compare ({len(a)} and {len(b)} steps logged)")
    names = list(metrics) if metrics is not None else sorted((set(a.columns) & set(b.columns)) - ignore)
    problems = []
    for name in names:
        for df, side in ((a, "A"), (b, "B")):
            if name not in df.columns:
                problems.append(f"{name}: not logged by run {side}")
        if any(name not in df.columns for df in (a, b)):
            continue
        x, y = a.loc[shared, name], b.loc[shared, name]
        if not (is_numeric_dtype(x) and is_numeric_dtype(y)):  # hashes and other text: equal or not
            bad = [s for s in shared if str(x[s]) != str(y[s])]
            if bad:
                problems.append(f"{name}: differs at step {bad[0]}: A={x[bad[0]]!r}, B={y[bad[0]]!r} (must be "
                                f"equal; {len(bad)} of {len(shared)} steps differ)")
            continue
        t = dict(tolerance_for(tol, mode, dtype, name))
        if name not in exact:  # counts compare exactly, whatever the overrides
            t.update({k: v for k, v in (("rtol", rtol), ("atol", atol)) if v is not None})
        r, at = t.get("rtol", 0.0), t.get("atol", 0.0)
        xs, ys = x.astype(float), y.astype(float)
        diff = (xs - ys).abs()
        allowed = at + r * ys.abs()
        # a NaN or inf either run computed is outside tolerance (both NaN included); a value neither log has is not
        # compared there
        neither = absent_at(a, name, shared) & absent_at(b, name, shared)
        outside = [s for i, s in enumerate(shared) if not neither[i] and
                   (not (math.isfinite(xs[s]) and math.isfinite(ys[s])) or not diff[s] <= allowed[s])]
        if outside:
            s0 = outside[0]
            worst = diff.idxmax()
            problems.append(
                f"{name}: first outside tolerance at step {s0}: A={_fmt(xs[s0])}, B={_fmt(ys[s0])}, "
                f"|A-B|={_fmt(diff[s0])} > atol {at:g} + rtol {r:g} x |B| = {_fmt(allowed[s0])}; "
                f"worst at step {worst}: |A-B|={_fmt(diff[worst])}; {len(outside)} of {len(shared)} steps outside")
    if problems:
        raise MetricMismatch("metrics differ (" + f"{mode}, {dtype}):\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# the plugin
# ---------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("grpo-parity", "GRPO parity metric checks")
    group.addoption("--parity-runs", nargs=2, metavar=("RUN_A", "RUN_B"), default=None,
                    help="compare two runs' metric logs (harness run folders or TRL trainer_state.json), one check "
                         "per shared metric; other tests are not run")
    group.addoption("--parity-tolerances", metavar="FILE", default=None,
                    help="tolerance TOML (default: harness/diagnose/tolerances.toml)")
    group.addoption("--parity-mode", choices=("lockstep",), default="lockstep",
                    help="which tolerance table to use (lockstep: the runs saw the same rollouts)")


def pytest_configure(config):
    config.addinivalue_line("markers", "parity: a metric check generated by --parity-runs")


@pytest.fixture
def load_run():
    """A loader for run folders, metrics.jsonl files or trainer_state.json: load_run(path) -> DataFrame."""
    from harness.diagnose.compare import load_any_run

    return load_any_run


@pytest.fixture
def parity_runs(request):
    """The two runs given with --parity-runs, loaded (skips when the option is absent)."""
    from harness.diagnose.compare import load_any_run

    paths = request.config.getoption("--parity-runs")
    if not paths:
        pytest.skip("no --parity-runs given")
    return load_any_run(paths[0]), load_any_run(paths[1])


class ParityItem(pytest.Item):
    def __init__(self, *, metric: str, runs, tolerances, mode, only_in: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.metric, self.runs, self.tolerances, self.mode, self.only_in = metric, runs, tolerances, mode, only_in
        self.add_marker("parity")

    def runtest(self):
        if self.only_in:  # listed, not compared: one side not logging a metric is not a difference of values
            pytest.skip(f"{self.metric}: logged by run {self.only_in} only, not compared")
        a, b = self.runs
        assert_metrics_close(a, b, metrics=[self.metric], tolerances=self.tolerances, mode=self.mode)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, MetricMismatch):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"parity[{self.metric}]"


def pytest_collection_modifyitems(session, config, items):
    paths = config.getoption("--parity-runs")
    if not paths:
        return
    from harness.diagnose.compare import load_any_run, load_tolerances

    runs = (load_any_run(paths[0]), load_any_run(paths[1]))
    tol = load_tolerances(config.getoption("--parity-tolerances"))
    ignore = set(tol.get("ignore", {}).get("metrics", [])) | {"step"}
    by_design = tuple(tol.get("ignore", {}).get("one_sided_prefixes", []))
    names = sorted((set(runs[0].columns) | set(runs[1].columns)) - ignore)
    names = [n for n in names if not (n.startswith(by_design) and not all(n in r.columns for r in runs))]
    only = {n: ("A" if n in runs[0].columns else "B") for n in names if not all(n in r.columns for r in runs)}
    config.hook.pytest_deselected(items=list(items))
    items[:] = [ParityItem.from_parent(session, name=f"parity[{n}]", metric=n, runs=runs, tolerances=tol,
                                       mode=config.getoption("--parity-mode"), only_in=only.get(n)) for n in names]
