"""Labels say what ran: dtype, autocast or not, device, the model and a hash of its weights; an fp32 run is never
called "bf16 autocast" (mapping table, manifests, verdict, report, bench, spec-help)."""

import json

from conftest import small_spec
from harness.experiment.models import checkpoint_dir, precision_words, run_label, weights_hash
from harness.experiment.spec import describe_fields
from trl_runner.translate import translate


def _dtype_row(spec):
    return next(r for r in translate(spec).table if r["scratch"] == "DTYPE / DEVICE")


def test_an_fp32_run_is_not_labelled_bf16_autocast():
    assert "autocast" in _dtype_row(small_spec())["note"] and "bf16" not in _dtype_row(small_spec())["note"]
    assert _dtype_row(small_spec())["note"] == "fp32 compute (no autocast), fp32 weights, on both sides"
    bf16 = small_spec('DTYPE="bfloat16"', 'DEVICE="cuda"')
    assert _dtype_row(bf16)["note"] == "bf16 autocast, fp32 master weights, on both sides"
    assert precision_words("bfloat16", "bfloat16") == "bf16 autocast, bf16 weights (no fp32 master copy)"


def test_spec_help_says_what_dtype_does_on_each_side():
    text = describe_fields()
    dtype = text.split("\n  DTYPE =")[1].split("\n  DEVICE")[0]  # (not LOGITS_DTYPE, ADV_STATS_DTYPE)
    assert "master weights in bf16" not in dtype  # both sides keep the weights in MASTER_WEIGHTS' dtype
    assert "autocast" in dtype and "bf16=True" in dtype and "MASTER_WEIGHTS" in dtype


def test_run_label_names_dtype_device_model_and_weights_hash():
    spec = small_spec()
    ckpt = checkpoint_dir(spec)
    label = run_label(spec, "cpu")
    assert label["checkpoint"] == str(ckpt) and label["weights_hash"] == weights_hash(ckpt)
    assert len(label["weights_hash"]) == 12 and label["autocast"] is False and label["device"] == "cpu"
    assert label["text"].startswith("DTYPE float32: fp32 compute (no autocast), fp32 weights; cpu; model embedded")
    assert label["weights_hash"] in label["text"]
    other = small_spec("model.init_seed=99")  # other weights, same shapes: another hash
    assert weights_hash(checkpoint_dir(other)) != label["weights_hash"]


def test_manifests_verdict_and_report_say_what_ran(tmp_path):
    from harness.diagnose.matrix import run_matrix
    from harness.diagnose.verdict import format_verdict
    from reports.render import write_parity_report

    spec = small_spec("STEPS=1")
    doc = run_matrix(spec, tmp_path, "none", log=lambda *_: None)
    text = doc["ran"]["text"]
    assert "fp32 compute (no autocast)" in text and "CPU" in text and doc["ran"]["weights_hash"] in text
    assert f"ran: {text}" in format_verdict(doc).splitlines()[1]
    for side in ("scratch", "trl"):
        manifest = json.loads((tmp_path / "as-given" / side / "manifest.json").read_text())
        assert manifest["ran"]["weights_hash"] == doc["ran"]["weights_hash"] and manifest["ran"]["dtype"] == "float32"
    html = write_parity_report(tmp_path).read_text()
    assert 'id="ran"' in html and doc["ran"]["weights_hash"] in html and "bf16 autocast" not in html
