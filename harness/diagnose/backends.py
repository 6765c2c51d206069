"""Where a matrix's runs happen: in this process (the default), in K worker processes on this machine (`--jobs K`),
or as Ray tasks on a cluster (`--backend ray`), one GPU each where there are GPUs.

The matrix keeps every cell's logic (comparison, attribution, the several-causes search) in the driver, one thread
per cell, and hands each pair of runs (`pairs.run_pair`) to the backend, which blocks until it is done. So a
cell's re-runs go to the backend too, and a pair holds a GPU only while it trains. A lockstep pair needs its
scratch run's recording before TRL can start, so cells whose scratch side is set up alike wait for one scratch run
(`pairs.make_scratch`, made once per `scratch_key`) and then copy it from the matrix's store: no scratch run is made
twice, however many cells share it.

A worker that dies (killed, out of memory, a node lost) fails only the pair it ran, as `WorkerDied`, and with it
that pair's cell (a re-run included: attribution passes WorkerDied on, never reads it as a result); `--resume`
runs the cell again. Ctrl-C / SIGTERM to the driver cancels the runs on the workers. The run folder must be one
that every worker sees (a shared filesystem on a cluster); a worker that does not see it says so instead of
writing elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import socket
import threading
import time
from pathlib import Path

from harness.diagnose import pairs
from harness.runlog.stops import STOP, Interrupted

BACKENDS = ("local", "ray")
POLL_S = 0.5  # how often a waiting driver thread looks for Ctrl-C / SIGTERM
# what a Ray worker needs from the driver's environment (offline hub, the model cache, TRL's switches)
FORWARDED_ENV = ("HF_", "TRL_", "GRPO_PARITY_", "TRANSFORMERS_", "TOKENIZERS_")


class WorkerDied(RuntimeError):
    """The process (or node) running a pair went away before it finished: its cell fails, --resume re-runs it."""


class BackendError(ValueError):
    """A backend that cannot start or cannot hold a run (bad --ray-address, too few GPUs on a node): bad input."""


def _check_folder(out_dir: Path) -> None:
    if not out_dir.parent.is_dir():  # a worker on another machine, without the shared filesystem
        raise RuntimeError(f"worker on {socket.gethostname()}: the run folder {out_dir.parent} is not there; --out "
                           "must be on a filesystem every worker mounts (docs/scaling.md)")


def _pair_job(spec, out_dir: str, mode: str, sides: tuple, store_root: str | None, keep: bool | str = False):
    """What a worker runs for a pair: `pairs.run_pair` into a folder the driver made (`keep`: its CellData, which
    travels back to the driver whole)."""
    out_dir = Path(out_dir)
    _check_folder(out_dir)
    store = pairs.ScratchStore(Path(store_root)) if store_root else None
    return pairs.run_pair(spec, out_dir, mode, False, sides=sides, store=store, keep=keep)


def _scratch_job(spec, out_dir: str, store_root: str) -> None:
    """What a worker runs for a shared scratch run: `pairs.make_scratch` into the folder and the store."""
    out_dir = Path(out_dir)
    _check_folder(out_dir)
    pairs.make_scratch(spec, out_dir, store=pairs.ScratchStore(Path(store_root)))


class InProcess:
    """Every run in this process, one after another (the default)."""

    slots = 1
    name = "local"

    def run_pair(self, spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
                 sides: tuple = ("scratch", "trl"), store=None, keep: bool | str = False):
        """`pairs.run_pair`, here."""
        return pairs.run_pair(spec, out_dir, mode, progress, sides=sides, store=store, keep=keep)

    def check(self, specs) -> None:
        pass

    def close(self) -> None:
        pass


class _Pool:
    """Runs pairs elsewhere and waits for them, watching for Ctrl-C / SIGTERM; a lockstep scratch run shared by
    several cells is made once. Subclasses say how one job runs (`_submit`, `_wait`, `_cancel`)."""

    slots = 1
    name = "pool"

    def __init__(self):
        self._lock = threading.Lock()
        self._scratch: dict[str, concurrent.futures.Future] = {}

    def run_pair(self, spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
                 sides: tuple = ("scratch", "trl"), store=None, keep: bool | str = False):
        """`pairs.run_pair` on a worker, after the scratch run it shares with other cells (made once)."""
        out_dir = Path(out_dir).resolve()  # a worker's working directory is not the driver's
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        root = str(Path(store.root).resolve()) if store is not None else None
        if store is not None and mode == "lockstep" and not store.has(spec):
            self._scratch_once(spec, out_dir, store, root)
        return self._run(_pair_job, spec, spec, str(out_dir), mode, tuple(sides), root, keep)

    def _scratch_once(self, spec, out_dir: Path, store, root: str) -> None:
        """The first caller of a scratch key makes it (into its own folder and the store); the others wait for it
        and share its outcome, an error included."""
        key = store.entry(spec).name
        with self._lock:
            fut = self._scratch.get(key)
            mine = fut is None
            if mine:
                fut = self._scratch[key] = concurrent.futures.Future()
        if not mine:
            self._wait_future(fut)
            return
        try:
            self._run(_scratch_job, spec, spec, str(out_dir), root)
        except BaseException as e:
            fut.set_exception(e)
            with self._lock:  # a later call (another matrix, a resume) may try again
                self._scratch.pop(key, None)
            raise
        fut.set_result(None)

    @staticmethod
    def _wait_future(fut: concurrent.futures.Future):
        while True:
            try:
                return fut.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                if STOP.requested:
                    raise Interrupted(f"{STOP.requested} while waiting for a shared scratch run") from None

    def _run(self, fn, spec, *args):
        """Run fn(*args) on a worker and return its result; Interrupted (the job cancelled) on Ctrl-C / SIGTERM."""
        if STOP.requested:
            raise Interrupted(f"{STOP.requested}: no new runs")
        job = self._submit(fn, spec, *args)
        while True:
            done, result = self._wait(job, POLL_S)
            if done:
                return result
            if STOP.requested:
                self._cancel(job)
                raise Interrupted(f"{STOP.requested} while a run was on a worker (cancelled)")

    def _submit(self, fn, spec, *args):
        raise NotImplementedError

    def _wait(self, job, timeout: float) -> tuple[bool, object]:
        raise NotImplementedError

    def _cancel(self, job) -> None:
        raise NotImplementedError

    def check(self, specs) -> None:
        """Refuse, before any run, a spec this backend cannot hold (BackendError)."""

    def close(self) -> None:
        pass


def _worker_start(gpu: str | None, threads: int) -> None:
    """Worker start-up (--jobs): its GPU, before torch sees any, and its share of the CPU cores (K workers of the
    default thread count each would oversubscribe them: on 2 cores, 2 workers of 2 threads ran the default matrix
    3x slower than one process)."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch

    torch.set_num_threads(threads)


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (a Slurm allocation's, say), else 0..n-1."""
    import torch

    if not torch.cuda.is_available():
        return []
    inherited = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return inherited[:torch.cuda.device_count()] or [str(g) for g in range(torch.cuda.device_count())]


def refuse_world_size_on_jobs(processes: int) -> None:
    """--jobs workers see one GPU each: a world-size pair (PROCESSES > 1) cannot run on one (BackendError)."""
    if processes > 1 and _visible_gpus():
        raise BackendError("--jobs with --processes on GPUs: each worker sees one GPU, and a world-size pair needs "
                           "PROCESSES GPUs at once; drop --jobs, or use --backend ray (docs/scaling.md)")


def require_ray():
    """The ray module; BackendError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise BackendError("--backend ray needs Ray, which is not installed: pip install -e '.[ray]' in this "
                           "checkout (or pip install 'ray>=2.60,<3')") from None
    return ray


class Processes(_Pool):
    """`--jobs K`: K spawned worker processes on this machine, one GPU each where there are GPUs (then at most one
    per GPU). Each worker is a pool of its own that runs one job at a time, so a worker that dies fails only the
    job it was running (WorkerDied); a fresh worker takes its place."""

    name = "processes"

    def __init__(self, jobs: int, log=print):
        super().__init__()
        import multiprocessing

        self._ctx = multiprocessing.get_context("spawn")  # fresh workers: CUDA_VISIBLE_DEVICES is read at start
        gpus = _visible_gpus()
        self.slots = min(jobs, len(gpus)) if gpus else jobs
        self._threads = max(1, (os.cpu_count() or 1) // self.slots)
        self._free: queue.Queue = queue.Queue()
        self._all = []
        self._procs: dict[int, object] = {}  # pid -> every worker process started, for close()
        self._log = log
        for i in range(self.slots):
            self._free.put(self._new_worker(gpus[i] if gpus else None))
        log(f"backend: {self.slots} worker processes" + (f" (GPUs {', '.join(gpus[:self.slots])})" if gpus else
                                                          f" ({self._threads} torch threads each)"))

    def _new_worker(self, gpu: str | None):
        from concurrent.futures import ProcessPoolExecutor

        ex = ProcessPoolExecutor(max_workers=1, mp_context=self._ctx, initializer=_worker_start,
                                 initargs=(gpu, self._threads))
        worker = (ex, gpu)
        self._all.append(worker)
        return worker

    def _submit(self, fn, spec, *args):
        while True:  # one job per worker at a time: a death takes only that job down
            try:
                worker = self._free.get(timeout=POLL_S)
                break
            except queue.Empty:
                if STOP.requested:
                    raise Interrupted(f"{STOP.requested}: no new runs") from None
        fut = worker[0].submit(fn, *args)  # starts the worker's process if it has none yet
        procs = _processes_of(worker[0])
        self._procs.update(procs)
        return worker, fut, procs

    def _wait(self, job, timeout):
        from concurrent.futures.process import BrokenProcessPool

        worker, fut, _procs = job
        try:
            result = fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False, None
        except BrokenProcessPool as e:
            self._replace(worker)
            raise WorkerDied(f"the worker process running this pair died ({e}); --resume runs it again") from None
        except BaseException:
            self._free.put(worker)
            raise
        self._free.put(worker)
        return True, result

    def _replace(self, worker) -> None:
        worker[0].shutdown(wait=False, cancel_futures=True)
        self._free.put(self._new_worker(worker[1]))

    def _cancel(self, job) -> None:
        worker, _fut, procs = job
        _kill(list({**procs, **_processes_of(worker[0])}.values()))  # the run inside: stop it now
        self._replace(worker)

    def check(self, specs) -> None:
        refuse_world_size_on_jobs(max((getattr(s, "PROCESSES", 1) for s in specs), default=1))

    def close(self) -> None:
        """Every worker shut down, and no worker process left: a safety net that kills, and says, any still running
        after its executor's shutdown (a CI run once found a cancelled run's process alive after a stop; the cause
        was not found: _cancel already kills and joins)."""
        for ex, _gpu in self._all:
            ex.shutdown(wait=True, cancel_futures=True)
        left = [p for p in list(self._procs.values()) if not gone(p)]
        if left:
            self._log(f"backend: {len(left)} worker process(es) still running after shutdown (pid "
                      f"{', '.join(str(p.pid) for p in left)}): killed")
            _kill(left)


def _processes_of(executor) -> dict:
    """An executor's worker processes, pid -> Process (it has no public way: `_processes`, None once shut down)."""
    return dict(getattr(executor, "_processes", None) or {})


