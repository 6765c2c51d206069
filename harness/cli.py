"""`python -m harness`: the command line.

Exit codes, a contract (README "Exit codes"): 0 parity or ok, 1 a divergence or differences, 2 bad input (one
line on stderr: the file, the field, what is wrong, the fix; refused before any model loads), 3 a run that could
not finish (interrupted, out of memory, a side or the harness crashed). No traceback unless `--debug`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from harness.runlog.atomic import atomic_write_text

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


def out_dir_problem(path: Path) -> str | None:
    """Why `path` cannot become an output folder (None when it can), found before anything runs, so that a run
    does not end in a traceback after its first step: a file in the way, or a place this user cannot write."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file, so no folder can be made under it"
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        return f"no permission to write in {probe}"
    return None


def make_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """The output folder, made now; a problem with it is bad input (exit 2), not a crash."""
    path = Path(path)
    problem = out_dir_problem(path)
    if problem is None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = f"cannot make {e.filename or path}: {e.strerror}"
    if problem:
        raise InputError(f"{flag} {path}: {problem}; give a folder you can write to")
    return path


def check_out_dir(path: str | Path, flag: str = "--out") -> None:
    """As `make_out_dir`, without making it: for commands whose run makes its own folder."""
    problem = out_dir_problem(Path(path))
    if problem:
        raise InputError(f"{flag} {path}: {problem}; give a folder you can write to")


def check_inputs(spec, samples: bool = True) -> None:
    """Everything that can be checked without loading weights: data rows, model paths, TRL fields; with `samples`
    (a command that runs a side), that the spec's sampler is there."""
    from harness.experiment.data import DataError, load_rows, to_prompt_rows
    from harness.experiment.models import ModelSourceError

    if samples and spec.sampler.kind == "vllm":  # either side: TRL on its own builds its own engine
        from harness.rollouts.samplers import vllm_available

        if not vllm_available():
            raise InputError("sampler.kind = \"vllm\" needs vLLM, which is not installed here: on a GPU machine "
                             "`pip install -e '.[vllm]'`; elsewhere use sampler.kind = \"emulated\" (a stated stand-in)")
    from harness.experiment.rewards import RewardError, check_reward_functions

    try:
        rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
        check_reward_functions(spec, rows)  # your own rewards: imported and called once on two rows
        if spec.data.source == "synthetic" or spec.model.source == "embedded":
            from harness.experiment.embedded import padded_vocabulary

            padded_vocabulary(spec.data.max_operand, list(spec.data.operations),
                              spec.model.vocab_size if spec.model.source == "embedded" else 0)
        if spec.model.source == "local" and not (Path(spec.model.path).expanduser() / "config.json").exists():
            raise ModelSourceError(f"model.path: {spec.model.path} is not a checkpoint directory (no config.json)")
        from harness.experiment.limits import check_limits

        check_limits(spec, rows)  # prompt length against positions, the memory floor against this machine
    except (DataError, ModelSourceError, RewardError, ValueError, OSError) as e:  # OSError: an unreadable checkpoint
        raise InputError(str(e)) from None


def _load(args):
    """The spec with --set overrides, then --steps (and, for `run`, --processes; for `parity`, --loop and
    --against), validated once."""
    from harness.experiment.spec import load_spec

    flags = [f"STEPS={args.steps}"] if getattr(args, "steps", None) is not None else []
    if getattr(args, "loop", None):
        flags.append(f"loop.command={json.dumps(args.loop)}")  # a TOML string, whatever the command holds
    if getattr(args, "against", None):
        flags.append(f"loop.against={json.dumps(args.against)}")
    if getattr(args, "tolerance", None):
        flags.append(f"TOLERANCE={json.dumps(args.tolerance)}")
    if args.command == "run" and getattr(args, "processes", None):  # parity's --processes adds cells instead
        flags.append(f"PROCESSES={args.processes}")
    return load_spec(args.spec, [*args.set, *flags])


