"""`python -m harness`: the command line.

Exit codes: 0 success, 1 a run or check failed, 2 bad input (spec, data, model path), refused
before any model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

# Nothing here may reach a network: no hub downloads, no telemetry.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# deprecation notices between TRL and transformers (e.g. gradient vs activation checkpointing) are not the
# user's to act on; the CLI keeps its output for the user's own run
warnings.filterwarnings("ignore", category=FutureWarning)


class InputError(ValueError):
    """Bad input found before any model loads (exit 2)."""


def check_inputs(spec) -> None:
    """Everything that can be checked without loading weights: data rows, model paths, TRL fields."""
    from harness.data import DataError, load_rows, to_prompt_rows
    from harness.models import ModelSourceError

    try:
        to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
        if spec.data.source == "synthetic":
            from harness.embedded import vocabulary

            vocabulary(spec.data.max_operand, list(spec.data.operations))
        if spec.model.source == "local" and not (Path(spec.model.path).expanduser() / "config.json").exists():
            raise ModelSourceError(f"model.path: {spec.model.path} is not a checkpoint directory (no config.json)")
    except (DataError, ModelSourceError, ValueError) as e:
        raise InputError(str(e)) from None


def _load(args):
    from harness.spec import load_spec

    spec = load_spec(args.spec, args.set)
    if getattr(args, "steps", None):
        from harness.spec import parse_spec

        raw = spec.to_dict()
        raw["STEPS"] = args.steps
        spec = parse_spec(raw)
    return spec


def cmd_run(args) -> int:
    spec = _load(args)
    check_inputs(spec)
    if args.side == "trl":
        from trl_runner.translate import translate

        translate(spec)  # refuses unknown [trl] fields before any model loads
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.side == "scratch":
        from scratch_grpo.train import train

        train(spec, out, progress=not args.quiet)
    else:
        from trl_runner.runner import train

        train(spec, out, progress=not args.quiet)
    print(f"{args.side}: {spec.STEPS} steps in {time.perf_counter() - t0:.1f} s -> {out / 'metrics.jsonl'}")
    return 0


def cmd_parity(args) -> int:
    """Both loops on one spec, side by side. Lockstep (default): one sampler's rollouts feed both loops, so any
    difference comes from the two implementations; free: each loop samples its own completions.
    (The toggle matrix, comparator and verdict build on this: see the parity issue.)"""
    spec = _load(args)
    check_inputs(spec)
    from trl_runner.translate import format_mapping, translate

    translation = translate(spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from harness.summary import side_by_side
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    print(f"spec {args.spec} ({spec.NAME}): {spec.STEPS} steps, mode {args.mode}")
    print(format_mapping([r for r in translation.table if r["check"] != "other"]))
    scratch_source = trl_source = None
    if args.mode == "lockstep":
        from harness.lockstep import ROLLOUTS_FILE, RecordingSource, ReplaySource
        from harness.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer, resolve_device

        ckpt = checkpoint_dir(spec)
        tok = load_tokenizer(ckpt)
        eos = eos_token_ids(load_model(ckpt, "float32", "cpu"), tok)
        scratch_source = RecordingSource(spec, eos, tok.pad_token_id, resolve_device(spec), out / ROLLOUTS_FILE)
    timings = {}
    print(f"[scratch] {spec.STEPS} steps -> {out / 'scratch'}", flush=True)
    t0 = time.perf_counter()
    train_scratch(spec, out / "scratch", rollout_source=scratch_source, progress=not args.quiet)
    timings["scratch"] = time.perf_counter() - t0
    if scratch_source is not None:
        trl_source = ReplaySource(scratch_source.records)
    print(f"[trl] {spec.STEPS} steps -> {out / 'trl'}", flush=True)
    t0 = time.perf_counter()
    train_trl(spec, out / "trl", rollout_source=trl_source, progress=not args.quiet, lockstep=trl_source is not None)
    timings["trl"] = time.perf_counter() - t0
    text = side_by_side(out / "scratch", out / "trl", timings)
    (out / "summary.txt").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwrote {out / 'summary.txt'}, {out / 'scratch' / 'metrics.jsonl'}, {out / 'trl' / 'metrics.jsonl'}")
    return 0


def cmd_spec_help(args) -> int:
    from harness.spec import describe_fields

    print(describe_fields())
    return 0


def cmd_validate(args) -> int:
    spec = _load(args)
    check_inputs(spec)
    from trl_runner.translate import translate

    translate(spec)
    print(f"{args.spec}: ok ({spec.NAME}: {spec.STEPS} steps, {spec.PROMPTS_PER_STEP} prompts x {spec.GROUP_SIZE} "
          f"completions per step, {spec.GRAD_ACCUM} micro-batches)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description=(
        "GRPO parity harness: run a hand-written GRPO loop and TRL's GRPOTrainer from one spec, log every step, "
        "and compare them."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_args(sp, out_default=None):
        sp.add_argument("--spec", required=True, help="experiment spec (TOML), e.g. harness/specs/default.toml")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field (TOML value), e.g. --set STEPS=5 --set model.layers=1")
        if out_default is not False:
            sp.add_argument("--out", required=out_default is None, default=out_default, help="output folder")

    r = sub.add_parser("run", help="train one loop (scratch or trl) and write its metric log")
    r.add_argument("side", choices=("scratch", "trl"), help="which loop")
    spec_args(r)
    r.add_argument("--steps", type=int, help="override STEPS")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    pa = sub.add_parser("parity", help="run both loops on one spec and show their metrics side by side")
    spec_args(pa, out_default="runs/parity")
    pa.add_argument("--steps", type=int, help="override STEPS")
    pa.add_argument("--mode", choices=("lockstep", "free"), default="lockstep",
                    help="lockstep: both loops get the same rollouts (default); free: each samples its own")
    pa.add_argument("--quiet", action="store_true", help="no progress bar")
    pa.set_defaults(func=cmd_parity)

    v = sub.add_parser("validate", help="check a spec, its data and its TRL translation without loading a model")
    spec_args(v, out_default=False)
    v.set_defaults(func=cmd_validate)

    h = sub.add_parser("spec-help", help="list every spec field with its default and meaning")
    h.set_defaults(func=cmd_spec_help)
    return p


def main(argv: list[str] | None = None) -> int:
    from harness.spec import SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
