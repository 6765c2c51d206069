"""Where a matrix's runs happen: in this process (the default), in K worker processes on this machine (`--jobs K`),
or as Ray tasks on a cluster (`--backend ray`), one GPU each where there are GPUs.

The matrix keeps every cell's logic (comparison, attribution, the several-causes search) in the driver, one thread
per cell, and hands each pair of runs (`pairs.run_pair`) to the backend, which blocks until it is done. So a
cell's re-runs go to the backend too, and a pair holds a GPU only while it trains. A lockstep pair needs its
scratch run's recording before TRL can start, so cells whose scratch side is set up alike wait for one scratch run
(`pairs.make_scratch`, made once per `scratch_key`) and then copy it from the matrix's store: no scratch run is made
twice, however many cells share it.

A worker that dies (killed, out of memory, a node lost) fails only the pair it ran, as `WorkerDied`: its cell is
reported failed and `--resume` runs it again. The run folder must be one that every worker sees (a shared
filesystem on a cluster); a worker that does not see it says so instead of writing elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
from pathlib import Path

from harness.diagnose import pairs

BACKENDS = ("local", "ray")


class WorkerDied(RuntimeError):
    """The process (or node) running a pair went away before it finished."""


def _pair_job(spec, out_dir: str, mode: str, sides: tuple, store_root: str | None, scratch_only: bool = False):
    """What a worker runs: one pair (or one scratch run), into a folder the driver made."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():  # a worker on another machine, without the shared filesystem
        raise RuntimeError(f"worker on {socket.gethostname()}: the run folder {out_dir.parent} is not there; --out "
                           "must be on a filesystem every worker mounts (docs/scaling.md)")
    store = pairs.ScratchStore(Path(store_root)) if store_root else None
    if scratch_only:
        return pairs.make_scratch(spec, out_dir, store=store)
    return pairs.run_pair(spec, out_dir, mode, False, sides=sides, store=store)


class InProcess:
    """Every run in this process, one after another (the default)."""

    slots = 1
    name = "local"

    def run_pair(self, spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
                 sides: tuple = ("scratch", "trl"), store=None) -> dict:
        return pairs.run_pair(spec, out_dir, mode, progress, sides=sides, store=store)

    def close(self) -> None:
        pass


class _Pool:
    """Runs pairs elsewhere and waits for them; a lockstep scratch run shared by several cells is made once."""

    slots = 1
    name = "pool"

    def __init__(self):
        self._lock = threading.Lock()
        self._scratch: dict[str, concurrent.futures.Future] = {}

    def _run(self, spec, out_dir: Path, mode: str, sides: tuple, store_root: str | None, scratch_only: bool):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def run_pair(self, spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
                 sides: tuple = ("scratch", "trl"), store=None) -> dict:
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        root = str(store.root) if store is not None else None
        if store is not None and mode == "lockstep" and not store.has(spec):
            self._scratch_once(spec, out_dir, store)
        return self._run(spec, out_dir, mode, tuple(sides), root, False)

    def _scratch_once(self, spec, out_dir: Path, store) -> None:
        """The first caller of a scratch key makes it (into its own folder and the store); the others wait for it
        and share its outcome, an error included."""
        key = store.entry(spec).name
        with self._lock:
            fut = self._scratch.get(key)
            mine = fut is None
            if mine:
                fut = self._scratch[key] = concurrent.futures.Future()
        if not mine:
            fut.result()
            return
        try:
            self._run(spec, out_dir, "lockstep", ("scratch",), str(store.root), True)
        except BaseException as e:
            fut.set_exception(e)
            with self._lock:  # a later call (another matrix, a resume) may try again
                self._scratch.pop(key, None)
            raise
        fut.set_result(None)


def _claim_gpu(gpus, threads: int) -> None:
    """Worker start-up (--jobs): take one GPU for this worker's lifetime, before torch sees any, and this worker's
    share of the CPU cores (K workers of the default thread count each would oversubscribe them: on 2 cores, 2
    workers of 2 threads ran the default matrix 3x slower than one process)."""
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus.get())
    import torch

    torch.set_num_threads(threads)