def _kill(procs: list, wait_s: float = 30) -> None:
    """SIGKILL each process and wait (up to `wait_s` in all) until it is gone."""
    for proc in procs:
        proc.kill()
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        while not gone(proc) and time.monotonic() < deadline:
            time.sleep(0.05)


def gone(proc) -> bool:
    """The process has ended. `is_alive()` alone can say True for a moment after it ended: when the executor's own
    thread joins it too, the two waitpid calls race, the loser gets ECHILD and leaves the exit code unset until the
    winner, waiting for the GIL, sets it (a CI run failed on exactly that). A pid that no longer exists is gone."""
    if not proc.is_alive():
        return True
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a pid taken by another user's process since: ours is gone
        return True
    return False


class RayCluster(_Pool):
    """`--backend ray`: each pair a Ray task with `gpus_per_run` GPUs (1 where the cluster has GPUs, else none;
    PROCESSES for a world-size pair) and `cpus_per_run` CPUs. `address`: a running cluster ("auto",
    "HEAD:6379", "ray://HEAD:10001"; default: RAY_ADDRESS, else a local cluster started for this run). The
    driver's HF_*, TRL_*, TRANSFORMERS_*, TOKENIZERS_* and GRPO_PARITY_* variables go to the workers."""

    name = "ray"

    def __init__(self, address: str | None = None, gpus_per_run: float | None = None, cpus_per_run: float = 1,
                 log=print):
        super().__init__()
        self._ray = ray = require_ray()
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                         runtime_env={"env_vars": env})
            except Exception as e:  # no cluster there, a version mismatch, ...
                raise BackendError(f"--backend ray: cannot reach or start a Ray cluster at "
                                   f"{address or os.environ.get('RAY_ADDRESS') or '(a new local one)'} "
                                   f"({type(e).__name__}: {str(e).strip()[:300]}); check --ray-address / RAY_ADDRESS "
                                   "and `ray status` on the head node") from None
        res = ray.cluster_resources()
        gpus, cpus = res.get("GPU", 0), res.get("CPU", 1)
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        self._node_gpus = max([n.get("GPU", 0) for n in nodes] or [gpus])  # a task runs on one node
        self._gpus_per_run = (1 if gpus else 0) if gpus_per_run is None else gpus_per_run
        if self._gpus_per_run > self._node_gpus:
            raise BackendError(f"--backend ray: each run asks for {self._gpus_per_run:g} GPU(s) but no node of the "
                               f"cluster has more than {self._node_gpus:g}")
        g = self._gpus_per_run
        self.slots = max(1, int(gpus // g) if g else int(cpus // cpus_per_run))
        self._task = ray.remote(_pair_job).options(num_gpus=g, num_cpus=cpus_per_run, max_retries=0)
        self._scratch_task = ray.remote(_scratch_job).options(num_gpus=g, num_cpus=cpus_per_run, max_retries=0)
        log(f"backend: Ray cluster with {cpus:g} CPUs and {gpus:g} GPUs; each run takes {g:g} GPU and "
            f"{cpus_per_run:g} CPU, so {self.slots} run at once")

    def _gpus_for(self, spec) -> float:
        """A world-size pair (PROCESSES > 1) runs TRL on PROCESSES GPUs at once, on one node."""
        return self._gpus_per_run * max(1, getattr(spec, "PROCESSES", 1))

    def check(self, specs) -> None:
        for spec in specs:
            if self._gpus_for(spec) > self._node_gpus:
                raise BackendError(f"PROCESSES = {spec.PROCESSES}: a world-size pair needs {self._gpus_for(spec):g} "
                                   f"GPUs on one node, and no node of the Ray cluster has more than "
                                   f"{self._node_gpus:g}: drop --processes, or add a node with that many GPUs")

    def _submit(self, fn, spec, *args):
        task = self._task if fn is _pair_job else self._scratch_task
        if fn is _pair_job and self._gpus_per_run and getattr(spec, "PROCESSES", 1) > 1:
            task = task.options(num_gpus=self._gpus_for(spec))
        return task.remote(*args)

    def _wait(self, job, timeout):
        ready, _ = self._ray.wait([job], timeout=timeout)
        if not ready:
            return False, None
        try:
            return True, self._ray.get(job)
        except self._ray.exceptions.RayTaskError as e:  # the run raised: that error, with the worker's trace
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                cause.add_note(f"(in a Ray worker)\n{str(e)[-3000:]}")
                raise cause from None
            raise
        except self._ray.exceptions.RayError as e:
            raise _ray_error(self._ray.exceptions, e) from None

    def _cancel(self, job) -> None:
        try:
            self._ray.cancel(job, force=True)
        except Exception:  # already finished or gone
            pass


def _ray_error(exc, e: Exception) -> Exception:
    """A Ray failure as the harness says it: WorkerDied where the worker or its node went away (--resume re-runs
    the cell), else a RuntimeError with Ray's own words (a runtime environment that could not be set up, ...)."""
    text = " ".join(str(e).split())
    died = tuple(getattr(exc, n) for n in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError",
                                           "ObjectLostError", "LocalRayletDiedError") if hasattr(exc, n))
    if isinstance(e, died):
        return WorkerDied(f"the Ray worker running this pair died ({type(e).__name__}: {text[:600]}); --resume runs "
                          "it again")
    return RuntimeError(f"Ray could not run this pair ({type(e).__name__}: {text[:1200]})")


def make_backend(backend: str = "local", jobs: int = 1, address: str | None = None, log=print):
    """The backend for a matrix: InProcess, Processes(jobs) or RayCluster(address)."""
    if backend not in BACKENDS:
        raise BackendError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    if backend == "ray":
        return RayCluster(address, log=log)
    if jobs > 1 and len(_visible_gpus()) == 1:
        log(f"--jobs {jobs}: one GPU here, so one run at a time, in this process")
        return InProcess()
    return Processes(jobs, log=log) if jobs > 1 else InProcess()
