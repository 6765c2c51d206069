"""Where the scratch loop's training pass goes on one GPU: one micro-batch of the benchmark spec (forward with
gradient checkpointing, the loss, backward), timed and profiled, kernels grouped by kind.

    python tools/train_profile.py [--spec harness/specs/bench.toml] [--rows 16] [--tokens 512] [--prompt 40]
                                  [--compile-layers]

Prints, per variant, milliseconds per micro-batch, the model FLOPs it did (8 x parameters x tokens with the
recompute) as a fraction of the measured bf16 matmul rate, then the CUDA profile of the scratch loop's micro-batch
(the eager model) by kind (matmul, attention, elementwise, reduction, copy/cast, other) and its largest kernels;
with --compile-layers, last, the micro-batch with each decoder layer compiled. Random tokens: the arithmetic is
the same as on real completions of that length."""

from __future__ import annotations

import argparse
import re
import time

import torch

KINDS = [("attention", r"flash|fmha|sdpa|attention"), ("matmul", r"gemm|cutlass|xmma|nvjet|cublas"),
         ("reduction", r"reduce|softmax|logsumexp|norm"), ("copy/cast", r"copy|(?<!no)cast|memcpy|memset|fill|cat"),
         ("elementwise", r"elementwise|vectorized|unrolled|triton|pointwise")]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="harness/specs/bench.toml")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no profile)")
    ap.add_argument("--compile-layers", action="store_true", help="also time the pass with compiled decoder layers")
    args = ap.parse_args()
    from harness.bench import matmul_rate, model_facts
    from harness.experiment.models import autocast_for, checkpoint_dir, load_model
    from harness.experiment.spec import load_spec
    from scratch_grpo import core
    from scratch_grpo.train import completion_forward

    spec = load_spec(args.spec)
    ckpt = checkpoint_dir(spec)
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    model = load_model(ckpt, "float32", dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    facts = model_facts(ckpt)
    V = facts["vocab_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    p_ids = torch.randint(0, V, (args.rows, args.prompt), device=dev, generator=g)
    c_ids = torch.randint(0, V, (args.rows, args.tokens), device=dev, generator=g)
    p_mask, c_mask = torch.ones_like(p_ids), torch.ones_like(c_ids)
    c_mask[:, -args.tokens // 4:] = 0  # a quarter of each row is padding, as in a batch of unequal lengths
    adv = torch.randn(args.rows, device=dev, generator=g)
    rate = matmul_rate(dev, "bfloat16")

    def micro_batch(with_entropy: bool = True):
        with autocast_for(dev, "bfloat16"):
            logp, _ = completion_forward(model, p_ids, p_mask, c_ids, c_mask, 1.0, 1.0 if with_entropy else None)
        per_token, _ = core.clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.28)
        loss = core.aggregate_loss(per_token, c_mask.float(), "sequence", 4, args.tokens, 0.0)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def forward_only():
        with torch.no_grad(), autocast_for(dev, "bfloat16"):
            completion_forward(model, p_ids, p_mask, c_ids, c_mask, 1.0)

    def timed(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    tokens = args.rows * (args.prompt + args.tokens)
    n = facts["matmul_parameters"]
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}; micro-batch {args.rows} x "
          f"({args.prompt} + {args.tokens}) tokens, bf16 autocast over fp32 weights, gradient checkpointing; "
          f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s")
    logits = torch.randn(args.rows, args.tokens, V, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)

    def loss_alone():  # the loss's own work on one micro-batch's logits: log-probs, entropy, backward to the logits
        logp, _ = core.token_logprobs_and_entropy(logits, c_ids, 1.0)
        (logp * c_mask).sum().backward()
        logits.grad = None

    def loss_alone_eager():  # the same with the chunk functions uncompiled
        compiled, core.KERNELS.devices = core.KERNELS.devices, ()
        try:
            loss_alone()
        finally:
            core.KERNELS.devices = compiled

    variants = [("scratch micro-batch (loss + entropy + backward)", micro_batch, 8 * n * tokens),
                ("  the same without the entropy", lambda: micro_batch(False), 8 * n * tokens),
                ("  forward only (no grad: old/ref log-probs)", forward_only, 2 * n * tokens),
                ("  the loss alone on given bf16 logits", loss_alone, 0),
                ("  the same, chunk functions not compiled", loss_alone_eager, 0)]
    for name, fn, flops in variants:
        dt = timed(fn)
        rates = f"{flops / dt / 1e12:6.1f} TFLOP/s  {flops / dt / rate:6.1%} of matmul" if flops else ""
        print(f"{name:52s} {1000 * dt:8.1f} ms  {rates}")
    if dev != "cuda":
        return
    torch.cuda.reset_peak_memory_stats()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        micro_batch()
        sync()
    print(f"peak memory in one micro-batch: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in events)
    by_kind: dict[str, list] = {}
    for e in events:
        k = by_kind.setdefault(kind_of(e.key), [0.0, 0])
        k[0] += e.self_device_time_total
        k[1] += e.count
    print(f"profile of one micro-batch: GPU busy {busy / 1000:.1f} ms, {sum(e.count for e in events)} kernels")
    for k, (us, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"   {k:12s} {us / 1000:8.1f} ms  {us / busy:6.1%}  {count:6d} kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"   {e.self_device_time_total / 1000:8.2f} ms  {e.count:5d}x  [{kind_of(e.key)}] {e.key[:100]}")
    if args.compile_layers:  # after the profile (which is of the eager model): what compiled layers would give
        t0 = time.perf_counter()
        for layer in model.model.layers:
            layer.compile()
        model.model.norm.compile()
        dt = timed(micro_batch)
        print(f"{'  decoder layers compiled (first call ' + format(time.perf_counter() - t0, '.0f') + ' s)':52s} "
              f"{1000 * dt:8.1f} ms  {8 * n * tokens / dt / 1e12:6.1f} TFLOP/s  {8 * n * tokens / dt / rate:6.1%} of matmul")


if __name__ == "__main__":
    main()
