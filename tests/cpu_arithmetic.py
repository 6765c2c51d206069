"""One CPU arithmetic for the tests on every x86-64 machine: AVX2 code paths in torch's own kernels (ATen), in MKL
(its conditional numerical reproducibility mode) and in oneDNN, whatever wider instructions the machine has.

The golden verdicts (tests/golden_verdicts.py) and the tests that read an explanation's exact words hold float
results to the last bit: on a machine whose kernels sum in another order (AVX-512 where AVX2 was recorded, or MKL's
Intel and AMD branches) the noise envelopes move by tens of percent and a setting at the edge of the tolerance can be
kept or said as untold. Measured 2026-12-07: the goldens recorded on one machine differed on an AMD EPYC (AVX2) in
every float, and three public-loop tables gained an `adam_beta2` there. Set before torch runs its first kernel
(conftest imports this first; subprocesses inherit it); a value already in the environment is kept; nothing is set
on a CPU without AVX2 (an AVX2 request there would stop the process)."""

from __future__ import annotations

import os

PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def has_avx2(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            return any(line.startswith("flags") and " avx2" in f" {line.split(':', 1)[-1]}" for line in f)
    except OSError:
        return False


def pin() -> dict:
    """Set PINS (where unset) on an AVX2 machine; the variables now in force."""
    if has_avx2():
        for key, value in PINS.items():
            os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in PINS if k in os.environ}
