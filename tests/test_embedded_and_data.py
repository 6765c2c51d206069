"""The offline default (determinism, TRL-compatible tokenizer) and the data loaders on small local files."""

import json
import os

import pytest
import torch

from conftest import small_spec
from harness.experiment import data as D
from harness.experiment import embedded as E
from harness.experiment.models import checkpoint_dir, load_model, load_tokenizer


def test_same_seed_same_weights_other_seed_other_weights():
    spec = small_spec()
    tok = E.build_tokenizer(9, ["+"])
    a = E.build_model(spec.model, tok).state_dict()
    b = E.build_model(spec.model, tok).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = E.build_model(small_spec("model.init_seed=99").model, tok).state_dict()
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_building_the_model_does_not_move_the_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    E.build_model(small_spec().model, E.build_tokenizer(9, ["+"]))
    assert torch.equal(torch.rand(3), expected)


def test_cached_checkpoint_loads_back_identically():
    spec = small_spec()
    path = checkpoint_dir(spec)
    assert (path / "model.safetensors").exists() and checkpoint_dir(spec) == path  # built once
    loaded = load_model(path, "float32", "cpu").state_dict()
    built = E.build_model(spec.model, E.build_tokenizer(9, ["+"])).state_dict()
    assert all(torch.equal(loaded[k], built[k]) for k in built)


def test_tokenizer_chat_template_and_roundtrip():
    tok = load_tokenizer(checkpoint_dir(small_spec()))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4 ?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|> user What is 3 + 4 ?") and text.endswith("<|im_start|> assistant")
    assert tok.unk_token_id not in ids
    assert tok.decode(tok("#### 7 <|im_end|>")["input_ids"], skip_special_tokens=True) == "#### 7"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>" and tok.padding_side == "left"


def test_synthetic_rows_are_seeded_and_gsm8k_shaped():
    a = E.synthetic_rows(50, 3, 9, ["+", "-", "*"])
    assert a == E.synthetic_rows(50, 3, 9, ["+", "-", "*"])
    assert a != E.synthetic_rows(50, 4, 9, ["+", "-", "*"])
    for row in a:
        q = row["question"].split()
        x, op, y = int(q[2]), q[3], int(q[4])
        expected = x + y if op == "+" else x - y if op == "-" else x * y
        assert row["answer"].endswith(f"#### {expected}")


def test_vocabulary_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="lower data.max_operand"):
        E.vocabulary(999, ["*"])