def cmd_run(args) -> int:
    spec = _load(args)
    check_out_dir(args.out)
    check_inputs(spec)
    if args.side == "trl":
        from trl_runner.translate import translate

        translate(spec)  # refuses unknown [trl] fields before any model loads
    replay = None
    if args.rollouts:  # replay a recorded lockstep rollout file (a parity cell's rollouts.jsonl, or your own)
        from harness.rollouts.lockstep import ReplaySource

        try:
            replay = ReplaySource.from_file(args.rollouts)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"--rollouts {args.rollouts}: cannot read it ({type(e).__name__}: {e}); give a "
                             "rollouts.jsonl a parity run wrote (one JSON object per round)") from None
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.side == "scratch":
        from scratch_grpo.train import train as run_side

        def train(spec, out, progress):
            return run_side(spec, out, rollout_source=replay, progress=progress, tensor_steps=args.tensor_steps)
    elif spec.PROCESSES > 1:  # torchrun (CPU) or accelerate launch (GPUs), one process each
        from trl_runner.launch import train_processes

        def train(spec, out, progress):
            return train_processes(spec, out, args.rollouts, progress, tensor_steps=args.tensor_steps)
    else:
        from trl_runner.runner import train as run_side

        def train(spec, out, progress):
            return run_side(spec, out, rollout_source=replay, progress=progress, lockstep=replay is not None,
                            tensor_steps=args.tensor_steps)
    from harness.runlog.stops import graceful_stop

    with graceful_stop():
        train(spec, out, progress=not args.quiet)
    print(f"{args.side}: {spec.STEPS} steps in {time.perf_counter() - t0:.1f} s -> {out / 'metrics.jsonl'}")
    return 0


def cmd_tensordiff(args) -> int:
    """Two run folders' tensors (tensors.jsonl: `run --tensor-steps`, or your loop's parity.tensors) on the same
    rollouts, compared link by link along the step's dataflow: the first that differs, where and how."""
    from harness.diagnose.tensordiff import diff_runs, words
    from harness.rollouts.lockstep import ReplaySource
    from harness.runlog.tensors import TENSORS_FILE

    spec = _load(args)
    for run in (args.run_a, args.run_b):
        if not (Path(run) / TENSORS_FILE).exists():
            raise InputError(f"{run}: no {TENSORS_FILE} (run it with --tensor-steps N)")
    try:
        records = ReplaySource.from_file(args.rollouts).records
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"--rollouts {args.rollouts}: cannot read it ({type(e).__name__}: {e})") from None
    found = diff_runs(spec, args.run_a, args.run_b, records)
    if found is None:
        print("no tensor both runs saved at a common step")
        return 2
    for link in found["chain"]:
        print(f"  {link['tensor']:<15} {link['status']}" + (f": {link['how']}" if link.get("how") else ""))
    print(words(found) or f"every tensor both saved agrees at steps {found['steps']}")
    return 0 if found["first"] is None else 1


def check_backend(args) -> None:
    """--backend, --jobs and --ray-address make sense together, and Ray is there when asked for: before any model
    loads (the backend's own checks, raised as BackendError: exit 2)."""
    from harness.diagnose.backends import refuse_world_size_on_jobs, require_ray

    if args.jobs < 1:
        raise InputError(f"--jobs {args.jobs}: at least 1")
    if args.backend == "ray":
        if args.jobs != 1:
            raise InputError("--jobs is for --backend local; with --backend ray the cluster's GPUs (or CPUs) set how "
                             "many runs happen at once: drop --jobs")
        require_ray()
    elif args.ray_address:
        raise InputError("--ray-address is for --backend ray: add --backend ray, or drop --ray-address")
    elif args.jobs > 1:
        refuse_world_size_on_jobs(getattr(args, "processes", 1))


