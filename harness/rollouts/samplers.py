"""The separate samplers: vLLM colocated in this process (`VLLMSampler`, as TRL's colocate mode), and the emulated
sampler, a stand-in for vLLM where vLLM cannot be installed.

The emulated sampler is a second copy of the policy that differs from the trainer in a controlled, stated way:
- `noise`: every floating tensor gets seeded Gaussian noise of std `noise_scale` x that tensor's
  std, redrawn at every weight sync (the noise is seeded by (SEED, sync count));
- `bfloat16`: the weights rounded to bf16 (computation in fp32 again, on transformers' path), the
  kind of gap a lower-precision inference engine opens.
It samples completions and reports its own per-token log-probs (on logits / temperature, i.e.
vLLM's processed log-probs when top_p = 1 and top_k = 0), which is what the IS correction needs.
Where `GENERATION` resolves to the static-cache decoder (a GPU, by default) the copy is that decoder's
inference copy (harness/rollouts/fastgen.py: every weight in the compute dtype, as an inference engine
holds them) and the log-probs come from the decode itself; elsewhere transformers' generate samples and
one forward pass scores. In bf16 the first path's difference from the trainer is the stated one plus the
copy's rounding (the trainer keeps fp32 weights under autocast), and `bfloat16` adds nothing to it. On a
GPU it is expected to make an IS cell's generation as fast as the policy's own (at the lesson's batch on
an H200: 3.3 ms a decode step compiled, 117 ms through transformers' generate; not yet measured here).
Runs that use it are labelled `emulated sampler` in manifests and reports.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from harness.rollouts.generate import generate_completions, score_completions


class EmulatedSampler:
    label = "emulated sampler"

    def __init__(self, spec, policy, eos_ids: list[int], pad_id: int, device: str):
        from harness.rollouts.fastgen import static_decoder_for

        self.spec, self.eos_ids, self.pad_id, self.device = spec, eos_ids, pad_id, device
        self.decoder = static_decoder_for(spec, policy, eos_ids, pad_id, device)
        if self.decoder is not None:  # the noise goes into the decoder's own copy
            self.model = self.decoder.net
        else:
            self.model = copy.deepcopy(policy).eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.syncs = 0

    def describe(self) -> str:
        if self.decoder is not None:
            return f"{describe_sampler(self.spec)}; {self.decoder.describe()}"
        return describe_sampler(self.spec)

    @torch.no_grad()
    def sync_weights(self, policy) -> None:
        """Copy the trainer's current weights, then apply the stated difference. The noise is drawn on the
        sampler's device from a generator seeded by (SEED, sync count): the same draws on every run there."""
        s = self.spec.sampler
        dev = next(self.model.parameters()).device
        g = torch.Generator(device=dev).manual_seed(self.spec.SEED * 1_000_003 + self.syncs)
        self.syncs += 1
        for (name, dst), src in zip(self.model.named_parameters(), policy.parameters(), strict=True):
            w = src.detach().to(dev, torch.float32)
            if s.emulation == "bfloat16":
                w = w.to(torch.bfloat16).float()
            elif s.noise_scale > 0 and w.numel() > 1:
                w = w + torch.randn(w.shape, generator=g, device=dev) * (s.noise_scale * w.std())
            dst.copy_(w)

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        spec = self.spec
        if self.decoder is not None:
            return self.decoder.generate(prompt_ids, max_tokens=spec.MAX_TOKENS, temperature=spec.TEMPERATURE,
                                         top_p=spec.TOP_P, top_k=spec.TOP_K, logprobs=True)
        completions = generate_completions(
            self.model, prompt_ids, eos_ids=self.eos_ids, pad_id=self.pad_id, max_tokens=spec.MAX_TOKENS,
            temperature=spec.TEMPERATURE, top_p=spec.TOP_P, top_k=spec.TOP_K, device=self.device, dtype=spec.DTYPE)
        logps = score_completions(self.model, prompt_ids, completions, pad_id=self.pad_id,
                                  temperature=spec.TEMPERATURE, device=self.device, dtype=spec.DTYPE)
        return completions, logps


