"""Shared test set-up: offline, a private model cache per session, and small specs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import cpu_arithmetic  # noqa: E402 - before anything imports torch

cpu_arithmetic.pin()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = ROOT / "harness" / "specs" / "default.toml"
LESSON_SPEC = ROOT / "harness" / "specs" / "lesson.toml"


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Build the embedded model into a per-session cache, never the user's."""
    path = tmp_path_factory.mktemp("grpo_parity_cache")
    old = os.environ.get("GRPO_PARITY_CACHE")
    os.environ["GRPO_PARITY_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("GRPO_PARITY_CACHE", None)
    else:
        os.environ["GRPO_PARITY_CACHE"] = old


def small_spec(*overrides: str):
    """The default spec, shortened for tests, with KEY=VALUE overrides."""
    from harness.experiment.spec import load_spec

    return load_spec(DEFAULT_SPEC, ["STEPS=4", *overrides])


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run on a machine with CUDA only (the GPU test machine); elsewhere they skip, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU test machine (see docs/benchmarks.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