class Processes(_Pool):
    """`--jobs K`: K spawned worker processes on this machine, one GPU each where there are GPUs (then at most one
    worker per GPU). A worker that dies breaks the pool: the pairs it held fail as WorkerDied and a new pool
    serves the rest."""

    name = "processes"

    def __init__(self, jobs: int, log=print):
        super().__init__()
        import multiprocessing

        import torch

        self._ctx = multiprocessing.get_context("spawn")  # fresh workers: CUDA_VISIBLE_DEVICES is read at start
        self._gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.slots = min(jobs, self._gpus) if self._gpus else jobs
        self._manager = self._ctx.Manager() if self._gpus else None
        self._ex = self._new_pool()
        log(f"backend: {self.slots} worker processes" + (" (one GPU each)" if self._gpus else ""))

    def _new_pool(self):
        from concurrent.futures import ProcessPoolExecutor

        gpus = None
        if self._manager is not None:  # every GPU id again: a broken pool's workers are gone with the ids they took
            gpus = self._manager.Queue()
            for g in range(self._gpus):
                gpus.put(g)
        threads = max(1, (os.cpu_count() or 1) // self.slots)
        return ProcessPoolExecutor(max_workers=self.slots, mp_context=self._ctx, initializer=_claim_gpu,
                                   initargs=(gpus, threads))

    def _run(self, spec, out_dir, mode, sides, store_root, scratch_only):
        from concurrent.futures.process import BrokenProcessPool

        with self._lock:
            ex = self._ex
        try:
            return ex.submit(_pair_job, spec, str(out_dir), mode, sides, store_root, scratch_only).result()
        except BrokenProcessPool as e:
            with self._lock:
                if self._ex is ex:
                    ex.shutdown(wait=False, cancel_futures=True)
                    self._ex = self._new_pool()
            raise WorkerDied(f"a worker process died while this pair ran ({e}); --resume runs it again") from None

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
        if self._manager is not None:
            self._manager.shutdown()


class RayCluster(_Pool):
    """`--backend ray`: each pair a Ray task with `gpus_per_run` GPUs (default: 1 where the cluster has GPUs, else
    none) and `cpus_per_run` CPUs. `address`: a running cluster ("auto", "ray://head:10001"; default: RAY_ADDRESS,
    else a local cluster started for this run)."""

    name = "ray"

    def __init__(self, address: str | None = None, gpus_per_run: float | None = None, cpus_per_run: float = 1,
                 log=print):
        super().__init__()
        try:
            import ray
        except ImportError:
            raise ValueError("--backend ray needs Ray: pip install 'grpo-parity[ray]' (or pip install 'ray>=2.60,<3')") \
                from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        res = ray.cluster_resources()
        gpus, cpus = res.get("GPU", 0), res.get("CPU", 1)
        g = (1 if gpus else 0) if gpus_per_run is None else gpus_per_run
        if g > gpus:
            raise ValueError(f"--backend ray: each run asks for {g} GPU(s) but the cluster has {gpus:g}")
        self.slots = max(1, int(gpus // g) if g else int(cpus // cpus_per_run))
        self._gpus_per_run, self._cluster_gpus = g, gpus
        self._job = ray.remote(_pair_job).options(num_gpus=g, num_cpus=cpus_per_run, max_retries=0)
        log(f"backend: Ray cluster with {cpus:g} CPUs and {gpus:g} GPUs; each run takes {g:g} GPU and "
            f"{cpus_per_run:g} CPU, so {self.slots} run at once")

    def _run(self, spec, out_dir, mode, sides, store_root, scratch_only):
        exc = self._ray.exceptions
        try:
            job = self._job
            if self._gpus_per_run and getattr(spec, "PROCESSES", 1) > 1 and not scratch_only:  # a world-size cell
                need = self._gpus_per_run * spec.PROCESSES  # TRL on PROCESSES GPUs at once
                if need > self._cluster_gpus:  # Ray would wait for it forever
                    raise ValueError(f"PROCESSES = {spec.PROCESSES}: this pair needs {need:g} GPUs at once, the Ray "
                                     f"cluster has {self._cluster_gpus:g}")
                job = job.options(num_gpus=need)
            return self._ray.get(job.remote(spec, str(out_dir), mode, sides, store_root, scratch_only))
        except exc.RayTaskError as e:  # the run raised: the same error as in this process, with the worker's trace
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                cause.add_note(f"(in a Ray worker)\n{str(e)[-3000:]}")
                raise cause from None
            raise
        except exc.RayError as e:  # the worker or its node went away (killed, out of memory, lost)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WorkerDied(f"the Ray worker running this pair died ({type(e).__name__}: {first}); --resume runs it "
                             "again") from None

    def close(self) -> None:
        pass  # a cluster this run started goes with the process; a running one stays up for the next


def make_backend(backend: str = "local", jobs: int = 1, address: str | None = None, log=print):
    """The backend for a matrix: InProcess, Processes(jobs) or RayCluster(address)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    if backend == "ray":
        return RayCluster(address, log=log)
    return Processes(jobs, log=log) if jobs > 1 else InProcess()
