"""The tests' one CPU arithmetic (tests/cpu_arithmetic.py): AVX2 code paths on every x86-64 machine that has AVX2."""

from __future__ import annotations

import pytest
from cpu_arithmetic import PINS, has_avx2


def test_the_avx2_flag_is_read_from_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nbugs\t\t: avx2_fake\n")
    assert has_avx2(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx512f\nbugs\t\t: avx2\n")  # avx512f is not avx2
    assert not has_avx2(str(info))
    assert not has_avx2(str(tmp_path / "absent"))


@pytest.mark.skipif(not has_avx2(), reason="no AVX2 on this CPU: nothing is pinned")
def test_torch_runs_its_avx2_kernels_here():
    """The pins are in force in this very process (conftest set them before torch ran a kernel): torch's dispatch
    says AVX2 on an AVX-512 machine too, and the variables reach the subprocesses (your loops, the CLI)."""
    import os

    import torch

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert all(os.environ.get(k) for k in PINS)
