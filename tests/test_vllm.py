"""`sampler.kind = "vllm"`: TRL on vLLM's completions and log-probs in lockstep (issue 41).

On CPU (CI): the plumbing around the engine, with the emulated sampler standing where vLLM's engine would be, so
the test runs without vLLM. The GPU tests run where vLLM and CUDA are (tools/gpu_vllm.sh); elsewhere they skip."""

import json

import pytest

from conftest import small_spec
from harness.diagnose.pairs import run_pair
from harness.rollouts.samplers import vllm_available


def test_lockstep_on_vllm_replays_its_log_probs_into_trl_without_an_engine_of_trls_own(tmp_path, monkeypatch):
    """In lockstep the scratch side samples (vLLM, here the emulated sampler in its place) and records the sampler's
    log-probs; TRL replays them through rollout_func, builds no vLLM engine of its own (none is installed here: it
    would fail), and applies its IS correction with the recorded log-probs, as the scratch side does: at parity."""
    import harness.rollouts.samplers as samplers
    from harness.diagnose.preflight import apply_alignment

    made = []

    def in_place_of_vllm(spec, policy, eos_ids, pad_id, device):
        assert spec.sampler.kind == "vllm"
        made.append(spec.sampler.kind)
        stand_in = apply_alignment(spec, {"set": {"sampler.kind": "emulated", "sampler.noise_scale": 0.02},
                                          "set_trl": {}})
        return samplers.EmulatedSampler(stand_in, policy, eos_ids, pad_id, device)

    monkeypatch.setattr(samplers, "make_sampler", in_place_of_vllm)
    spec = small_spec('sampler.kind="vllm"', "IS_CORRECTION=true", 'IS_MODE="token_truncate"')
    result = run_pair(spec, tmp_path, "lockstep")
    assert made, "the scratch side did not sample through the sampler"
    assert result["first_divergence"] is None, result["first_divergence"]
    ratio = result["metrics"]["sampling/importance_sampling_ratio/mean"]
    assert ratio["max_abs"] < 1e-5  # both sides weighted by the same recorded log-probs
    from harness.runlog.log import read_run

    trl = read_run(tmp_path / "trl")
    assert trl.attrs["manifest"]["rollouts"] == "external (lockstep)"
    assert (trl["sampling/importance_sampling_ratio/mean"] != 1.0).any()  # TRL did weight: the mismatch is real
    config = trl.attrs["manifest"]["trl_config"]
    assert config["use_vllm"] and config["vllm_mode"] == "colocate"  # what a user's GRPOConfig holds


def test_the_engine_start_variables_are_gone_afterwards(monkeypatch):
    """vLLM's external_launcher reads RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* while its engine starts; a later
    Accelerator in the same process (TRL's side) would take LOCAL_RANK for a distributed launch: they go after."""
    import os

    from harness.rollouts.samplers import _launcher_variables

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")  # one the user set stays as it was
    with _launcher_variables():
        seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert seen["RANK"] == seen["LOCAL_RANK"] == "0" and seen["WORLD_SIZE"] == "1" and int(seen["MASTER_PORT"]) > 0
    assert seen["MASTER_ADDR"] == "10.0.0.7" and os.environ["MASTER_ADDR"] == "10.0.0.7"
    assert not [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT") if k in os.environ]


def _checkpoint(folder, **config):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_name_or_path": str(folder), "hidden_size": 8, **config}))
    return str(folder)


def _engine_loading(load):
    """What VLLMSampler reaches into on a stand-in LLM: llm_engine...model_runner.model.load_weights = `load`."""
    import types

    model = types.SimpleNamespace(load_weights=load)
    return types.SimpleNamespace(model_executor=types.SimpleNamespace(
        driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))))


def _one_token_each(prompts):
    """A stand-in generate's outputs: token 3 at log-prob -0.5 for every prompt."""
    import types

    sample = types.SimpleNamespace(token_ids=[3], logprobs=[{3: types.SimpleNamespace(logprob=-0.5)}])
    return [types.SimpleNamespace(outputs=[sample]) for _ in prompts]


