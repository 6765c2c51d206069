"""The static-cache decoder (harness/rollouts/fastgen.py): its sampling rule by hand, its log-probs against a
full forward pass, eos handling, and the scratch loop running on it."""

import pytest
import torch

from conftest import small_spec
from harness.rollouts.fastgen import StaticDecoder, sample_next


def test_sample_next_top_k_and_top_p_by_hand():
    # probabilities 0.5, 0.25, 0.15, 0.10 (logits are their logs)
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.10]]).log().repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    # top_k=2: only tokens 0 and 1, in ratio 2:1
    draws = sample_next(logits, 1.0, top_k=2, generator=g)
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).float().mean().item() - 2 / 3) < 0.03
    # top_p=0.7: 0.5 < 0.7, so token 1 (which crosses 0.7) is kept, token 2 is not
    draws = sample_next(logits, 1.0, top_p=0.7, generator=g)
    assert set(draws.tolist()) == {0, 1}
    # top_p=0.5: token 0 alone reaches 0.5
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=g).tolist()) == {0}
    # temperature 0.5 squares the probabilities: 0.25 : 0.0625 : 0.0225 : 0.01 -> token 0 has 0.7163
    draws = sample_next(logits, 0.5, generator=g)
    assert abs((draws == 0).float().mean().item() - 0.25 / 0.345) < 0.03


def _model_and_prompts():
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer

    spec = small_spec()
    ckpt = checkpoint_dir(spec)
    tok, model = load_tokenizer(ckpt), load_model(ckpt, "float32", "cpu")
    questions = ["What is 3 + 4 ?", "What is 1 + 1 ?", "What is 9 + 9 ? What is 2 + 2 ? What is 5 + 0 ?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for q in questions] * 4
    return model, tok, eos_token_ids(model.generation_config, tok), prompts


def test_decoder_logprobs_match_a_full_forward_pass_with_left_padding():
    """Prompts of three lengths (left padding): each sampled token's log-prob from the cached decode equals the
    log-prob a full forward pass gives the finished completion (fp32)."""
    from harness.rollouts.generate import score_completions

    model, tok, eos, prompts = _model_and_prompts()
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(3)
    completions, logps = dec.generate(prompts, max_tokens=12, temperature=0.7)
    assert [len(c) for c in completions] == [len(lp) for lp in logps]
    assert len({len(c) for c in completions}) > 1  # some rows stopped at an eos, some ran to the limit
    ref = score_completions(model, prompts, completions, pad_id=tok.pad_token_id, temperature=0.7, device="cpu")
    diff = max(abs(a - b) for ra, rb in zip(logps, ref) for a, b in zip(ra, rb))
    assert diff < 1e-5, diff


def test_decoder_stops_rows_at_eos():
    model, tok, eos, prompts = _model_and_prompts()
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    completions, _ = dec.generate(prompts, max_tokens=16, temperature=1.0)
    for c in completions:
        assert all(t not in eos for t in c[:-1])  # an eos can only be the last token
        assert len(c) == 16 or c[-1] in eos
    # make the eos token overwhelmingly likely: every completion is that single eos, then pad
    bias = torch.zeros(model.config.vocab_size)
    bias[eos[0]] = 1e4
    dec.net.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    completions, _ = dec.generate(prompts, max_tokens=16, temperature=1.0)
    assert completions == [[eos[0]]] * len(prompts)
    assert dec.last_stats["decode_steps"] == 8  # all rows done: stopped at the first check, not at 16


def test_decoder_runs_its_own_copy_when_the_trainer_patched_forward():
    """TRL's bf16=True (accelerate's mixed precision) replaces the trainer model's `forward` by a closure over that
    model; a deepcopy keeps the closure. The lesson's batch=naive cell crashed on an H200 because the decoder's copy
    ran the trainer's model (training mode, gradient checkpointing: no KV cache). The copy must run itself."""
    model, tok, eos, prompts = _model_and_prompts()
    original = model.forward
    calls = []

    def patched(*args, **kwargs):  # as accelerate's convert_outputs_to_fp32(autocast(model.forward))
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = patched
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(1)
    completions, _ = dec.generate(prompts, max_tokens=6, temperature=1.0)
    assert not calls  # the trainer's model never ran
    assert len(completions) == len(prompts)


def test_sync_weights_copies_the_policy():
    model, tok, eos, _ = _model_and_prompts()
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(next(dec.net.parameters()), next(model.parameters()))
    dec.sync_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(dec.net.parameters(), model.parameters()))


