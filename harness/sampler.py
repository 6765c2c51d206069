"""The emulated sampler: a stand-in for vLLM where vLLM cannot be installed.

It is a second copy of the policy that differs from the trainer in a controlled, stated way:
- `noise`: every floating tensor gets seeded Gaussian noise of std `noise_scale` x that tensor's
  std, redrawn at every weight sync (the noise is seeded by (SEED, sync count));
- `bfloat16`: the weights rounded to bf16 (computation in fp32 again), the kind of gap a
  lower-precision inference engine opens.
It samples completions and reports its own per-token log-probs (on logits / temperature, i.e.
vLLM's processed log-probs when top_p = 1 and top_k = 0), which is what the IS correction needs.
Runs that use it are labelled `emulated sampler` in manifests and reports.
"""

from __future__ import annotations

import copy

import torch

from scratch_grpo.sampling import generate_completions, score_completions


class EmulatedSampler:
    label = "emulated sampler"

    def __init__(self, spec, policy, eos_ids: list[int], pad_id: int, device: str):
        self.spec, self.eos_ids, self.pad_id, self.device = spec, eos_ids, pad_id, device
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.syncs = 0

    def describe(self) -> str:
        s = self.spec.sampler
        how = f"noise {s.noise_scale:g} x tensor std" if s.emulation == "noise" else "weights rounded to bfloat16"
        return f"{self.label} ({how})"

    @torch.no_grad()
    def sync_weights(self, policy) -> None:
        """Copy the trainer's current weights, then apply the stated difference."""
        s = self.spec.sampler
        g = torch.Generator().manual_seed(self.spec.SEED * 1_000_003 + self.syncs)
        self.syncs += 1
        for (name, dst), src in zip(self.model.named_parameters(), policy.parameters(), strict=True):
            w = src.detach().float().cpu()
            if s.emulation == "bfloat16":
                w = w.to(torch.bfloat16).float()
            elif s.noise_scale > 0 and w.numel() > 1:
                w = w + torch.randn(w.shape, generator=g) * (s.noise_scale * w.std())
            dst.copy_(w.to(dst.device, dst.dtype))

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        spec = self.spec
        completions = generate_completions(
            self.model, prompt_ids, eos_ids=self.eos_ids, pad_id=self.pad_id, max_tokens=spec.MAX_TOKENS,
            temperature=spec.TEMPERATURE, top_p=spec.TOP_P, top_k=spec.TOP_K, device=self.device, dtype=spec.DTYPE)
        logps = score_completions(self.model, prompt_ids, completions, pad_id=self.pad_id,
                                  temperature=spec.TEMPERATURE, device=self.device, dtype=spec.DTYPE)
        return completions, logps
