"""How far each sampler's log-probs sit from the trainer's, on the same prompts and the same weights (issue 41).

The `is=` cells multiply the loss by a ratio between the trainer's and the sampler's probabilities of the sampled
tokens. Users run vLLM; where vLLM cannot run the harness's own samplers stand in. This tool puts them side by side:
each sampler is synced to the checkpoint's weights, samples the spec's first rounds of prompts (seeded per round,
the same prompts for every sampler), and the trainer scores those completions exactly as the built-in loop takes its
log-probs at generation time (its weights and autocast, `completion_forward`). Printed per sampler: the per-token
delta = logp_trainer - logp_sampler (mean, |delta| percentiles, mean exp|delta|, the share of token ratios outside
[IS_CLIP_MIN, IS_CLIP_MAX]) and the sequence-level summed delta (its spread, the share outside the bounds), as
`core.mismatch_spread` defines them.

Samplers: `vllm` (needs vLLM and a GPU; built last, it keeps its memory), `noise` (the emulated sampler with
noise 0.02 x each tensor's std: the `is=` cells' stand-in until 2026-12-07), `bfloat16` (the emulated sampler with
only the weights rounded to bf16 as an inference engine holds them: the matrix's `is=` stand-in, calibrated against
vLLM with this tool, docs/benchmarks.md), `policy` (the trainer's own weights through the
harness's decoder: the log-probs the decode itself computes, against the training forward); `noise@0.003` is the
noise stand-in at another scale, to calibrate it against vLLM's figures.

    python tools/sampler_mismatch.py --spec harness/specs/default.toml --set 'DEVICE="cuda"' \
        --set 'DTYPE="bfloat16"' --samplers noise,bfloat16,vllm --rounds 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLERS = ("policy", "bfloat16", "noise", "vllm")


def sampler_spec(spec, name: str):
    """The spec with `sampler` set as `name` says (the matrix's own settings for the emulated stand-in)."""
    from harness.diagnose.matrix import EMULATED_NOISE
    from harness.diagnose.preflight import apply_alignment

    if name.startswith("noise@"):  # noise@0.003: the noise stand-in at another scale (to calibrate it)
        return apply_alignment(spec, {"set": {"sampler.kind": "emulated", "sampler.emulation": "noise",
                                              "sampler.noise_scale": float(name[6:])}, "set_trl": {}})
    sets = {"policy": {"sampler.kind": "policy"},
            "bfloat16": {"sampler.kind": "emulated", "sampler.emulation": "bfloat16"},
            "noise": {"sampler.kind": "emulated", "sampler.emulation": "noise", "sampler.noise_scale": EMULATED_NOISE},
            "vllm": {"sampler.kind": "vllm"}}[name]
    return apply_alignment(spec, {"set": sets, "set_trl": {}})


def measure(spec, names: list[str], rounds: int, log=print) -> dict:
    """{sampler name: mismatch_spread figures + seconds}, each sampler on the same prompts and weights."""
    import torch

    from harness.experiment.data import encode_prompts, load_rows, prompt_schedule, to_prompt_rows
    from harness.experiment.models import (autocast_for, checkpoint_dir, eos_token_ids, load_model, load_tokenizer,
                                           resolve_device)
    from harness.rollouts.fastgen import static_decoder_for
    from harness.rollouts.generate import pad_left, pad_right
    from harness.rollouts.samplers import make_sampler
    from scratch_grpo import core
    from scratch_grpo.train import completion_forward

    device = resolve_device(spec)
    ckpt = checkpoint_dir(spec)
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, spec.MASTER_WEIGHTS, device).eval()
    eos_ids, pad_id = eos_token_ids(model.generation_config, tokenizer), tokenizer.pad_token_id
    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    tokens = encode_prompts(tokenizer, [r["prompt"] for r in rows], spec.MAX_PROMPT_TOKENS)
    schedule = prompt_schedule(len(rows), rounds, spec.PROMPTS_PER_STEP, spec.SEED)
    logp_temperature = 1.0 if spec.LOGP_ON_RAW_LOGITS else spec.TEMPERATURE
    out = {}
    for name in sorted(names, key=lambda n: SAMPLERS.index(n.split("@")[0])):  # vLLM last: its engine keeps its memory
        s_spec = sampler_spec(spec, name)
        t0 = time.perf_counter()
        if name == "policy":
            sampler, decoder = None, static_decoder_for(s_spec, model, eos_ids, pad_id, device)
            if decoder is None:
                log(f"{name}: skipped (no static decoder here: GENERATION resolves to transformers' generate, "
                    "which returns no log-probs)")
                continue
        else:
            sampler = make_sampler(s_spec, model, eos_ids, pad_id, device)
            sampler.sync_weights(model)
        built = time.perf_counter() - t0
        trainer, sampled, masks = [], [], []
        t1 = time.perf_counter()
        for r in range(rounds):
            prompt_ids = [tokens[i] for i in schedule[r] for _ in range(spec.GROUP_SIZE)]
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.startswith("cuda") else []):
                torch.manual_seed(spec.SEED * 7_368_787 + r)  # as a lockstep round is seeded
                if sampler is None:
                    completions, logps = decoder.generate(prompt_ids, max_tokens=spec.MAX_TOKENS,
                                                          temperature=spec.TEMPERATURE, top_p=spec.TOP_P,
                                                          top_k=spec.TOP_K, logprobs=True)
                else:
                    completions, logps = sampler.generate(prompt_ids)
            p_ids, p_mask = (t.to(device) for t in pad_left(prompt_ids, pad_id))
            c_ids, c_mask = (t.to(device) for t in pad_right(completions, pad_id))
            with torch.no_grad(), autocast_for(device, spec.DTYPE):
                lp, _ = completion_forward(model, p_ids, p_mask, c_ids, c_mask, logp_temperature)
            width = spec.MAX_TOKENS
            pad = lambda x, v: torch.nn.functional.pad(x.float(), (0, width - x.size(1)), value=v)  # noqa: E731
            trainer.append(pad(lp, 0.0))
            sampled.append(pad(pad_right(logps, 0.0, dtype=torch.float32)[0].to(device), 0.0))
            masks.append(pad(c_mask, 0.0))
        figures = core.mismatch_spread(torch.cat(trainer), torch.cat(sampled), torch.cat(masks),
                                       spec.IS_CLIP_MIN or None, spec.IS_CLIP_MAX)
        figures.update(build_s=round(built, 2), sample_and_score_s=round(time.perf_counter() - t1, 2),
                       describe=(decoder.describe() if sampler is None else sampler.describe()))
        out[name] = figures
        log(f"{name}: {figures['tokens']} tokens, {figures['sequences']} sequences, {figures['sample_and_score_s']} s")
        del sampler
        if device.startswith("cuda") and name != "vllm":
            torch.cuda.empty_cache()
    return out