def _use_fake_vllm(monkeypatch, llm_class):
    """`import vllm` gives a module of `llm_class` and a SamplingParams that keeps its fields; no engine built yet."""
    import sys
    import types

    from harness.rollouts import samplers

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = llm_class, lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(samplers, "_ENGINE", {})


def test_the_sampler_keeps_one_engine_seeds_each_request_and_pushes_every_weight(monkeypatch, tmp_path):
    """VLLMSampler's own logic against a recording stand-in for the `vllm` module (the real engine runs on the GPU
    only): the engine is built once per (model shape, dtype, memory share) in a process, whatever checkpoint of that
    shape asks (the weights are pushed before each round), and rebuilt for another; every
    request carries a seed drawn from torch's generator, so a seeded round asks for the same seeds whatever came
    before; each parameter goes to load_weights under its module name, then the prefix cache is reset."""

    import torch

    from harness.rollouts import samplers

    built, loaded, resets, params = [], [], [], []

    class LLM:
        def __init__(self, **kwargs):
            import random

            import numpy as np

            torch.manual_seed(kwargs["seed"])  # as vLLM's worker seeds every generator while the engine starts
            random.seed(kwargs["seed"])
            np.random.seed(kwargs["seed"])
            assert kwargs["distributed_executor_backend"] == "external_launcher"
            assert kwargs["logprobs_mode"] == "processed_logprobs"  # TRL's: log-probs after temperature
            built.append(kwargs)
            self.llm_engine = _engine_loading(lambda pairs: loaded.extend(n for n, _ in pairs))

        def reset_prefix_cache(self):
            resets.append(1)

        def generate(self, prompts, sampling_params, use_tqdm):
            params.append([p.seed for p in sampling_params])
            assert len(sampling_params) == len(prompts)
            return _one_token_each(prompts)

    _use_fake_vllm(monkeypatch, LLM)
    spec = small_spec('sampler.kind="vllm"')  # the default engine: shared

    def draw():  # a lockstep round: seeded, the sampler (and, the first time, the engine) made inside it
        with torch.random.fork_rng():
            torch.manual_seed(7)
            sampler = samplers.VLLMSampler(spec, ckpt)
            return sampler, sampler.generate([[1, 2], [1, 2], [4]])

    ckpt = _checkpoint(tmp_path / "a")

    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    a, first = draw()  # builds the engine, which seeds every generator
    assert random.random() == expected  # Python's generator as it was
    assert first == ([[3]] * 3, [[-0.5]] * 3)
    b = samplers.VLLMSampler(spec, _checkpoint(tmp_path / "b"))  # another checkpoint of the same shape
    assert a.llm is b.llm and len(built) == 1
    a.generate([[1]])
    draw()
    assert params[0] == params[2] and len(set(params[0])) == 3  # the same seeds again, one per request
    samplers.VLLMSampler(small_spec('sampler.kind="vllm"', 'sampler.vllm_engine="shared"',
                                    "sampler.vllm_gpu_memory_utilization=0.5"), ckpt)
    assert len(built) == 2 and built[1]["gpu_memory_utilization"] == 0.5
    samplers.VLLMSampler(spec, _checkpoint(tmp_path / "c", hidden_size=16))  # another shape: another engine
    assert len(built) == 3 and not built[2]["enable_sleep_mode"]
    per_side = small_spec('sampler.kind="vllm"', 'sampler.vllm_engine="per_side"',
                          "sampler.vllm_gpu_memory_utilization=0.5")
    samplers.VLLMSampler(per_side, ckpt)
    samplers.VLLMSampler(per_side, _checkpoint(tmp_path / "d"))  # per side: one engine per checkpoint, as before
    assert len(built) == 5

    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    a.sync_weights(torch.compile(net))  # a compiled module's names carry `_orig_mod.`
    assert loaded == ["0.weight", "0.bias"] and resets == [1]


