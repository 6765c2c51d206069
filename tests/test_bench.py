"""The benchmark: its floor arithmetic by hand, and one real (tiny, CPU) run of both loops."""

import json

import pytest

from conftest import DEFAULT_SPEC, ROOT, small_spec
from harness.bench import format_bench, run_bench, step_floor


def test_step_floor_by_hand():
    facts = {"matmul_parameters": 1000, "parameters": 1200, "kv_values_per_token": 10}
    loop = {"sequences": 4, "prompt_tokens": 40, "completion_tokens": 80, "max_completion_length": 20}
    f = step_floor(facts, loop, rate=1e6, bandwidth=1e5, dtype_bytes=2, recompute=True)
    # prefill: 2 * 1000 * 40 / 1e6 = 0.08 s
    # decode: 20 steps x (1200 x 2 weight bytes + 4 rows x (10 + 10) avg context x 20 KV bytes) = 20 x 4000 = 80000 B
    #         -> 0.8 s at 1e5 B/s, against 2 * 1000 * 80 / 1e6 = 0.16 s of FLOPs: memory wins
    # training: 8 (recompute) x 1000 x 120 / 1e6 = 0.96 s
    assert f["decode_bytes"] == pytest.approx(80_000)
    assert f["generation_s"] == pytest.approx(0.08 + 0.8)
    assert f["training_s"] == pytest.approx(0.96)
    assert f["floor_s"] == pytest.approx(1.84)
    assert step_floor(facts, loop, 1e6, 1e5, 2, recompute=False)["training_s"] == pytest.approx(0.72)


def test_bench_runs_both_loops_and_reports(tmp_path):
    spec = small_spec("STEPS=3")
    logs = []
    r = run_bench(spec, tmp_path, log=logs.append, progress=False)
    assert [p.name for p in sorted(tmp_path.glob("?-*"))] == ["1-scratch", "2-trl", "3-scratch"]
    s, t = r["loops"]["scratch"], r["loops"]["trl"]
    assert s["steps"] == 4 and t["steps"] == 2  # steps 2..3 of each run; scratch ran twice
    assert r["ratio"] == pytest.approx(s["step_s"] / t["step_s"])
    for f in (s, t):
        assert 0 < f["gen_s"] < f["step_s"] and f["floor_s"] > 0 and f["peak_gib"] > 0 and 0 < f["mfu"] < 1
        assert f["completion_tokens"] > 0 and f["x_floor"] == pytest.approx(f["step_s"] / f["floor_s"])
    assert set(r["targets"]) == {"scratch/trl step time <= 0.5", "peak memory <= 22 GiB (each loop)",
                                 "harness overhead <= 2% (each loop)"}
    assert json.loads((tmp_path / "bench.json").read_text())["ratio"] == r["ratio"]
    table = format_bench(r)
    assert "| scratch (transformers generate) |" in table and "| trl (transformers generate) |" in table
    assert any("matmul" in line for line in logs)


def test_bench_needs_two_steps_and_a_gpu_spec_says_so_on_cpu(tmp_path, capsys):
    import torch

    from harness.cli import main

    assert main(["bench", "--spec", str(DEFAULT_SPEC), "--steps", "1", "--out", str(tmp_path)]) == 2
    assert "steps 2..N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--spec", str(ROOT / "harness" / "specs" / "bench.toml"), "--out", str(tmp_path)]) == 2
        assert "no GPU" in capsys.readouterr().err
