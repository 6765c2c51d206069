"""Decode speed of the scratch loop's samplers on one GPU: transformers' generate against the static-cache
decoder (eager / CUDA graph, with and without grouped-query packing, with and without torch.compile of the
decode step), at the benchmark spec's shape.

    python tools/decode_bench.py [--spec harness/specs/bench.toml] [--tokens 128] [--batch 64] [--long 512]

Prints ms per decode step for each variant, whether graph capture held, and the cost of the sampling rule
alone. Random weights never say eos, so every row decodes --tokens steps."""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="harness/specs/bench.toml")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--long", type=int, default=0, help="also time the default decoder at this many tokens")
    args = ap.parse_args()
    from harness.experiment.data import load_rows, to_prompt_rows
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer
    from harness.experiment.spec import load_spec
    from harness.rollouts.fastgen import StaticDecoder, sample_next
    from harness.experiment.data import encode_prompts
    from harness.rollouts.generate import generate_completions

    spec = load_spec(args.spec)
    ckpt = checkpoint_dir(spec)
    tok, model = load_tokenizer(ckpt), load_model(ckpt, "float32", "cuda")
    eos = eos_token_ids(model.generation_config, tok)
    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    prompts = encode_prompts(tok, [r["prompt"] for r in rows[: args.batch]])
    prompts = (prompts * args.batch)[: args.batch]

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch}, {args.tokens} tokens")
    dt, out = timed(lambda: generate_completions(model, prompts, eos_ids=eos, pad_id=tok.pad_token_id,
                                                 max_tokens=args.tokens, temperature=1.0, top_p=1.0, top_k=0,
                                                 device="cuda", dtype="bfloat16"))
    n = max(len(c) for c in out)
    print(f"{'transformers generate (autocast)':44s} {1000 * dt / n:7.2f} ms/step  ({n} steps, {dt:.2f} s)")
    variants = [(False, True, False), (True, False, False), (True, True, False), (True, True, True)]
    for graphs, pack, compiled in variants:
        dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="bfloat16", graphs=graphs,
                            pack_gqa=pack, compile_step=compiled)
        gen = lambda: dec.generate(prompts, max_tokens=args.tokens, temperature=1.0)  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, _ = timed(gen)  # first call: allocator, kernels, compilation
            dt, (out, _) = timed(gen)
        for w in caught:
            if "graph" in str(w.message) or "compile" in str(w.message):
                print("   warning:", str(w.message)[:300])
        n = max(len(c) for c in out)
        name = f"static, {'graph' if graphs else 'eager'}{', packed GQA' if pack else ''}" \
               f"{', compiled' if compiled else ''} -> {dec.describe()}"
        print(f"{name:44s} {1000 * dt / n:7.2f} ms/step  ({n} steps, {dt:.2f} s; first call {first:.1f} s)")
    if args.long:
        dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="bfloat16")
        timed(lambda: dec.generate(prompts, max_tokens=args.long, temperature=1.0))
        dt, (out, _) = timed(lambda: dec.generate(prompts, max_tokens=args.long, temperature=1.0))
        n = max(len(c) for c in out)
        print(f"{'default decoder, ' + str(args.long) + ' tokens':44s} {1000 * dt / n:7.2f} ms/step  "
              f"({n} steps, {dt:.2f} s for the batch: {dec.describe()})")
    profile(model, prompts, eos, tok.pad_token_id)
    profile(model, prompts, eos, tok.pad_token_id, compiled=True)
    logits = torch.randn(args.batch, model.config.vocab_size, device="cuda", dtype=torch.bfloat16)
    dt, _ = timed(lambda: [sample_next(logits, 1.0) for _ in range(100)])
    print(f"{'sample_next alone':44s} {10 * dt:7.2f} ms/step")


def profile(model, prompts, eos, pad_id, steps: int = 16, compiled: bool = False) -> None:
    """Kernels per decode step and GPU busy time, from the CUDA profiler over an eager packed decode (with
    `compiled`, the compiled forward outside a CUDA graph: the kernels the graph replays)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from harness.rollouts.fastgen import StaticDecoder

    dec = StaticDecoder(model, eos_ids=eos, pad_id=pad_id, dtype="bfloat16", graphs=False, compile_step=compiled)
    dec.generate(prompts, max_tokens=steps, temperature=1.0)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.generate(prompts, max_tokens=steps, temperature=1.0)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    count = sum(e.count for e in events)
    busy_us = sum(e.self_device_time_total for e in events)
    kind = "compiled" if compiled else "eager"
    print(f"profile ({kind}, packed, {steps} steps incl. prefill): {count / steps:.0f} kernels per step, "
          f"GPU busy {busy_us / steps / 1000:.2f} ms per step, {busy_us / max(count, 1):.1f} us per kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"   {e.self_device_time_total / steps / 1000:6.3f} ms/step  {e.count / steps:5.0f}/step  {e.key[:90]}")


if __name__ == "__main__":
    main()