def vllm_completions(outputs) -> tuple[list[list[int]], list[list[float]]]:
    """Completion ids and the sampled tokens' log-probs from vLLM `RequestOutput`s (one sample each).

    With `SamplingParams(logprobs=0)` each position's dict holds the sampled token (vLLM always includes it);
    with `logprobs_mode="processed_logprobs"` those are log-probs after temperature, as TRL asks for."""
    ids, logps = [], []
    for request in outputs:
        sample = request.outputs[0]
        tokens = list(sample.token_ids)
        if sample.logprobs is None:
            raise ValueError("vLLM returned no log-probs: SamplingParams(logprobs=0) is required")
        ids.append(tokens)
        logps.append([float(pos[tok].logprob) for tok, pos in zip(tokens, sample.logprobs, strict=True)])
    return ids, logps


_ENGINE: dict = {}  # the one vLLM engine of this process: {"key": ..., "llm": LLM}
VLLM_SECONDS: dict[str, float] = {}  # where this process's vLLM time went (build, wake, push, generate, sleep), summed


@contextlib.contextmanager
def _timed(phase: str):
    """Adds the phase's seconds to VLLM_SECONDS once the GPU is done with it (tools/gpu_vllm32.py prints them). Every
    run pays one synchronize a phase (a few per round: nothing against a round's generation); a phase that raises
    is not timed, so that a CUDA error is the one raised."""
    import time

    t = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    VLLM_SECONDS[phase] = VLLM_SECONDS.get(phase, 0.0) + time.perf_counter() - t


def vllm_environment() -> None:
    """vLLM's settings for this process, before any engine starts. Where flashinfer is not installed (the GPU
    machine carries vLLM without its 447 MB of kernels), vLLM's own top-k/top-p sampler instead of flashinfer's: an
    engine started on that machine stopped at `import flashinfer` (raw log-probs; with processed log-probs, as here
    and in TRL, vLLM 0.24 may not reach that import: the setting is then without effect)."""
    import importlib.util
    import os

    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@contextlib.contextmanager
def _launcher_variables():
    """The torch.distributed variables vLLM's external_launcher reads while its engine starts (one process, rank 0,
    a free port), as TRL's colocate mode sets them, then the environment as it was: a later Accelerator (TRL's side
    in this process) must not take LOCAL_RANK for a distributed launch, as it never does under TRL itself (TRL sets
    them after its Accelerator)."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    before = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)


@contextlib.contextmanager
def _random_state_kept():
    """vLLM's worker seeds every generator (torch's, each GPU's, numpy's, Python's) with the engine's seed while the
    engine starts: around it, the caller's generators go on as if it had not started (a lockstep round builds the
    engine inside its own seeded draw)."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def request_seeds(n: int) -> list[int]:
    """One vLLM sampling seed per request, drawn from torch's generator: a lockstep round forks and seeds it
    (RecordingSource), so a round's draws repeat whatever the engine sampled before in this process."""
    return [int(x) for x in torch.randint(0, 2**31 - 1, (n,))]


