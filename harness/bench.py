"""`python -m harness bench`: both loops on one device in one process, against the physical floor.

Order: scratch, TRL, scratch again. The second scratch run brackets TRL's, so a drift of the machine
(clocks, other tenants, the allocator) shows as a difference between the two scratch runs; the scratch
figures pool both. Per loop, over steps 2..N (step 1 holds compilation, allocator growth and caches):
median step time, generation time, harness bookkeeping time, generation and training tokens/s, peak
memory, and model FLOP utilisation against a bf16 (fp32 on CPU) matmul rate measured in the same run.

The floor is what the step would cost at that matmul rate and the measured copy bandwidth:
- generation: per decode step, the larger of its matmul FLOPs (2 N per row) and the bytes it must read
  (the weights once, in the compute dtype, plus every row's KV cache so far); plus the prefill FLOPs;
- training: 6 N per token (forward + backward), plus 2 N per token when activations are recomputed.
N counts the parameters that take part in matmuls (the embedding table only as the output layer).
Attention's own FLOPs (quadratic in length) are left out: at 512 tokens they are ~5% of a 0.6B step.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch

from harness.runlog.atomic import atomic_write_text

TARGETS = {"ratio": 0.5, "peak_gib": 22.0, "harness_pct": 2.0}
GIB = 2**30


# ---------------------------------------------------------------------------------------------
# the machine: matmul rate and memory bandwidth, measured
# ---------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, dtype: str) -> float:
    """Dense matmul FLOP/s in `dtype` on `device` (bf16 8192^3 on a GPU; a smaller fp32 one on CPU)."""
    n, reps = (8192, 20) if device.startswith("cuda") else (1024, 5)
    dt = getattr(torch, dtype) if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def copy_bandwidth(device: str) -> float:
    """Bytes per second moved by a large device-to-device copy (read + write)."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 24)  # 1 GiB / 64 MiB of float32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * src.element_size() * reps / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# the model: what a token costs
# ---------------------------------------------------------------------------------------------
def model_facts(ckpt) -> dict:
    """Parameter counts and per-token KV bytes from the checkpoint's config (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"parameters": total, "matmul_parameters": total if tied else total - embed,
            "layers": config.num_hidden_layers, "kv_values_per_token": 2 * config.num_hidden_layers *
            config.num_key_value_heads * head_dim, "vocab_size": config.vocab_size}


def step_floor(facts: dict, loop: dict, rate: float, bandwidth: float, dtype_bytes: int, recompute: bool) -> dict:
    """The physical floor of one step with this loop's token counts (see the module docstring)."""
    n = facts["matmul_parameters"]
    rows, prompt, completion = loop["sequences"], loop["prompt_tokens"], loop["completion_tokens"]
    decode_steps = loop["max_completion_length"]
    prefill_s = 2 * n * prompt / rate
    kv_per_token = facts["kv_values_per_token"] * dtype_bytes
    avg_context = prompt / rows + decode_steps / 2  # tokens a row attends to, on average over decode steps
    decode_bytes = decode_steps * (facts["parameters"] * dtype_bytes + rows * avg_context * kv_per_token)
    decode_s = max(2 * n * completion / rate, decode_bytes / bandwidth)
    train_tokens = prompt + completion
    train_s = (8 if recompute else 6) * n * train_tokens / rate
    return {"generation_s": prefill_s + decode_s, "training_s": train_s, "floor_s": prefill_s + decode_s + train_s,
            "decode_bytes": decode_bytes, "flops": 2 * n * train_tokens + (8 if recompute else 6) * n * train_tokens}


