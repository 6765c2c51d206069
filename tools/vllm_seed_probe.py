"""Issue 48: why vLLM generates the lesson's batch (64 x 512 tokens) in 3.9-4.0 s on an H100 (2026-12-07, no sleep
mode, 31.8 GiB cap), twice the built-in compiled decoder's 2.0 s: each request's own seed (vLLM samples seeded
requests one generator at a time) or the processed log-probs? The harness's engine (samplers.VLLMSampler on
harness/specs/bench.toml), then an untimed warm-up, then each variant twice, alternating:
    PYTHONPATH=/tmp/vsite:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 tools/vllm_seed_probe.py
(after `bash tools/gpu_vllm.sh check` has installed vLLM)."""
import sys
from time import perf_counter

import torch

sys.path.insert(0, ".")
from harness.experiment.models import checkpoint_dir  # noqa: E402
from harness.experiment.spec import load_spec  # noqa: E402
from harness.rollouts import samplers  # noqa: E402


def main() -> None:
    from vllm import SamplingParams

    spec = load_spec("harness/specs/bench.toml", ['sampler.kind="vllm"', "GPU_MEMORY_GB=31.8"])
    t = perf_counter()
    llm = samplers.VLLMSampler(spec, str(checkpoint_dir(spec))).llm
    print(f"build {perf_counter() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 50000, (48,), generator=g).tolist()} for _ in range(64)]
    variants = {"seeded, logprobs": (True, 0), "unseeded, logprobs": (False, 0), "seeded, no logprobs": (True, None),
                "unseeded, no logprobs": (False, None)}
    llm.generate(prompts[:8], sampling_params=SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up, untimed
    for _ in range(2):
        for name, (seeded, logprobs) in variants.items():
            params = [SamplingParams(n=1, temperature=1.0, max_tokens=spec.MAX_TOKENS, logprobs=logprobs,
                                     seed=1000 + i if seeded else None) for i in range(len(prompts))]
            torch.cuda.synchronize()
            t = perf_counter()
            outs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
            torch.cuda.synchronize()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{name}: {perf_counter() - t:.2f} s, {tokens} tokens", flush=True)


if __name__ == "__main__":
    main()
