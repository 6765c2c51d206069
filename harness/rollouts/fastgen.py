"""Fast batched sampling without vLLM: a static KV cache, each whole decode step replayed as one CUDA graph,
and (GENERATION = "compiled", the GPU default) that step's forward compiled by torch.compile.

Why: Hugging Face `generate` on a GPU spends most of a GRPO step launching small kernels one by one
(about 1800 per decode step at Qwen3-0.6B's shape, measured; 512 steps per round). Here the whole batch
is decoded together against a KV cache of fixed shape, so one decode step always launches the same
kernels on the same buffers; on CUDA that step is captured once per `generate` call and replayed as a
single CUDA graph, and compiling its forward fuses the norms, rotary, casts and residual adds into ~580
kernels (docs/benchmarks.md, H200, batch 64: 117 ms per step for `generate`, 6.8 ms with the graph,
3.3 ms compiled).

How, top to bottom:
1. `sync_weights`: the sampler keeps its own inference copy of the policy in the compute dtype (bf16 on
   a GPU run), as vLLM does; weights are copied in place before each round, so captured graphs keep
   pointing at the right memory.
2. prefill: the left-padded prompts in one forward pass, writing cache positions 0..P-1, with an
   explicit 4-D mask (causal, pad keys hidden). The cache length is rounded up to CACHE_BUCKET.
3. decode: each step samples token t from the current logits, feeds it at cache position P+t and
   position id (prompt length + t) per row, and leaves the logits for token t+1; every index it needs
   lives in a device buffer the step updates itself, so the replayed graph needs nothing from the host.
   The host looks at the `done` flags every 8 steps only. Attention for one query token groups the query
   heads per KV head (`decode_attention`) instead of copying the cache per head.
4. sampling (`sample_next`): temperature, then top-k, then top-p, then a categorical draw, in Hugging
   Face's order; rows that emitted an eos get the pad token afterwards.

Completions are cut after their first eos, as `generate_completions` returns them. This path draws
different random numbers from `generate`, so the same seed gives different (equally distributed)
completions; lockstep parity is unaffected (both loops score the recorded completions).
"""

from __future__ import annotations

import copy
import warnings

import torch

from harness.experiment.models import CompileOnFirstCall
from harness.rollouts.generate import cut_at_eos, pad_left