def test_the_sampler_sleeps_between_generations_as_trl_does(monkeypatch, tmp_path):
    """With sampler.vllm_sleep (TRL's vllm_enable_sleep_mode): the engine sleeps (level 2) once built; a sync wakes
    its weights before pushing them; a generation wakes the KV cache and sleeps again after; TRL's side, calling
    generate while asleep without a sync, gets the weights pushed first (as TRL's own generate does). With
    GPU_MEMORY_GB, the share is of that much memory."""
    import types

    import torch

    from harness.rollouts import samplers

    calls = []

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("build", kwargs["enable_sleep_mode"], kwargs["gpu_memory_utilization"]))
            self.llm_engine = _engine_loading(lambda pairs: calls.append("load"))

        def sleep(self, level):
            calls.append(f"sleep{level}")

        def wake_up(self, tags):
            calls.append("wake:" + ",".join(tags))

        def reset_prefix_cache(self):
            pass

        def generate(self, prompts, sampling_params, use_tqdm):
            calls.append("generate")
            return _one_token_each(prompts)

    _use_fake_vllm(monkeypatch, LLM)
    monkeypatch.setattr(samplers.torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(samplers.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(samplers.torch.cuda, "empty_cache", lambda: None)
    spec = small_spec('sampler.kind="vllm"', "sampler.vllm_sleep=true", "GPU_MEMORY_GB=32")
    sampler = samplers.VLLMSampler(spec, _checkpoint(tmp_path / "a"))
    assert calls == [("build", True, 0.12), "sleep2"]  # 0.3 of 32 GiB on an 80 GiB card
    net = torch.nn.Linear(2, 2)
    sampler.sync_weights(net)
    sampler.generate([[1]])
    assert calls[2:] == ["wake:weights", "load", "load", "wake:kv_cache", "generate", "sleep2"] and sampler.asleep

    from trl_runner.runner import TRLSamplerAdapter

    del calls[:]
    TRLSamplerAdapter(sampler, types.SimpleNamespace(model=net)).generate([[1]])
    assert calls == ["wake:weights", "load", "load", "wake:kv_cache", "generate", "sleep2"]


def test_trl_on_vllm_without_vllm_installed_is_refused_before_any_model_loads(tmp_path, capsys):
    from harness.cli import main

    if vllm_available():
        pytest.skip("vLLM is installed here: this checks the message where it is not")
    assert main(["run", "trl", "--spec", "harness/specs/default.toml", "--set", 'sampler.kind="vllm"',
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "needs vLLM" in err and "pip install -e '.[vllm]'" in err
    assert not (tmp_path / "x").exists()


needs_vllm = pytest.mark.skipif(not vllm_available(), reason="needs vLLM (pip install -e '.[vllm]' on a GPU)")


@pytest.mark.gpu
@needs_vllm
def test_vllm_lockstep_pair_with_the_is_correction_on_both_sides_is_at_parity(tmp_path):
    spec = small_spec("STEPS=6", 'DEVICE="cuda"', 'DTYPE="bfloat16"', 'sampler.kind="vllm"', "model.head_dim=64",
                      "IS_CORRECTION=true")
    result = run_pair(spec, tmp_path, "lockstep")
    assert result["first_divergence"] is None, result["first_divergence"]
    from harness.runlog.log import read_run

    scratch = read_run(tmp_path / "scratch")
    assert scratch.attrs["manifest"]["sampler"].startswith("vLLM (colocate)")
    assert scratch["mismatch/logp_diff/max"].max() > 0  # vLLM's log-probs are its own, not the trainer's


@pytest.mark.gpu
@needs_vllm
def test_vllm_draws_repeat_for_a_seeded_round_whatever_the_engine_drew_before():
    import torch

    from harness.experiment.models import checkpoint_dir, load_model
    from harness.rollouts.samplers import VLLMSampler

    spec = small_spec('DEVICE="cuda"', 'DTYPE="bfloat16"', 'sampler.kind="vllm"', "model.head_dim=64")
    ckpt = checkpoint_dir(spec)
    model = load_model(ckpt, "float32", "cuda")
    prompts = [[5, 6, 7]] * 8

    def draw():  # as a lockstep round: seeded, the sampler made inside it (the engine too, where none is yet)
        with torch.random.fork_rng(devices=[0]):
            torch.manual_seed(1)
            sampler = VLLMSampler(spec, ckpt)
            sampler.sync_weights(model)
            return sampler, sampler.generate(prompts)

    sampler, first = draw()
    sampler.generate(prompts)  # the engine samples in between
    again, second = draw()
    assert again.llm is sampler.llm  # one engine per process
    assert second == first