class VLLMSampler:
    """vLLM colocated in this process (one GPU), as TRL 1.16's `vllm_mode="colocate"` builds it: the same LLM
    arguments, weights pushed with `load_weights` before each round, the sampled tokens' processed log-probs
    returned for the IS correction. One engine per process, shared by every side that samples in it: the runs of a
    matrix (scratch runs, re-runs) and, with `vllm_engine = "shared"`, TRL's own generation in a free run (trl_runner
    puts this sampler where TRL would build its engine), each pushing its own weights before it samples, so a shared
    engine is keyed by the model's shape, not by the checkpoint it was built from (the default since a GPU run
    checked it within 31.8 GiB; `per_side`: by the checkpoint, and TRL builds its own engine in a free run); each
    request carries its own seed (`request_seeds`), so an engine's history does not change a run's draws. Its memory is
    `vllm_gpu_memory_utilization` of the card, or of GPU_MEMORY_GB when set (as on a card that size); with
    `vllm_sleep` (TRL's vllm_enable_sleep_mode) it gives its weights and KV cache back between generations (sleep
    level 2, as TRL does)."""

    label = "vLLM (colocate)"

    def __init__(self, spec, checkpoint):
        self.spec = spec
        dtype = "bfloat16" if spec.DTYPE == "bfloat16" else "float32"
        share = engine_share(spec)
        shared = spec.sampler.vllm_engine == "shared"
        key = (_model_shape(checkpoint) if shared else str(checkpoint), dtype, share, spec.sampler.vllm_sleep)
        if _ENGINE.get("key") != key:
            # another model or share: a new engine (the old one's memory comes back only once nothing holds it,
            # and vLLM returns little in-process: one spec per process is the supported use)
            _ENGINE.clear()
            vllm_environment()
            from vllm import LLM

            with _launcher_variables(), _random_state_kept(), _timed("build"):
                # max_model_len None: vLLM takes it from the checkpoint's config, as TRL's vllm_max_model_length
                llm = LLM(model=str(checkpoint), gpu_memory_utilization=share, max_model_len=None,
                          distributed_executor_backend="external_launcher", seed=spec.SEED,
                          max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", dtype=dtype,
                          enable_sleep_mode=spec.sampler.vllm_sleep)
            if spec.sampler.vllm_sleep:
                llm.sleep(level=2)  # as TRL: asleep until the first generation pushes weights
            _ENGINE.update(key=key, llm=llm, asleep=spec.sampler.vllm_sleep)
        self.llm = _ENGINE["llm"]

    def describe(self) -> str:
        return describe_sampler(self.spec)

    @property
    def asleep(self) -> bool:
        """Whether sleep mode has dropped the engine's weights (the next generation must push them first)."""
        return bool(_ENGINE.get("asleep"))

    @torch.no_grad()
    def sync_weights(self, policy) -> None:
        if _ENGINE.get("asleep"):  # sleep level 2 dropped the weights: map them again, then push ours (as TRL)
            with _timed("wake"):
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
            _ENGINE["asleep"] = False
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        with _timed("push"):
            for name, param in policy.named_parameters():  # (a compiled module's names carry a prefix vLLM lacks)
                model.load_weights([(name.removeprefix("_orig_mod."), param.detach())])
            self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams

        s = self.spec
        params = [SamplingParams(n=1, temperature=s.TEMPERATURE, top_p=s.TOP_P, top_k=s.TOP_K, max_tokens=s.MAX_TOKENS,
                                 logprobs=0, seed=seed) for seed in request_seeds(len(prompt_ids))]
        sleep = self.spec.sampler.vllm_sleep
        if sleep:
            with _timed("wake"):
                self.llm.wake_up(tags=["kv_cache"])
        with _timed("generate"):
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params,
                                        use_tqdm=False)
        if sleep:  # the trainer's step gets the engine's memory back until the next round
            with _timed("sleep"):
                self.llm.sleep(level=2)
            _ENGINE["asleep"] = True
        return vllm_completions(outputs)


def engine_share(spec) -> float:
    """vLLM's gpu_memory_utilization for this process's engine: the spec's share, of GPU_MEMORY_GB when that is set
    (a 0.3 share of a 31.8 GiB card is 9.5 GiB on any card)."""
    share = spec.sampler.vllm_gpu_memory_utilization
    if not spec.GPU_MEMORY_GB:
        return share
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return round(share * spec.GPU_MEMORY_GB * 2**30 / total, 4)


def _model_shape(checkpoint) -> str:
    """What an engine is built for: the checkpoint's config.json without its name (an engine serves any checkpoint
    of that shape: the weights are pushed before each round)."""
    import json
    from pathlib import Path

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    config.pop("_name_or_path", None)
    return json.dumps(config, sort_keys=True)


def describe_sampler(spec) -> str:
    """How `spec.sampler` draws completions, in words (manifests and reports), without building anything."""
    s = spec.sampler
    if s.kind == "emulated":
        how = f"noise {s.noise_scale:g} x tensor std" if s.emulation == "noise" else "weights rounded to bfloat16"
        return f"{EmulatedSampler.label} ({how})"
    if s.kind == "vllm":
        of = f" of GPU_MEMORY_GB {spec.GPU_MEMORY_GB:g}" if spec.GPU_MEMORY_GB else ""
        return f"{VLLMSampler.label}, gpu_memory_utilization {s.vllm_gpu_memory_utilization}{of}" + (
            ", sleep mode" if s.vllm_sleep else "")
    return s.kind


def make_sampler(spec, policy, eos_ids: list[int], pad_id: int, device: str):
    """The separate sampler `spec.sampler.kind` names, built from `policy` (its checkpoint for vLLM), or None
    for `policy`: the trained model samples for itself."""
    if spec.sampler.kind == "emulated":
        return EmulatedSampler(spec, policy, eos_ids, pad_id, device)
    if spec.sampler.kind == "vllm":
        return VLLMSampler(spec, policy.name_or_path)
    return None


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