def table(results: dict, spec) -> str:
    lo = f"{spec.IS_CLIP_MIN:g}" if spec.IS_CLIP_MIN else "0"
    head = ("| sampler | tokens | mean delta | abs p50 | abs p90 | abs p99 | abs max | mean exp abs | tokens outside "
            f"[{lo}, {spec.IS_CLIP_MAX:g}] | seq sum std | seq abs p90 | seq abs max | sequences outside |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, f in results.items():
        if not f.get("tokens"):
            lines.append(f"| {name} | 0 | | | | | | | | | | | |")
            continue
        lines.append(f"| {name} | {f['tokens']} | {f['mean']:.2e} | {f['abs_p50']:.2e} | {f['abs_p90']:.2e} | "
                     f"{f['abs_p99']:.2e} | {f['abs_max']:.2e} | {f['token_mult_prob_error']:.5f} | "
                     f"{100 * f['token_out']:.2f}% | {f['seq_std']:.2e} | {f['seq_abs_p90']:.2e} | "
                     f"{f['seq_abs_max']:.2e} | {100 * f['seq_out']:.2f}% |")
    return "\n".join(lines)


def _noise_at(name: str) -> bool:
    try:
        return name.startswith("noise@") and float(name[6:]) >= 0
    except ValueError:
        return False


def main(argv=None) -> int:
    from harness.experiment.spec import SpecError, load_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--samplers", default="bfloat16,noise,vllm",
                    help=f"comma-separated, of {', '.join(SAMPLERS)}, or noise@SCALE (default: bfloat16,noise,vllm)")
    ap.add_argument("--rounds", type=int, default=4, help="generation rounds of the spec's prompts (default 4)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.samplers.split(",") if n.strip()]
    bad = [n for n in names if n not in SAMPLERS and not _noise_at(n)]
    if bad or not names:
        ap.error(f"--samplers: {', '.join(bad) or 'none given'}: each one of {', '.join(SAMPLERS)}")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    try:
        spec = load_spec(args.spec, args.set)
    except SpecError as e:
        ap.error(str(e))
    if "vllm" in names:
        from harness.rollouts.samplers import vllm_available

        if not vllm_available():
            ap.error("--samplers vllm needs vLLM, which is not installed here (pip install -e '.[vllm]' on a GPU)")
    results = measure(spec, names, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{spec.NAME}, {spec.DTYPE}, {args.rounds} rounds of {spec.PROMPTS_PER_STEP} x {spec.GROUP_SIZE}, "
          f"{spec.MAX_TOKENS} tokens at most; delta = logp_trainer - logp_sampler")
    print(table(results, spec))
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec.NAME, "dtype": spec.DTYPE, "rounds": args.rounds,
                                               "samplers": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
