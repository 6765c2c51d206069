"""Where a process's first scratch step goes (issue 29): `harness run scratch` in this process, then torch's own
account of its compile time by phase (`torch._dynamo.utils.compile_times`: tracing, the inductor and AOTAutograd
caches, loading the generated code) and the whole wall from the interpreter's start.

    python tools/warm_start.py --spec harness/specs/bench.toml --steps 2 --out /tmp/ws1   # cache cold: compiles
    python tools/warm_start.py --spec harness/specs/bench.toml --steps 2 --out /tmp/ws2   # again: loads from it

Run it twice on a GPU: the first process fills the compile cache (GRPO_PARITY_CACHE/inductor), the second reads
it; the difference between the second one's first step and a later step is what no on-disk cache keeps.
`--save-artifacts` (with TORCH_CACHING_PRECOMPILE=1, torch's experimental Dynamo cache) also saves the traced frames
at exit, so that a later process may skip Dynamo's tracing.
"""

from __future__ import annotations

import atexit
import runpy
import sys
import time

START = time.perf_counter()
SAVE_ARTIFACTS = "--save-artifacts" in sys.argv  # torch.compiler.save_cache_artifacts() at exit (torch's experiment)


def _report() -> None:
    if SAVE_ARTIFACTS:  # an experiment: with TORCH_CACHING_PRECOMPILE=1 this writes Dynamo's traced frames too
        try:
            import torch

            got = torch.compiler.save_cache_artifacts()
            print(f"save_cache_artifacts: {'nothing' if got is None else f'{len(got[0]) / 1e6:.1f} MB'}")
        except Exception as e:  # noqa: BLE001 - say what failed
            print(f"save_cache_artifacts failed: {type(e).__name__}: {str(e)[:300]}")
    try:
        from torch._dynamo.utils import compile_times

        print("\ntorch.compile phases (s, this process):")
        print(compile_times(repr="str", aggregate=True))
    except Exception as e:  # noqa: BLE001 - a profile tool: say what failed, keep the run's own exit status
        print(f"no compile times: {type(e).__name__}: {e}")
    print(f"process wall from interpreter start: {time.perf_counter() - START:.1f} s")


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = ["harness", "run", "scratch", *[a for a in sys.argv[1:] if a != "--save-artifacts"]]
    runpy.run_module("harness", run_name="__main__")
