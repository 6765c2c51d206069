"""TRL on several processes: the harness launches this module once per process.

    torchrun --nproc_per_node N -m trl_runner.launch --spec-json S --out DIR [--rollouts R]   (CPU, gloo)
    accelerate launch --num_processes N -m trl_runner.launch ...                              (GPUs)

`train_processes` builds that command from the spec (PROCESSES) and runs it; the first process writes the
metric log, with what every process consumed gathered into each step's line. With `--rollouts`, every
process takes its slice of the recorded lockstep rollouts through TRL's rollout_func.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec, spec_json: Path, out_dir: Path, rollouts: Path | None, tensor_steps: int = 0) -> list[str]:
    worker = ["-m", "trl_runner.launch", "--spec-json", str(spec_json), "--out", str(out_dir)]
    if rollouts is not None:
        worker += ["--rollouts", str(rollouts)]
    if tensor_steps:
        worker += ["--tensor-steps", str(tensor_steps)]
    if spec.DEVICE == "cpu":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec.PROCESSES),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *worker]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(spec.PROCESSES),
            "--main_process_port", str(_free_port()), *worker]


def train_processes(spec, out_dir, rollouts: str | Path | None = None, progress: bool = False, tensor_steps: int = 0):
    """Run the TRL side on spec.PROCESSES processes; raises RuntimeError with the output's tail on failure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_json = out_dir / "spec.json"
    spec_json.write_text(json.dumps(spec.to_dict()))
    cmd = launch_command(spec, spec_json, out_dir, Path(rollouts) if rollouts else None, tensor_steps)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    if progress:
        env["GRPO_PARITY_PROGRESS"] = "1"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out_dir / "launch.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"TRL on {spec.PROCESSES} processes failed (exit {r.returncode}); see "
                           f"{out_dir / 'launch.log'}:\n{tail}")
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec-json", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rollouts")
    ap.add_argument("--tensor-steps", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from harness.experiment.spec import parse_spec
    from trl_runner.runner import train

    spec = parse_spec(json.loads(Path(args.spec_json).read_text()))
    source = None
    if args.rollouts:
        from harness.rollouts.lockstep import ReplaySource

        source = ReplaySource.from_file(args.rollouts)
    code = 0
    try:
        train(spec, args.out, rollout_source=source, progress=os.environ.get("GRPO_PARITY_PROGRESS") == "1",
              lockstep=source is not None, tensor_steps=args.tensor_steps)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    # Leave without C++ static teardown: with gloo, rank 0 sometimes aborted there ("terminate called without
    # an active exception") after a finished run. Every log line is already fsync'ed, the manifest written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
