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
    """Whether the CPU's flags (Linux's /proc/cpuinfo) name avx2; False where they cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            return any(line.startswith("flags") and "avx2" in line.split(":", 1)[-1].split() for line in f)
    except OSError:
        return False


def pin() -> dict:
    """Set PINS (where unset) on an AVX2 machine; the variables now in force."""
    if has_avx2():
        for key, value in PINS.items():
            os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in PINS if k in os.environ}


def fingerprint() -> str:
    """The float arithmetic this process computes, in 12 hex digits: seeded matmuls at the embedded model's sizes,
    log_softmax, reductions and a backward, on one thread. Two machines with the same fingerprint give the tests'
    runs the same bits; the golden verdicts keep the one they were recorded with."""
    import hashlib

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        out = []
        for m, k, n in ((37, 64, 512), (200, 64, 4096), (16, 128, 64), (3, 1024, 1024)):
            c = torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)
            out += [c, torch.log_softmax(c, -1), c.sum(-1), (c * c).mean()]
        x = torch.randn(1000, 64, generator=g, requires_grad=True)
        torch.nn.functional.linear(x, torch.randn(96, 64, generator=g)).tanh().sum().backward()
        out.append(x.grad)
        h = hashlib.sha256()
        for t in out:
            h.update(t.detach().numpy().tobytes())
        return h.hexdigest()[:12]
    finally:
        torch.set_num_threads(threads)
