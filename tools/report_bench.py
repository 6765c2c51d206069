"""What writing a parity report costs, in parts: re-renders an existing run folder's report.html N times.

    python tools/report_bench.py RUN_DIR [-n 5] [--render reports/render.py] [--cold]

RUN_DIR is a finished `harness parity` run (it holds verdict.json); its report.html is written again each time.
`--render FILE` times another copy of the renderer (a render.py with its templates/ folder beside it, best a whole
reports/ folder: `git archive HEAD reports | tar -x -C /tmp/reports_head`), e.g. the one before a change, so that
before and after are measured by the same tool on the same run. The first render is
shown on its own: it pays for the renderer's own imports (matplotlib before the SVG figures) as the CLI's render
does. What the CLI has imported by then (torch, TRL, transformers: it ran the preflight and the matrix) is imported
first, untimed, by running the preflight once; `--cold` times a render in a bare process instead (+2-3 s on a
2-core machine).

Parts, each summed over a render: figures (the functions whose name ends in `_figure`), reading the runs
(metric logs and the weight distances), the template (jinja2), and the rest (verdicts, completions, the preflight).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_renderer(path: Path):
    """The module at `path`. A render.py in a reports/ folder is imported as that folder's reports.render, so that
    what it imports from its own package (reports.svg) is the copy's too."""
    if path.parent.name == "reports":
        sys.path.insert(0, str(path.parent.parent))
        for name in [n for n in sys.modules if n == "reports" or n.startswith("reports.")]:
            del sys.modules[name]
        module = importlib.import_module("reports.render")
        assert Path(module.__file__).resolve() == path, (module.__file__, path)
        return module
    spec = importlib.util.spec_from_file_location(f"bench_render_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(parts: dict, part: str, fn):
    """`fn`, adding the seconds each call takes to parts[part]."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[part] += time.perf_counter() - t0

    return wrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("-n", type=int, default=5, help="renders (the first is reported apart)")
    p.add_argument("--render", type=Path, default=ROOT / "reports" / "render.py", help="the renderer to time")
    p.add_argument("--cold", action="store_true", help="do not import what a parity run has imported beforehand")
    args = p.parse_args()
    if not (args.run_dir / "verdict.json").exists():
        raise SystemExit(f"{args.run_dir}: no verdict.json (not a parity run folder)")
    if not args.cold:  # `harness parity` ran the preflight (torch, TRL, transformers) before it writes the report
        from harness.diagnose.preflight import preflight
        from harness.experiment.spec import load_spec

        preflight(load_spec(ROOT / "harness" / "specs" / "default.toml"))

    import jinja2

    import harness.runlog.params

    t0 = time.perf_counter()
    render = load_renderer(args.render.resolve())
    import_s = time.perf_counter() - t0

    parts = {"figures": 0.0, "reading runs": 0.0, "template": 0.0}
    for name in [n for n in dir(render) if n.endswith("_figure")]:
        setattr(render, name, timed(parts, "figures", getattr(render, name)))
    render._read = timed(parts, "reading runs", render._read)
    harness.runlog.params.relative_l2 = timed(parts, "reading runs", harness.runlog.params.relative_l2)
    jinja2.Template.render = timed(parts, "template", jinja2.Template.render)

    rows = []
    for _ in range(max(args.n, 1)):
        for k in parts:
            parts[k] = 0.0
        t0 = time.perf_counter()
        path = render.write_parity_report(args.run_dir)
        total = time.perf_counter() - t0
        rows.append({"total": total, **parts, "rest": total - sum(parts.values())})

    size = path.stat().st_size
    print(f"renderer {args.render}  (module import {import_s:.2f} s)")
    print(f"report   {path}  ({size / 1e3:.0f} kB)")
    names = list(rows[0])
    print(f"{'':24s}" + "".join(f"{n:>14s}" for n in names))
    print(f"{'first render':24s}" + "".join(f"{rows[0][n]:13.3f}s" for n in names))
    if len(rows) > 1:
        print(f"{f'median of the next {len(rows) - 1}':24s}"
              + "".join(f"{statistics.median(r[n] for r in rows[1:]):13.3f}s" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