# ---------------------------------------------------------------------------------------------
# one loop's figures from its metric log
# ---------------------------------------------------------------------------------------------
def loop_figures(run_dirs: list[Path], facts: dict, rate: float, bandwidth: float, dtype_bytes: int,
                 recompute: bool) -> dict:
    """Medians over steps 2..N of each run (pooled), and the floor at this loop's token counts."""
    from harness.runlog.log import read_run

    per_run = [read_run(d).reset_index(drop=True).to_dict("records")[1:] for d in run_dirs]  # step 1 is warm-up
    rows = [r for run in per_run for r in run]
    if not rows:
        raise ValueError("the benchmark needs at least 2 steps per run (step 1 is warm-up)")
    med = lambda key: statistics.median(float(r.get(key) or 0.0) for r in rows)  # noqa: E731
    step_s, gen_s, harness_s = med("wall_s"), med("gen_s"), med("harness_s")
    seqs = med("sequences_in_step")
    completion = med("completions/mean_length") * seqs
    tokens = med("tokens_in_step")
    loop = {"sequences": seqs, "prompt_tokens": tokens - completion, "completion_tokens": completion,
            "max_completion_length": max(float(r.get("completions/max_length") or 0) for r in rows)}
    floor = step_floor(facts, loop, rate, bandwidth, dtype_bytes, recompute)
    model_flops = 8 * facts["matmul_parameters"] * tokens  # 2N generation + 6N training per token
    return {
        "steps": len(rows), "step_s": step_s, "gen_s": gen_s, "train_s": step_s - gen_s, "harness_s": harness_s,
        "harness_pct": 100 * harness_s / step_s if step_s else 0.0,
        "gen_tokens_per_s": completion / gen_s if gen_s else None,
        "train_tokens_per_s": tokens / (step_s - gen_s) if step_s > gen_s else None,
        "peak_gib": max(float(r.get("peak_mem_bytes") or 0) for r in rows) / GIB,
        "mfu": model_flops / (step_s * rate) if step_s else 0.0,
        "step_s_per_run": [statistics.median(float(r["wall_s"]) for r in run) for run in per_run],
        **loop, **floor, "x_floor": step_s / floor["floor_s"] if floor["floor_s"] else None,
    }


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------
def _free(device: str) -> float:
    """Drop what the previous run left behind; return the memory still allocated (GiB)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / GIB
    return 0.0


def run_bench(spec, out_dir, log=print, progress: bool = True) -> dict:
    from harness.experiment.models import checkpoint_dir, resolve_device, run_label
    from harness.runlog.log import device_description, library_versions
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    if spec.STEPS < 2:
        raise ValueError("STEPS: the benchmark takes medians over steps 2..N (step 1 is warm-up); use at least 2, better 5")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(spec)
    ckpt = checkpoint_dir(spec)
    facts = model_facts(ckpt)
    rate = matmul_rate(device, spec.DTYPE)
    bandwidth = copy_bandwidth(device)
    mm_dtype = spec.DTYPE if device != "cpu" else "float32"
    log(f"device {device_description(device)}: matmul {rate / 1e12:.1f} TFLOP/s ({mm_dtype}), "
        f"copy {bandwidth / 1e9:.0f} GB/s; model {facts['parameters'] / 1e6:.1f}M parameters")
    runs = {"scratch": [], "trl": []}
    resident = {}
    t_all = time.perf_counter()
    for i, side in enumerate(("scratch", "trl", "scratch")):
        resident[f"{side}{i}"] = _free(device)
        run_dir = out / f"{i + 1}-{side}"
        t0 = time.perf_counter()
        log(f"[{i + 1}/3] {side}: {spec.STEPS} steps")
        (train_scratch if side == "scratch" else train_trl)(spec, run_dir, progress=progress)
        log(f"[{i + 1}/3] {side}: done in {time.perf_counter() - t0:.0f} s")
        runs[side].append(run_dir)
    _free(device)
    dtype_bytes = 2 if spec.DTYPE == "bfloat16" else 4
    figures = {side: loop_figures(dirs, facts, rate, bandwidth, dtype_bytes, spec.GRADIENT_CHECKPOINTING)
               for side, dirs in runs.items()}
    s, t = figures["scratch"], figures["trl"]
    result = {
        "spec": spec.NAME, "device": device_description(device), "versions": library_versions(),
        "ran": run_label(spec, device_description(device), ckpt),
        "date": time.strftime("%Y-%m-%d"), "dtype": spec.DTYPE, "steps_per_run": spec.STEPS,
        "matmul_tflops": rate / 1e12, "copy_gb_s": bandwidth / 1e9, "model": facts,
        "generation": {"scratch": _manifest(runs["scratch"][0]).get("generation", ""), "trl": "transformers generate"},
        "loops": figures, "ratio": s["step_s"] / t["step_s"], "resident_gib_at_start": resident,
        "wall_s": time.perf_counter() - t_all,
    }
    result["targets"] = {
        "scratch/trl step time <= 0.5": result["ratio"] <= TARGETS["ratio"],
        "peak memory <= 22 GiB (each loop)": max(s["peak_gib"], t["peak_gib"]) <= TARGETS["peak_gib"],
        "harness overhead <= 2% (each loop)": max(s["harness_pct"], t["harness_pct"]) <= TARGETS["harness_pct"],
    }
    atomic_write_text(out / "bench.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "bench.md", format_bench(result) + "\n")
    return result


def _manifest(run_dir: Path) -> dict:
    from harness.runlog.log import MANIFEST_FILE

    return json.loads((Path(run_dir) / MANIFEST_FILE).read_text())


def format_bench(r: dict) -> str:
    """A markdown table a person reads, then the targets."""
    cols = [("step s", "step_s", "{:.2f}"), ("generation s", "gen_s", "{:.2f}"), ("training s", "train_s", "{:.2f}"),
            ("gen tok/s", "gen_tokens_per_s", "{:,.0f}"), ("train tok/s", "train_tokens_per_s", "{:,.0f}"),
            ("peak GiB", "peak_gib", "{:.1f}"), ("MFU", "mfu", "{:.1%}"), ("harness", "harness_pct", "{:.2f}%"),
            ("floor s", "floor_s", "{:.2f}"), ("x floor", "x_floor", "{:.1f}")]
    ran = (r.get("ran") or {}).get("text") or f"{r['dtype']} on {r['device']}"
    lines = [f"{r['spec']}: {ran}; {r['date']}; {r['versions']}",
             f"matmul rate {r['matmul_tflops']:.1f} TFLOP/s, copy bandwidth {r['copy_gb_s']:.0f} GB/s, "
             f"model {r['model']['parameters'] / 1e6:.1f}M parameters; medians over steps 2..{r['steps_per_run']}",
             "", "| loop | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for side in ("scratch", "trl"):
        f = r["loops"][side]
        cells = [(fmt.format(f[key]) if f.get(key) is not None else "-") for _, key, fmt in cols]
        lines.append(f"| {side} ({r['generation'][side]}) | " + " | ".join(cells) + " |")
    s = r["loops"]["scratch"]
    lines += ["", f"scratch / TRL step time: {r['ratio']:.3f}  (scratch runs before and after TRL: "
              f"{' / '.join(f'{x:.2f}' for x in s['step_s_per_run'])} s)",
              f"tokens per step: {s['prompt_tokens']:.0f} prompt + {s['completion_tokens']:.0f} completion "
              f"({s['sequences']:.0f} sequences, up to {s['max_completion_length']:.0f} new tokens)"]
    lines += [f"{'met' if ok else 'NOT met'}: {name}" for name, ok in r["targets"].items()]
    return "\n".join(lines)
