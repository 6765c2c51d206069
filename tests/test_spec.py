"""Spec validation: bad input is refused before any model loads, naming the key and what is allowed."""

import subprocess
import sys

import pytest

from conftest import DEFAULT_SPEC, LESSON_SPEC, ROOT, small_spec
from harness.experiment.spec import SpecError, load_spec, parse_spec


def test_shipped_specs_load():
    default, lesson = load_spec(DEFAULT_SPEC), load_spec(LESSON_SPEC)
    assert default.model.source == "embedded" and default.DEVICE == "cpu"
    assert (lesson.GROUP_SIZE, lesson.PROMPTS_PER_STEP, lesson.GRAD_ACCUM, lesson.MAX_TOKENS) == (8, 8, 4, 512)
    assert (lesson.LR, lesson.ADAM_BETA2, lesson.CLIP_LOW, lesson.CLIP_HIGH, lesson.BETA) == (1e-6, 0.98, 0.2, 0.28, 0.0)
    assert lesson.sampler.kind == "vllm" and lesson.sampler.vllm_gpu_memory_utilization == 0.30
    assert lesson.DTYPE == "bfloat16" and lesson.model.path == str(ROOT / "models" / "Qwen3-0.6B")


def test_paths_in_a_spec_are_relative_to_its_folder_and_set_paths_to_the_cwd(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    (folder / "ckpt").mkdir(parents=True)
    text = DEFAULT_SPEC.read_text().replace('source = "embedded"', 'source = "local"\npath = "ckpt"')
    text = text.replace('source = "synthetic"', 'source = "file"\npath = "data/train.jsonl"')
    spec_path = folder / "spec.toml"
    spec_path.write_text(text + '\n[loop]\ncwd = "."\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # another working directory: the file's paths still mean its folder
    spec = load_spec(spec_path)
    assert (spec.model.path, spec.data.path, spec.loop.cwd) == \
        (str(folder / "ckpt"), str(folder / "data" / "train.jsonl"), str(folder))
    absolute = tmp_path / "abs.parquet"
    typed = load_spec(spec_path, ['model.path="mine"', f'data.path="{absolute}"', 'loop={cwd = "run"}'])
    assert (typed.model.path, typed.data.path, typed.loop.cwd) == \
        (str(elsewhere / "mine"), str(absolute), str(elsewhere / "run"))  # --set: the working directory
    assert load_spec(spec_path, ['model.path="~/m"']).model.path == "~/m"  # a home path is absolute: unchanged


@pytest.mark.parametrize("override, key, words", [
    ("GROUP_SIZ=4", "GROUP_SIZ", "did you mean GROUP_SIZE"),
    ("model.layer=2", "model.layer", "did you mean model.layers"),
    ("STEPS=\"ten\"", "STEPS", "must be an integer"),
    ("STEPS=true", "STEPS", "must be an integer"),
    ("LR=-1.0", "LR", "must be > 0"),
    ("TOP_P=1.5", "TOP_P", "must be <= 1"),
    ("GROUP_SIZE=1", "GROUP_SIZE", ">= 2"),
    ("LOSS_NORM=\"tokens\"", "LOSS_NORM", "must be one of"),
    ("GRAD_ACCUM=3", "GRAD_ACCUM", "does not divide"),
    ("rewards.functions=[\"correctness\", \"nope\"]", "rewards.functions[1]", "unknown reward"),
    ("rewards.weights=[1.0]", "rewards.weights", "one weight per function"),
    ("IS_CORRECTION=true", "IS_CORRECTION", "separate sampler"),
    ("DTYPE=\"float16\"", "DTYPE", "must be one of"),  # bfloat16 runs on a CPU too (slowly): test_precision.py
    ("model.source=\"local\"", "model.path", "required"),
    ("data.operations=[\"/\"]", "data.operations[0]", "must be one of"),
    ("model=3", "model", "must be a table"),
    ("ADV_STATS_DTYPE=\"bfloat16\"", "ADV_STATS_DTYPE", "must be one of"),
    ("ADV_RENORM=\"sequences\"", "ADV_RENORM", "must be one of"),
    ("ADV_CLAMP=-1.0", "ADV_CLAMP", "must be >= 0"),
    ("DROP_ZERO_ADV=1", "DROP_ZERO_ADV", "must be"),
    ("ADV_MICRO_BATCH_MEAN=\"yes\"", "ADV_MICRO_BATCH_MEAN", "must be"),
    ("ACCUM_DIVISOR=-8.0", "ACCUM_DIVISOR", "must be >= 0"),
])
def test_bad_values_name_the_key(override, key, words):
    with pytest.raises(SpecError) as err:
        load_spec(DEFAULT_SPEC, [override])
    assert err.value.key == key
    assert words in str(err.value)


def test_every_field_is_documented():
    import dataclasses

    from harness.experiment.spec import Spec, _TABLES

    for cls in (Spec, *_TABLES.values()):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_top_level_key_under_a_table_is_explained():
    with pytest.raises(SpecError, match="CLIP_HIGH is a top-level key: move it above"):
        parse_spec({"rewards": {"CLIP_HIGH": 0.3}})


def test_parse_spec_roundtrip():
    spec = small_spec("LOSS_NORM=\"token_global\"")
    again = parse_spec(spec.to_dict())
    assert again == spec


def run_cli(*args, env_cache):
    import os

    env = {**os.environ, "GRPO_PARITY_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_spec_error_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("CLIP_HIHG = 0.3\n" + DEFAULT_SPEC.read_text())
    cache = tmp_path / "cache"
    r = run_cli("run", "scratch", "--spec", str(bad), "--out", str(tmp_path / "out"), env_cache=cache)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CLIP_HIHG" in lines[0] and "CLIP_HIGH" in lines[0], r.stderr
    assert not cache.exists(), "a bad spec must be refused before any model is built"
    assert not (tmp_path / "out").exists()


def test_cli_trl_field_missing_names_field_and_version(tmp_path):
    import trl

    bad = tmp_path / "bad.toml"
    bad.write_text(DEFAULT_SPEC.read_text() + "\n[trl]\nmax_prompt_length = 256\n")
    cache = tmp_path / "cache"
    r = run_cli("run", "trl", "--spec", str(bad), "--out", str(tmp_path / "out"), env_cache=cache)
    assert r.returncode == 2
    assert "trl.max_prompt_length" in r.stderr and trl.__version__ in r.stderr and "MAX_PROMPT_TOKENS" in r.stderr
    assert not cache.exists()


def test_cli_steps_flag_is_validated_like_the_spec(tmp_path):
    r = run_cli("run", "scratch", "--spec", str(DEFAULT_SPEC), "--out", str(tmp_path / "o"), "--steps", "0",
                env_cache=tmp_path / "cache")
    assert r.returncode == 2 and "STEPS: must be >= 1" in r.stderr


def test_cli_help_lists_subcommands(tmp_path):
    r = run_cli("--help", env_cache=tmp_path)
    assert r.returncode == 0
    for sub in ("run", "parity", "validate", "spec-help"):
        assert sub in r.stdout


def test_dropping_a_token_without_its_id_is_no_difference():
    """MASK_TOKEN_DROP acts on the token MASK_TOKEN_ID names: without one it changes nothing, and the preflight names
    no difference for it (a search may try the drop on its own; that run is the spec's)."""
    from harness.diagnose.preflight import preflight

    checks = lambda spec: {d.check for d in preflight(spec)[1]}  # noqa: E731
    assert "quirk:MASK_TOKEN_DROP" not in checks(load_spec(DEFAULT_SPEC, ["MASK_TOKEN_DROP=true"]))
    assert "quirk:MASK_TOKEN_DROP" in checks(load_spec(DEFAULT_SPEC, ["MASK_TOKEN_DROP=true", "MASK_TOKEN_ID=0"]))


def test_a_constant_accumulation_divisor_needs_a_loss_divided_by_the_micro_batches():
    """ACCUM_DIVISOR replaces the micro-batches' number: with a loss that does not divide by it (dapo's step tokens,
    a sum, LOSS_DIVISOR's constant) the field is named, and the fix; with grpo's it is taken."""
    for other in ('LOSS_NORM="token_global"', "LOSS_SUM=true", "LOSS_DIVISOR=16.0"):
        with pytest.raises(SpecError) as err:
            load_spec(DEFAULT_SPEC, ["ACCUM_DIVISOR=8.0", other])
        assert err.value.key == "ACCUM_DIVISOR" and "set ACCUM_DIVISOR = 0" in str(err.value), (other, err.value)
    spec = load_spec(DEFAULT_SPEC, ["ACCUM_DIVISOR=8.0", "ADV_MICRO_BATCH_MEAN=true"])
    assert (spec.ACCUM_DIVISOR, spec.ADV_MICRO_BATCH_MEAN) == (8.0, True)


def test_float16_statistics_need_the_groups_own_mean():
    """ADV_STATS_DTYPE = "float16" is written for a group-mean baseline: with leave-one-out the field is named, and
    the fix."""
    with pytest.raises(SpecError) as err:
        load_spec(DEFAULT_SPEC, ['ADV_STATS_DTYPE="float16"', 'ADV_BASELINE="loo"'])
    assert err.value.key == "ADV_STATS_DTYPE" and 'ADV_BASELINE = "group"' in str(err.value)
    spec = load_spec(DEFAULT_SPEC, ['ADV_STATS_DTYPE="float16"', 'ADV_RENORM="tokens"', "ADV_CLAMP=2.0",
                                    "DROP_ZERO_ADV=true"])
    assert (spec.ADV_STATS_DTYPE, spec.ADV_RENORM, spec.ADV_CLAMP, spec.DROP_ZERO_ADV) == ("float16", "tokens", 2.0, True)