def test_scratch_loop_on_the_static_decoder(tmp_path):
    from harness.runlog.log import read_run
    from scratch_grpo.train import train

    spec = small_spec("STEPS=3", 'GENERATION="static"')
    df = read_run(train(spec, tmp_path, progress=False))
    assert len(df) == 3 and df.attrs["manifest"]["generation"].startswith("static KV cache")
    assert (df["completions/mean_length"] > 0).all()


@pytest.mark.gpu
def test_cuda_graph_decoder_matches_eager_on_gpu():
    """On CUDA the captured graph (sampling inside it) replays the same arithmetic as eager decoding: same seed,
    same tokens."""
    model, tok, eos, prompts = _model_and_prompts()
    model = model.cuda()
    graph = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="bfloat16", compile_step=False)
    eager = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="bfloat16", graphs=False, compile_step=False)
    assert graph.graphs and not eager.graphs
    torch.manual_seed(5)
    a = graph.generate(prompts, max_tokens=24, temperature=1.0)
    torch.manual_seed(5)
    b = eager.generate(prompts, max_tokens=24, temperature=1.0)
    assert graph.graphs, graph.describe()  # the capture held (a failed capture falls back to eager and says so)
    assert a[0] == b[0]
    diff = max(abs(x - y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
    assert diff < 1e-3, diff


@pytest.mark.gpu
def test_compiled_graph_decoder_on_gpu_scores_as_a_full_forward_pass():
    """The GPU default (compiled decode step inside a CUDA graph): the capture and the compile hold, and each
    sampled token's log-prob is the one a full fp32 forward pass gives it, within bf16 rounding (as close as the
    uncompiled bf16 decoder's)."""
    from harness.rollouts.generate import score_completions

    model, tok, eos, prompts = _model_and_prompts()
    model = model.cuda()
    errors = []
    for compiled in (True, False):
        dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="bfloat16", compile_step=compiled)
        torch.manual_seed(5)
        completions, logps = dec.generate(prompts, max_tokens=24, temperature=1.0)
        assert dec.graphs and dec.compile_step == compiled, dec.describe()
        ref = score_completions(model, prompts, completions, pad_id=tok.pad_token_id, temperature=1.0, device="cuda")
        errors.append(max(abs(a - b) for ra, rb in zip(logps, ref) for a, b in zip(ra, rb)))
    assert errors[0] < 0.1 and errors[0] < 3 * errors[1] + 0.02, errors


def test_vllm_outputs_become_completions_and_logprobs():
    """The one piece of the vLLM path that runs without vLLM: reading its RequestOutputs (shaped as vLLM 0.22+
    returns them with SamplingParams(logprobs=0): per position, a dict holding the sampled token's Logprob)."""
    from types import SimpleNamespace as NS

    from harness.rollouts.samplers import vllm_completions

    def request(tokens, logps, extra=None):
        positions = [{t: NS(logprob=lp, rank=1), **(extra or {})} for t, lp in zip(tokens, logps)]
        return NS(outputs=[NS(token_ids=tuple(tokens), logprobs=positions)])

    ids, lps = vllm_completions([request([5, 9, 2], [-0.5, -1.25, -0.01], extra={7: NS(logprob=-0.1, rank=1)}),
                                 request([3], [-2.0])])
    assert ids == [[5, 9, 2], [3]] and lps == [[-0.5, -1.25, -0.01], [-2.0]]
    with pytest.raises(ValueError, match="logprobs=0"):
        vllm_completions([NS(outputs=[NS(token_ids=(1,), logprobs=None)])])


def test_failed_graph_capture_falls_back_to_eager_and_says_so():
    """Capture fails here (no CUDA): the decoder warns, decodes eagerly with the same arithmetic, and its
    description (written to the run manifest) names the failure. Without log-probs it returns None for them."""
    model, tok, eos, prompts = _model_and_prompts()
    forced = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", graphs=True)
    eager = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", graphs=False)
    torch.manual_seed(7)
    with pytest.warns(UserWarning, match="CUDA graph capture failed"):
        a = forced.generate(prompts, max_tokens=12, temperature=1.0, logprobs=False)
    torch.manual_seed(7)
    b = eager.generate(prompts, max_tokens=12, temperature=1.0)
    assert a[0] == b[0] and a[1] is None
    assert not forced.graphs and forced.describe() == "static KV cache (eager: graph capture failed)"
    assert eager.describe() == "static KV cache (eager)"


def test_compiled_decode_step_decodes_as_eager():
    """torch.compile of the decode step (what a GPU run does by default) changes no token: same seed, same tokens and
    log-probs as the eager forward (fp32 on CPU; compiling takes ~20 s here)."""
    model, tok, eos, prompts = _model_and_prompts()
    compiled = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", compile_step=True)
    eager = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    assert compiled.compile_step and not eager.compile_step  # CPU: off unless asked
    torch.manual_seed(11)
    a = compiled.generate(prompts, max_tokens=12, temperature=0.8)
    torch.manual_seed(11)
    b = eager.generate(prompts, max_tokens=12, temperature=0.8)
    assert compiled.compile_step, compiled.describe()  # it held (a failure falls back and says so)
    assert compiled.describe() == "static KV cache (eager), compiled decode step"
    assert a[0] == b[0]
    diff = max(abs(x - y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
    assert diff < 1e-4, diff


def test_failed_compile_falls_back_to_the_eager_forward(monkeypatch):
    def broken(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("inductor: no C++ compiler")
        return run

    model, tok, eos, prompts = _model_and_prompts()
    monkeypatch.setattr(torch, "compile", broken)
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", compile_step=True)
    eager = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match="torch.compile of the decode step failed .*no C\\+\\+ compiler"):
        a = dec.generate(prompts, max_tokens=10, temperature=1.0)
    torch.manual_seed(2)
    assert a == eager.generate(prompts, max_tokens=10, temperature=1.0)
    assert dec.describe() == "static KV cache (eager) (torch.compile failed)"


def test_sampler_descriptions_and_construction_from_the_spec():
    """Manifests describe the sampler from the spec alone (a lockstep run builds none on the loop's side)."""
    from harness.rollouts.samplers import EmulatedSampler, describe_sampler, make_sampler

    emulated = small_spec('sampler.kind="emulated"', "sampler.noise_scale=0.02")
    assert describe_sampler(emulated) == "emulated sampler (noise 0.02 x tensor std)"
    assert describe_sampler(small_spec('sampler.kind="emulated"', 'sampler.emulation="bfloat16"')) == \
        "emulated sampler (weights rounded to bfloat16)"
    assert describe_sampler(small_spec('sampler.kind="vllm"')) == "vLLM (colocate), gpu_memory_utilization 0.3"
    assert describe_sampler(small_spec()) == "policy"
    model, tok, eos, _ = _model_and_prompts()
    assert make_sampler(small_spec(), model, eos, tok.pad_token_id, "cpu") is None
    built = make_sampler(emulated, model, eos, tok.pad_token_id, "cpu")
    assert isinstance(built, EmulatedSampler) and built.describe() == describe_sampler(emulated)


def test_emulated_sampler_decodes_through_the_static_decoder_where_generation_asks():
    """GENERATION = "static" (a GPU's default is the compiled one): the emulated sampler puts its noise into the
    decoder's copy (the same draws as transformers' path, which keeps its own copy), samples through that decoder,
    and reports each sampled token's log-prob from the decode: equal to a full forward pass of its noised weights,
    and apart from the unnoised policy's. `auto` on CPU keeps transformers' generate."""
    from harness.rollouts.generate import score_completions
    from harness.rollouts.samplers import EmulatedSampler

    model, tok, eos, prompts = _model_and_prompts()
    noisy = ('sampler.kind="emulated"', "sampler.noise_scale=0.05")
    fast = EmulatedSampler(small_spec(*noisy, 'GENERATION="static"'), model, eos, tok.pad_token_id, "cpu")
    slow = EmulatedSampler(small_spec(*noisy), model, eos, tok.pad_token_id, "cpu")
    assert fast.decoder is not None and fast.model is fast.decoder.net and slow.decoder is None
    assert fast.describe() == "emulated sampler (noise 0.05 x tensor std); static KV cache (eager)"
    for _ in range(2):  # the second sync draws new noise, the same on both paths
        fast.sync_weights(model)
        slow.sync_weights(model)
    for (name, a), b, w in zip(fast.model.named_parameters(), slow.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    moved = max(((a - w).norm() / w.norm()).item() for a, w in zip(fast.model.parameters(), model.parameters()))
    assert 0.01 < moved < 0.2
    torch.manual_seed(5)
    completions, logps = fast.generate(prompts)
    assert len(completions) == len(prompts) and [len(c) for c in completions] == [len(lp) for lp in logps]
    torch.manual_seed(5)
    assert (completions, logps) == fast.decoder.generate(prompts, max_tokens=fast.spec.MAX_TOKENS, temperature=1.0)
    own = score_completions(slow.model, prompts, completions, pad_id=tok.pad_token_id, temperature=1.0, device="cpu")
    policy = score_completions(model, prompts, completions, pad_id=tok.pad_token_id, temperature=1.0, device="cpu")
    gap = lambda ref: max(abs(a - b) for ra, rb in zip(logps, ref) for a, b in zip(ra, rb))  # noqa: E731
    assert gap(own) < 1e-5 < 1e-2 < gap(policy)


def test_generation_choice_picks_the_decoder():
    """GENERATION: auto is transformers' generate on CPU and the compiled decoder on a GPU; static and compiled are
    what they say on any device."""
    from harness.rollouts.fastgen import static_decoder_for

    model, tok, eos, _ = _model_and_prompts()
    assert small_spec().decoder(cuda=True) == "compiled" and small_spec().decoder(cuda=False) == "hf"
    assert static_decoder_for(small_spec(), model, eos, tok.pad_token_id, "cpu") is None
    static = static_decoder_for(small_spec('GENERATION="static"'), model, eos, tok.pad_token_id, "cpu")
    compiled = static_decoder_for(small_spec('GENERATION="compiled"'), model, eos, tok.pad_token_id, "cpu")
    assert not static.compile_step and compiled.compile_step
    assert small_spec('GENERATION="compiled"').decoder(cuda=False) == "compiled"


def _fake_cuda_capture(monkeypatch, capture_fails: bool):
    """torch.cuda's stream and graph calls, faked on a CPU machine: the warm-up runs on a "side stream" (here the
    only one); the capture either raises, as an uncapturable model does, or records (here: runs nothing)."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g):
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)


def test_warm_up_counts_as_a_step_when_the_capture_then_fails(monkeypatch):
    """The capture's warm-up is a real decode step: after a failed capture decoding goes on from the next step, and
    the tokens are eager decoding's."""
    model, tok, eos, prompts = _model_and_prompts()
    eager = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", graphs=False)
    torch.manual_seed(4)
    ref = eager.generate(prompts, max_tokens=20, temperature=1.0)
    _fake_cuda_capture(monkeypatch, capture_fails=True)
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", graphs=True)
    torch.manual_seed(4)
    with pytest.warns(UserWarning, match="not permitted when stream is capturing"):
        assert dec.generate(prompts, max_tokens=20, temperature=1.0) == ref
    assert dec.capture_failed


def test_a_failing_warm_up_step_raises_instead_of_stepping_twice(monkeypatch):
    """A decode step that fails on the side stream (out of memory, say) is a failed step, as it would be eagerly:
    it must not be read as a failed capture and the step run again on top of its half-done state."""
    model, tok, eos, prompts = _model_and_prompts()
    _fake_cuda_capture(monkeypatch, capture_fails=False)
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32", graphs=True)
    real, calls = dec._forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prefill, steps 0 and 1, then the warm-up at step 2
            raise torch.OutOfMemoryError("CUDA out of memory (side stream)")
        return real(*args, **kwargs)

    dec._forward = flaky
    with pytest.raises(torch.OutOfMemoryError):
        dec.generate(prompts, max_tokens=20, temperature=1.0)


def test_no_tokens_asked_gives_empty_completions():
    model, tok, eos, prompts = _model_and_prompts()
    dec = StaticDecoder(model, eos_ids=eos, pad_id=tok.pad_token_id, dtype="float32")
    assert dec.generate(prompts[:2], max_tokens=0, temperature=1.0) == ([[], []], [[], []])
    one = dec.generate(prompts[:2], max_tokens=1, temperature=1.0)
    assert [len(c) for c in one[0]] == [1, 1] and [len(lp) for lp in one[1]] == [1, 1]