def sample_next(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` (B, V): temperature, top-k, top-p (nucleus), categorical draw.

    top-p keeps the smallest set of most likely tokens whose probability reaches `top_p` (the token that
    crosses the threshold is kept), as Hugging Face's TopPLogitsWarper and vLLM do."""
    scores = logits.float() / temperature
    if top_k and 0 < top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= top_p  # mass before this token already reaches top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    # a categorical draw as torch.multinomial makes one (argmax of p / Exp(1) noise), without its host-side
    # check of the probabilities, which a CUDA graph cannot hold
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


DECODE_ATTENTION = "grpo_static_decode"
CACHE_BUCKET = 64  # KV cache lengths are rounded up to a multiple of this (masked keys weigh exactly nothing)


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for the decoder's inference copy. One query token with grouped KV heads: the query heads that
    share a KV head become that head's query rows, (B, H, 1, D) -> (B, KV, H/KV, D), so SDPA reads each cached
    key/value once instead of after `repeat_kv` copied it H/KV times. Anything else: transformers' SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q_len, D = query.shape
    kv = key.shape[1]
    if q_len != 1 or H == kv:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    grouped = query.reshape(B, kv, H // kv, D)  # head h reads KV head h // (H / KV), as repeat_kv lays it out
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2), None


def _register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)


class FixedCache:
    """Per-layer key/value buffers of fixed shape (B, kv_heads, L, head_dim), written at `position`.

    `position` is a device tensor of cache indices that the caller sets before each forward pass (for a
    decode step: one buffer updated in place), so a captured graph writes where the current step belongs.
    It answers the one call transformers' attention makes: `update(keys, values, layer_idx)`."""

    def __init__(self, config, batch: int, length: int, dtype, device):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch, config.num_key_value_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.position: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.position, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.position, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


class StaticDecoder:
    """Samples completions from an inference copy of the policy; see the module docstring.

    `graphs=None` captures CUDA graphs when the model is on a GPU; `graphs=False` decodes eagerly (the
    same arithmetic; that is what runs on CPU and in the tests)."""

    def __init__(self, policy, *, eos_ids: list[int], pad_id: int, dtype: str, graphs: bool | None = None,
                 pack_gqa: bool = True, compile_step: bool | None = None):
        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        self.net = copy.deepcopy(policy).eval().to(getattr(torch, dtype))
        # accelerate's mixed precision (TRL's bf16=True) replaces the trainer model's `forward` by a closure over
        # the ORIGINAL model; deepcopy keeps that closure, so the copy would run the trainer's model (in training
        # mode, gradient checkpointing on: it drops the KV cache). The copy runs its own class forward instead.
        for attr in ("forward", "_original_forward"):
            self.net.__dict__.pop(attr, None)
        if self.net.supports_gradient_checkpointing:
            self.net.gradient_checkpointing_disable()
        self.net.requires_grad_(False)
        if pack_gqa:
            _register_decode_attention()
            self.net.config._attn_implementation = DECODE_ATTENTION  # the copy's config only
        self.device = next(self.net.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.capture_failed = False
        self.compile_step = self.device.type == "cuda" if compile_step is None else compile_step
        self.compile_failed = False
        # static shapes first; a batch that brings another cache length is compiled once more with a dynamic one
        # (torch.compile's automatic dynamic shapes), then serves every length
        self._compiled = CompileOnFirstCall(self.net.forward, "the decode step", "decoding with the eager forward")
        self.last_stats: dict[str, float] = {}

    def describe(self) -> str:
        if self.graphs:
            words = "static KV cache + CUDA graph"
        else:
            words = "static KV cache (eager: graph capture failed)" if self.capture_failed else "static KV cache (eager)"
        if self.compile_step:
            return words + ", compiled decode step"
        return words + " (torch.compile failed)" if self.compile_failed else words

    @torch.no_grad()
    def sync_weights(self, policy) -> None:
        """Copy the trainer's current weights into the inference copy, in place (cast to its dtype)."""
        for dst, src in zip(self.net.parameters(), policy.parameters(), strict=True):
            dst.copy_(src.detach())

    def _forward(self, ids, positions, mask, cache, compiled: bool = True):
        kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        if not (compiled and self.compile_step):
            return self.net.forward(**kwargs).logits[:, -1]
        out = self._compiled(**kwargs)  # the first call compiles; a compiler that fails leaves the eager forward
        if self._compiled.state == "failed":
            self.compile_step, self.compile_failed = False, True
        return out.logits[:, -1]

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, max_tokens: int, temperature: float, top_p: float = 1.0,
                 top_k: int = 0, batch_size: int | None = None, logprobs: bool = True):
        """Completions (cut after the first eos) and, with `logprobs`, the sampler's log-prob of each sampled
        token on logits / temperature before top-k/top-p (vLLM's default `logprobs`), in the inference dtype;
        None without (the policy's own sampling does not need them: its trainer scores the tokens)."""
        out: list[list[int]] = []
        logps: list[list[float]] | None = [] if logprobs else None
        step = batch_size or len(prompt_ids)
        for start in range(0, len(prompt_ids), step):
            c, lp = self._generate_batch(prompt_ids[start:start + step], max_tokens, temperature, top_p, top_k,
                                         logprobs)
            out.extend(c)
            if logps is not None:
                logps.extend(lp)
        return out, logps

    def _generate_batch(self, prompt_ids, max_tokens, temperature, top_p, top_k, logprobs):
        dev = self.device
        ids, pmask = pad_left(prompt_ids, self.pad_id)
        ids, pmask = ids.to(dev), pmask.to(dev).bool()
        B, P = ids.shape
        L = -(-(P + max_tokens) // CACHE_BUCKET) * CACHE_BUCKET  # a few cache shapes: fewer compiles
        cache = FixedCache(self.net.config, B, L, next(self.net.parameters()).dtype, dev)
        eos = torch.tensor(self.eos_ids, device=dev)

        # ---- prefill: causal over the prompt, pad keys hidden; positions count real tokens only ------------
        key_ok = torch.zeros(B, L, dtype=torch.bool, device=dev)
        key_ok[:, :P] = pmask
        causal = torch.ones(P, L, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & key_ok[:, None, :])[:, None]  # (B, 1, P, L)
        positions = (pmask.long().cumsum(-1) - 1).clamp(min=0)
        cache.position = torch.arange(P, device=dev)
        logits = self._forward(ids, positions, mask, cache, compiled=False)

        # ---- decode state: device buffers that each step reads and updates in place ----------------------
        tokens = torch.full((B, max_tokens), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros(B, max_tokens, dtype=torch.float32, device=dev) if logprobs else None
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        t_idx = torch.zeros(1, dtype=torch.long, device=dev)  # the token index this step samples
        tok = torch.empty(B, 1, dtype=torch.long, device=dev)
        pos = pmask.sum(-1, keepdim=True) - 1  # position id of the last token fed; each step adds one
        cpos = torch.full((1,), P - 1, dtype=torch.long, device=dev)  # its cache index
        dmask = key_ok[:, None, None, :].clone()  # (B, 1, 1, L): prompt keys, then each generated one
        arange_l = torch.arange(L, device=dev)
        cache.position = cpos

        def sample():  # token t from the current logits; rows that said eos get the pad token
            nxt = sample_next(logits, temperature, top_k, top_p)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            tokens.index_copy_(1, t_idx, nxt[:, None])
            if logprobs:
                lp = (logits.float() / temperature).log_softmax(-1).gather(-1, nxt[:, None])
                logps.index_copy_(1, t_idx, lp)
            done.logical_or_(torch.isin(nxt, eos))
            return nxt

        def step():  # one whole decode step: sample token t, feed it, logits for token t + 1
            nxt = sample()
            tok.copy_(nxt[:, None])
            pos.add_(1)
            cpos.add_(1)
            dmask.logical_or_((arange_l == cpos)[None, None, None, :])
            logits.copy_(self._forward(tok, pos, dmask, cache))
            t_idx.add_(1)

        graph = None
        check_every = 8
        n = max_tokens
        for t in range(max_tokens - 1):
            if graph is not None:
                graph.replay()
            elif self.graphs and t >= 2:  # two eager steps warm up (and compile); this one is run, then captured
                graph = self._capture(step)
            else:
                step()
            if t % check_every == check_every - 1 and bool(done.all()):
                n = t + 1
                break
        else:
            if max_tokens:
                sample()  # the last token: sampled, never fed
        self.last_stats = {"decode_steps": n, "batch": B, "prompt_width": P}
        completions = cut_at_eos(tokens[:, :n], self.eos_ids)
        if not logprobs:
            return completions, None
        return completions, [row[:len(c)] for row, c in zip(logps[:, :n].tolist(), completions)]

    def _capture(self, step):
        """Run `step` once for real on a side stream (the warm-up torch.cuda.graphs asks for; it is this decode
        step), then capture it. Returns the graph, or None when the step cannot be captured: then decoding goes on
        eagerly and says so. A failure of the warm-up itself is a failure of the step, and propagates."""
        try:
            stream = torch.cuda.Stream()
        except RuntimeError as e:  # no CUDA here
            self._no_graph(e)
            step()
            return None
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        try:  # recording runs nothing: a failed capture leaves the decode state as the warm-up left it
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            return graph
        except RuntimeError as e:  # a model whose forward cannot be captured: decode eagerly, say so
            self._no_graph(e)
            return None

    def _no_graph(self, e: Exception) -> None:
        warnings.warn(f"CUDA graph capture failed ({str(e)[:200]}); decoding eagerly from here on")
        self.graphs, self.capture_failed = False, True


def static_decoder_for(spec, policy, eos_ids: list[int], pad_id: int, device: str) -> StaticDecoder | None:
    """The decoder `spec.GENERATION` asks for (auto: compiled on a GPU), or None for transformers' generate."""
    kind = spec.decoder(device.startswith("cuda"))
    if kind == "hf":
        return None
    return StaticDecoder(policy, eos_ids=eos_ids, pad_id=pad_id, dtype=spec.DTYPE, compile_step=kind == "compiled")


def sample_policy(decoder: StaticDecoder | None, spec, policy, prompt_ids, *, eos_ids, pad_id, device):
    """One round of the policy's own completions: through `decoder` (synced to `policy` first) when there
    is one, else transformers' generate under the spec's dtype."""
    from harness.rollouts.generate import generate_completions

    if decoder is not None:
        decoder.sync_weights(policy)
        return decoder.generate(prompt_ids, max_tokens=spec.MAX_TOKENS, temperature=spec.TEMPERATURE,
                                top_p=spec.TOP_P, top_k=spec.TOP_K, logprobs=False)[0]
    return generate_completions(policy, prompt_ids, eos_ids=eos_ids, pad_id=pad_id, max_tokens=spec.MAX_TOKENS,
                                temperature=spec.TEMPERATURE, top_p=spec.TOP_P, top_k=spec.TOP_K, device=device,
                                dtype=spec.DTYPE)