def test_jsonl_and_parquet_files(tmp_path):
    import pandas as pd

    rows = [{"question": "Q1?", "answer": "a\n#### 1,000"}, {"question": "Q2?", "answer": "#### -3"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(pq)
    for path in (jl, pq):
        spec = small_spec("data.source=\"file\"", f"data.path=\"{path}\"")
        out = D.to_prompt_rows(D.load_rows(spec.data), "Answer with #### N.")
        assert [r["answer"] for r in out] == ["1,000", "-3"]
        assert out[0]["prompt"] == [{"role": "system", "content": "Answer with #### N."},
                                    {"role": "user", "content": "Q1?"}]
        assert [r["prompt_idx"] for r in out] == [0, 1]


@pytest.mark.parametrize("rows, words", [
    ([], "empty"),
    ([{"question": "Q?"}], "row 0: missing or empty `answer`"),
    ([{"question": "Q?", "answer": "#### 1"}, {"answer": "#### 2"}], "row 1: missing or empty `question`"),
    ([{"question": "Q?", "answer": "42"}], "row 0: `answer` has no `#### N`"),
    (["just text"], "row 0: expected an object"),
])
def test_bad_rows_name_the_row(rows, words):
    with pytest.raises(D.DataError, match=words.replace("`", ".").replace("?", ".")):
        D.to_prompt_rows(rows)


def test_bad_file_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "Q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(D.DataError, match="bad.jsonl:2"):
        D.read_file_rows(p)
    (tmp_path / "x.csv").write_text("question,answer\n")
    with pytest.raises(D.DataError, match="must end in .jsonl or .parquet"):
        D.read_file_rows(tmp_path / "x.csv")


def test_prompt_schedule_is_seeded_epochs_and_prefix_stable():
    s = D.prompt_schedule(10, 6, 4, seed=1)
    flat = [i for block in s for i in block]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # whole epochs
    assert s == D.prompt_schedule(10, 6, 4, seed=1)
    assert s != D.prompt_schedule(10, 6, 4, seed=2)
    assert D.prompt_schedule(10, 12, 4, seed=1)[:6] == s  # a longer schedule starts with the shorter one
    assert D.hash_prompt_ids([1, 2, 3]) != D.hash_prompt_ids([1, 3, 2])  # order matters


def test_shaped_embedded_model_head_dim_and_padded_vocabulary():
    """The fields that give the embedded model Qwen3-0.6B's shape (here scaled down): head_dim independent of
    hidden / heads, a vocabulary padded with unused tokens, a longer position range."""
    spec = small_spec("model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
                      "model.vocab_size=600", "model.max_positions=1024")
    path = checkpoint_dir(spec)
    assert path != checkpoint_dir(small_spec())
    tok, model = load_tokenizer(path), load_model(path, "float32", "cpu")
    assert len(tok) == 600 and model.config.vocab_size == 600
    assert model.config.head_dim == 16 and model.model.layers[0].self_attn.q_proj.out_features == 4 * 16
    assert model.config.max_position_embeddings == 1024
    assert tok.decode([599]) == "<|unused_" + str(600 - len(E.vocabulary(9, ["+"])) - 1) + "|>"
    assert tok.convert_tokens_to_ids("####") == E.vocabulary(9, ["+"]).index("####")  # real words keep their ids


def test_vocab_size_below_the_tokenizer_is_refused_before_loading(tmp_path):
    from harness.cli import InputError, check_inputs

    with pytest.raises(ValueError, match="model.vocab_size = 10"):
        E.padded_vocabulary(9, ["+"], 10)
    with pytest.raises(InputError, match="model.vocab_size"):
        check_inputs(small_spec("model.vocab_size=10"))


def test_a_small_model_on_a_cpu_trains_on_one_thread(monkeypatch):
    """The embedded default's ops are too small to split: two threads gain nothing on an idle machine and spin
    against any other busy process (a run 4x slower); OMP_NUM_THREADS set by the user wins."""
    before = torch.get_num_threads()
    ckpt = checkpoint_dir(small_spec())
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        load_model(ckpt, "float32", "cpu")
        assert torch.get_num_threads() == 2  # the user's word
        monkeypatch.delenv("OMP_NUM_THREADS")
        load_model(ckpt, "float32", "cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_torch_compile_keeps_what_it_builds_in_the_harness_cache(monkeypatch, tmp_path):
    """By default the first torch.compile of a run points inductor's on-disk cache at GRPO_PARITY_CACHE/inductor,
    which a reboot does not empty (torch's default is under /tmp), unless the user chose TORCHINDUCTOR_CACHE_DIR;
    GRPO_PARITY_COMPILE_CACHE=torch leaves torch's default."""
    from harness.experiment.models import CompileOnFirstCall

    monkeypatch.setenv("GRPO_PARITY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # what matters is where the cache goes, not inductor
    monkeypatch.setenv("GRPO_PARITY_COMPILE_CACHE", "torch")  # opted out: torch's own folder, untouched
    assert CompileOnFirstCall(lambda x: x, "f", "plain")(1) == 1 and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.delenv("GRPO_PARITY_COMPILE_CACHE")  # the default (checked on an H100: a second run loads from it)
    double = CompileOnFirstCall(lambda x: 2 * x, "a test function", "the plain function serves")
    assert double(3) == 6 and double.state == "ok"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    CompileOnFirstCall(lambda x: x, "another", "plain")(1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # torch's own default, which importing transformers or TRL writes into the variable, is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cache_dir() == os.path.abspath(default_cache_dir()) == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    CompileOnFirstCall(lambda x: x, "after torch's", "plain")(1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