def read_resume(folder: str):
    """The verdict.json and base spec of the run `--resume` continues; a file that is not a parity run's is bad
    input (exit 2), not a KeyError."""
    from harness.experiment.spec import SpecError, parse_spec

    prev = Path(folder) / "verdict.json"
    restart = "start a new run with --spec and another --out"
    if not prev.is_file():
        raise InputError(f"--resume {folder}: no verdict.json there to resume from")
    try:
        doc = json.loads(prev.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--resume {folder}: verdict.json there is not readable JSON ({e}); {restart}") from None
    wrong = ("not a JSON object" if not isinstance(doc, dict) else
             "no base_spec table" if not isinstance(doc.get("base_spec"), dict) else
             f"matrix {doc.get('matrix')!r}" if doc.get("matrix") not in ("none", "default", "full") else
             f"mode {doc.get('mode')!r}" if doc.get("mode") not in ("lockstep", "free") else
             "processes is not a whole number" if not isinstance(doc.get("processes", 1), int) else
             "cells_selected is not a list of names" if not isinstance(doc.get("cells_selected", []), list)
             or not all(isinstance(c, str) for c in doc.get("cells_selected", [])) else None)
    if wrong:
        raise InputError(f"--resume {folder}: verdict.json there is not a parity run's ({wrong}); {restart}")
    try:
        return doc, parse_spec(doc["base_spec"])
    except SpecError as e:
        raise InputError(f"--resume {folder}: verdict.json's base_spec: {e}; {restart}") from None


def cmd_parity(args) -> int:
    """The toggle matrix: each cell runs both loops, compares them, and names the cause of a divergence."""
    if args.resume:
        doc, spec = read_resume(args.resume)
        if args.spec and _load(args).to_dict() != spec.to_dict():  # resuming must not silently start another run
            raise InputError(f"--resume {args.resume}: that run used another spec than {args.spec} (with its --set "
                             "overrides); resume without --spec, or start the new spec with another --out")
        args.out, args.matrix, args.mode = args.resume, doc["matrix"], doc["mode"]
        args.processes = doc.get("processes", 1)
        args.cells = ",".join(doc.get("cells_selected", [])) or None
    elif not args.spec:
        raise InputError("parity needs --spec FILE (or --resume DIR)")
    else:
        spec = _load(args)
    if args.matrix is None:
        args.matrix = "none" if spec.loop.command else "default"
    if spec.loop.command and args.matrix != "none":
        raise InputError("--loop runs with --matrix none: the toggles vary TRL against the built-in loop, while your "
                         "loop's differences from TRL are found by the explanation search")
    check_inputs(spec)
    check_backend(args)
    from harness.diagnose.preflight import format_preflight, preflight

    _tr, diffs, facts = preflight(spec)
    out = Path(args.out)
    if not args.resume and (out / "verdict.json").exists() and not args.force:
        raise InputError(f"--out {out} already holds a parity run (verdict.json): pass --force to replace it, "
                         f"--resume {out} to finish it if it was cut short, or another --out")
    make_out_dir(out)
    print(f"spec {args.spec} ({spec.NAME}): {spec.STEPS} steps per run, mode {args.mode}, matrix {args.matrix}")
    if diffs and args.matrix != "none":
        print(format_preflight(facts, diffs).split("\n\n")[-1])
        raise InputError(f"{args.spec or args.resume}: the two sides differ in {len(diffs)} way(s) (listed above), and "
                         "the matrix toggles TRL against a matched spec: align these first, or use --matrix none")
    from harness.diagnose.matrix import run_matrix
    from harness.diagnose.verdict import format_verdict
    from harness.runlog.stops import graceful_stop

    with graceful_stop():
        try:
            doc = run_matrix(spec, out, matrix=args.matrix, mode=args.mode, progress=not args.quiet and args.verbose, log=print,
                      resume=bool(args.resume), processes=args.processes, jobs=args.jobs, started=lambda: _index(out),
                      backend=args.backend, address=args.ray_address,
                      only=[c.strip() for c in args.cells.split(",") if c.strip()] if args.cells else None)
        except ValueError as e:
            if str(e).startswith("--cells"):
                raise InputError(str(e)) from None
            raise
    text = format_verdict(doc)
    atomic_write_text(out / "summary.txt", text + "\n")
    print()
    print(text)
    from reports.render import write_parity_report

    report = write_parity_report(out)
    print(f"\nwrote {out / 'verdict.json'}, {out / 'summary.txt'}")
    print(f"report: {report}")
    return parity_exit_code(doc)


def parity_exit_code(doc: dict) -> int:
    """0 every cell as expected; 3 a cell whose side crashed or broke the loop contract, or a run cut short (its
    verdict is not whole, whatever the other cells say); 1 otherwise (a cell not as expected)."""
    if any(c.get("verdict") in ("failed", "error") for c in doc.get("cells", [])) or not doc.get("complete", True):
        return 3
    return 0 if doc["ok"] else 1


def _index(out: Path) -> None:
    """The runs index beside `out`, refreshed when a parity run starts (it lists this one as cut short until done);
    a folder above the run that cannot be written to gets none."""
    from reports.render import write_index

    try:
        write_index(out.parent)
    except OSError:
        pass


def cmd_preflight(args) -> int:
    """Needs neither the model nor the data: it runs anywhere, before any GPU time is spent."""
    spec = _load(args)
    from harness.experiment.data import DataError, load_rows
    from harness.diagnose.preflight import format_preflight, preflight
    from trl_runner.translate import format_mapping

    n_rows = None
    if spec.data.source != "gsm8k":  # local data: count it for the steps-per-epoch line
        try:
            n_rows = len(load_rows(spec.data))
        except (DataError, OSError, ValueError) as e:
            print(f"note: data not readable here ({e}); steps per epoch left out")
    tr, diffs, facts = preflight(spec, n_rows=n_rows)
    if spec.sampler.kind == "vllm":
        from harness.rollouts.samplers import vllm_available

        if not vllm_available():
            print("note: sampler.kind = \"vllm\" but vLLM is not installed here; runs need it (pip install -e "
                  "'.[vllm]' on a GPU machine)")
    print(format_mapping(tr.table))
    print()
    print(format_preflight(facts, diffs))
    if tr.validated_with:
        print(f"\n(GRPOConfig checked here with {tr.validated_with}: this machine has no GPU)")
    if spec.sampler.kind == "policy" and spec.decoder(spec.DEVICE in ("cuda", "auto")) != "hf":
        print("\nnote: on a GPU the scratch loop samples from its own inference copy (GENERATION = \"static\"/"
              "\"compiled\"/\"auto\": weights in the compute dtype, norms and embeddings included), TRL from transformers' "
              "generate under autocast (fp32 norms and embeddings): lockstep is unaffected; for free runs that must "
              "share TRL's sampling law to the last bit, set GENERATION = \"hf\"")
    return 1 if diffs else 0


def cmd_compare(args) -> int:
    """Two metric logs (or two sets of seeds), whoever wrote them; suspicions from the curves, nothing re-run."""
    from harness.diagnose.attribution import evidence as evidence_rules
    from harness.diagnose.compare import (CompareInputError, compare_inputs, format_comparison, input_mode,
                                          load_inputs, parse_map)
    from harness.diagnose.freerun import compare_free_inputs

    if args.out:
        check_out_dir(args.out)
    try:
        inputs = load_inputs(args.run_a, args.run_b, mapping=parse_map(args.map), align=args.align,
                             steps_per_round=args.steps_per_round)
        if input_mode(inputs, args.mode) == "free":  # several seeds per side: the seed-noise statistic
            result = compare_free_inputs(inputs, evidence=evidence_rules)
        else:
            result = compare_inputs(inputs, dtype=args.dtype, tolerance_file=args.tolerances, evidence=evidence_rules)
    except CompareInputError as e:
        raise InputError(str(e)) from None
    text = format_comparison(result, inputs.names, top=0)
    print(text)
    if args.out:
        out = make_out_dir(args.out)
        atomic_write_text(out / "comparison.json", json.dumps(result, indent=2, default=str) + "\n")
        atomic_write_text(out / "comparison.txt", text + "\n")
        from reports.render import write_compare_report

        report = write_compare_report(out, result, frames=(inputs.a, inputs.b))
        print(f"wrote {out / 'comparison.json'}; report: {report}")
    return 0 if result["first_divergence"] is None else 1


def cmd_record(args) -> int:
    spec = _load(args)
    check_out_dir(args.out)
    check_inputs(spec)
    from harness.record import RecordError, record

    try:
        out = record(spec, args.spec, args.out, force=args.force, allow_dirty=args.allow_dirty)
    except RecordError as e:
        raise InputError(str(e)) from None
    print(f"recorded {out} (reference.json holds versions, device and commit)")
    return 0


def cmd_bench(args) -> int:
    """Both loops on one device in one process (scratch, TRL, scratch), against the measured floor."""
    spec = _load(args)
    check_out_dir(args.out)
    check_inputs(spec)
    from trl_runner.translate import translate

    translate(spec)
    from harness.bench import format_bench, run_bench
    from harness.experiment.models import ModelSourceError, resolve_device

    if spec.STEPS < 2:
        raise InputError("STEPS: the benchmark takes medians over steps 2..N (step 1 is warm-up); use at least 2, "
                         "better 5")
    try:
        resolve_device(spec)
    except ModelSourceError as e:
        raise InputError(str(e)) from None
    result = run_bench(spec, args.out, progress=not args.quiet)
    print()
    print(format_bench(result))
    print(f"\nwrote {Path(args.out) / 'bench.json'} and bench.md (paste the table into docs/benchmarks.md)")
    return 0


def cmd_spec_help(args) -> int:
    from harness.experiment.spec import describe_fields

    print(describe_fields())
    return 0


def cmd_validate(args) -> int:
    spec = _load(args)
    check_inputs(spec, samples=False)
    from trl_runner.translate import translate

    translate(spec)
    print(f"{args.spec}: ok ({spec.NAME}: {spec.STEPS} steps, {spec.PROMPTS_PER_STEP} prompts x {spec.GROUP_SIZE} "
          f"completions per step, {spec.GRAD_ACCUM} micro-batches)")
    return 0


class Parser(argparse.ArgumentParser):
    """A usage error is bad input like any other: one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {one_line(message)}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m harness", description=(
        "GRPO parity harness: run a hand-written GRPO loop and TRL's GRPOTrainer from one spec, log every step, "
        "and compare them. Exit codes: 0 parity or ok, 1 a divergence or differences, 2 bad input, 3 a run that "
        "could not finish."))
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (before or after COMMAND)")
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
    r.add_argument("--processes", type=int, metavar="N", help="override PROCESSES (the TRL side's process count)")
    r.add_argument("--rollouts", metavar="FILE", help="train on these recorded lockstep rollouts (a parity cell's "
                                                      "rollouts.jsonl) instead of sampling")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--tensor-steps", type=int, default=0, metavar="N",
                   help="save the first N steps' tensors along the dataflow (tensors.jsonl; TRL's read from inside "
                        "GRPOTrainer) for `tensordiff`")
    r.set_defaults(func=cmd_run)

    td = sub.add_parser("tensordiff", help="compare two runs' saved tensors (run --tensor-steps) link by link: the "
                                           "first that differs, where and how (exit 0 none, 1 one differs)")
    td.add_argument("run_a", help="a run folder with tensors.jsonl (its tensors are explained)")
    td.add_argument("run_b", help="the reference run folder; --spec is its spec")
    td.add_argument("--spec", required=True, help="the reference run's spec (TOML)")
    td.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    td.add_argument("--rollouts", required=True, metavar="FILE", help="the rollouts.jsonl both runs replayed")
    td.set_defaults(func=cmd_tensordiff)

    pa = sub.add_parser("parity", help="run the toggle matrix (both loops per cell), compare, name causes")
    pa.add_argument("--spec", help="experiment spec (TOML), e.g. harness/specs/default.toml")
    pa.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    pa.add_argument("--out", default="runs/parity", help="output folder (default runs/parity)")
    pa.add_argument("--resume", metavar="DIR", help="continue an interrupted parity run in DIR, keeping its "
                                                     "finished cells (spec, matrix and mode come from DIR)")
    pa.add_argument("--steps", type=int, help="override STEPS")
    pa.add_argument("--tolerance", choices=("calibrated", "static"),
                    help="lockstep parity bounds: calibrated (default: K x a noise twin's difference above the static "
                         "floor; one more scratch run per distinct scratch setting) or static (tolerances.toml alone); "
                         "overrides TOLERANCE")
    pa.add_argument("--mode", choices=("lockstep", "free"), default="lockstep",
                    help="lockstep: both loops get the same rollouts (default); free: each samples its own, "
                         "several seeds per side")
    pa.add_argument("--matrix", choices=("none", "default", "full"), default=None,
                    help="none: the spec as given, one cell; default: each check toggled alone plus matched pairs; "
                         "full: batch x loss_type x IS (default: default, or none with a loop of yours)")
    pa.add_argument("--loop", metavar="CMD", help="your own GRPO loop's command, as a side of the run "
                                                  "(docs/your-loop.md); same as [loop] command in the spec")
    pa.add_argument("--against", choices=("trl", "scratch", "both"),
                    help="what your loop is compared with (default trl; [loop] against)")
    pa.add_argument("--cells", metavar="NAME,NAME", help="run only these cells of the matrix (names as in the "
                                                         "verdict, e.g. matched,loss_type=dapo)")
    pa.add_argument("--processes", type=int, default=1, metavar="N",
                    help="add the world-size cells: TRL on N processes (accumulation / N) against the one-process "
                         "scratch loop, for each loss type")
    pa.add_argument("--jobs", type=int, default=1, metavar="K",
                    help="run K pairs of runs at once in worker processes, one GPU each where there are GPUs (default "
                         "1: one after another in this process)")
    pa.add_argument("--backend", choices=("local", "ray"), default="local",
                    help="where the runs happen: this machine (default; --jobs sets how many at once) or a Ray "
                         "cluster, one GPU per run (docs/scaling.md)")
    pa.add_argument("--ray-address", metavar="ADDR", default=None,
                    help="with --backend ray: the cluster to use ('auto', 'ray://head:10001'; default RAY_ADDRESS, "
                         "else a local cluster started for this run)")
    pa.add_argument("--force", action="store_true", help="replace a parity run already in --out")
    pa.add_argument("--quiet", action="store_true", help="no per-step progress")
    pa.add_argument("--verbose", action="store_true", help="per-step progress inside each cell")
    pa.set_defaults(func=cmd_parity)

    pf = sub.add_parser("preflight", help="what differs between the two sides, before any model loads "
                                          "(exit 0 aligned, 1 differences, 2 bad spec)")
    spec_args(pf, out_default=False)
    pf.set_defaults(func=cmd_preflight)

    c = sub.add_parser("compare", help="compare two metric logs: harness runs, JSONL or CSV logs (W&B exports), TRL "
                                       "trainer_state.json; several seeds per side in free mode",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=(
                           "Compare two metric logs step by step (exit 0 parity, 1 diverged, 2 bad input).\n\n"
                           "Each of A and B is one run: a harness run folder (metrics.jsonl), a .jsonl or .csv log,\n"
                           "or a TRL trainer_state.json; or several runs of one side (free-run seeds): RUN,RUN,...\n"
                           "(an item may be a quoted glob, 'runs/a/*.csv'), or a folder of seed runs (seed-*/, as\n"
                           "harness free runs write them). One run per side: lockstep tolerances; several: the\n"
                           "free-run seed-noise statistic.\n\n"
                           "Recognised without --map: TRL log_history keys, W&B columns (train/ prefix dropped;\n"
                           "_runtime, _timestamp skipped), a step column named step, train/global_step,\n"
                           "global_step, iteration or _step. A metric only one side logs is listed as not\n"
                           "compared; a NaN or inf on either side is a divergence at that step."))
    c.add_argument("run_a", metavar="A", help="run, RUN,RUN,... or a folder of seed-*/ runs")
    c.add_argument("run_b", metavar="B", help="the same for the other side")
    c.add_argument("--out", help="write comparison.json and a report here")
    c.add_argument("--mode", choices=("lockstep", "free"), default=None,
                   help="lockstep: per-step tolerances, one run per side; free: seed-noise statistic, at least 2 "
                        "seeds per side (default: by the number of runs given)")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), help="tolerances for this dtype (default: A's spec)")
    c.add_argument("--tolerances", help="tolerance file (default: harness/diagnose/tolerances.toml)")
    c.add_argument("--map", action="append", default=[], metavar="OURS=THEIRS",
                   help="read your column THEIRS as the harness/TRL metric OURS (both logs, where present); "
                        "repeatable, e.g. --map loss=train_loss --map step=iter")
    c.add_argument("--align", choices=("step", "round"), default="step",
                   help="step: match rows by step number (default); round: by generation round, for a log per "
                        "optimizer step against one per generation (a `round` column, else --steps-per-round)")
    c.add_argument("--steps-per-round", metavar="K|KA,KB",
                   help="with --align round: optimizer steps per generation round, for both logs or each (1: one "
                        "row per round); rounds count from each log's first step, values averaged per round")
    c.set_defaults(func=cmd_compare)

    rec = sub.add_parser("record", help="record a golden lockstep reference (logs, rollouts, versions, commit)")
    spec_args(rec)
    rec.add_argument("--steps", type=int, help="override STEPS")
    rec.add_argument("--force", action="store_true", help="overwrite an existing reference")
    rec.add_argument("--allow-dirty", action="store_true", help="record from a work tree with uncommitted changes")
    rec.set_defaults(func=cmd_record)

    v = sub.add_parser("validate", help="check a spec, its data and its TRL translation without loading a model")
    spec_args(v, out_default=False)
    v.set_defaults(func=cmd_validate)

    b = sub.add_parser("bench", help="time both loops on one device (scratch, TRL, scratch) against the floor")
    spec_args(b, out_default="runs/bench")
    b.add_argument("--steps", type=int, help="override STEPS (medians are over steps 2..N)")
    b.add_argument("--quiet", action="store_true", help="no per-step progress")
    b.set_defaults(func=cmd_bench)

    h = sub.add_parser("spec-help", help="list every spec field with its default and meaning")
    h.set_defaults(func=cmd_spec_help)
    for sp in sub.choices.values():  # --debug after the command too; SUPPRESS keeps one given before it
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


# exceptions that mean the input is wrong (exit 2), by class name: their modules need not be imported to match
BAD_INPUT = ("SpecError", "InputError", "CompareInputError", "DataError", "ModelSourceError", "RewardError",
             "RecordError", "BackendError")
DEBUG_HINT = "`--debug` shows the traceback"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def exit_for(e: BaseException) -> tuple[int, str]:
    """The exit code and the one line on stderr for an exception that reached the command line (README "Exit
    codes"): 2 bad input, 3 a run that could not finish; everything unforeseen is 3, never a traceback."""
    names = {c.__name__ for c in type(e).__mro__}
    if names & set(BAD_INPUT):
        return 2, f"error: {one_line(e)}"
    if isinstance(e, KeyboardInterrupt):
        return 3, (f"interrupted ({one_line(e) or 'Ctrl-C'}); finished steps are in the metric logs; `python -m "
                   "harness parity --resume DIR` keeps a parity run's finished cells, stored scratch runs and "
                   "re-runs, and runs the rest of a cut-off cell again from its first step")
    if isinstance(e, FloatingPointError):
        return 3, f"run failed: {one_line(e)}; the metric log keeps every step up to it"
    if isinstance(e, MemoryError) or "OutOfMemoryError" in names:
        return 3, (f"out of memory ({one_line(e) or type(e).__name__}): smaller micro-batches (raise GRAD_ACCUM), "
                   "fewer tokens (MAX_TOKENS, MAX_PROMPT_TOKENS) or a bigger machine; `python -m harness validate` "
                   "estimates the peak")
    return 3, f"failed: {type(e).__name__}: {one_line(e)[:500]} ({DEBUG_HINT})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        code, line = exit_for(e)
        if args.debug:
            traceback.print_exc()
        print(line, file=sys.stderr)
        return code
