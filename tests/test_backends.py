"""Backends (harness/diagnose/backends.py): a matrix's cells on K local worker processes (`--jobs K`) and as Ray
tasks on a local Ray cluster (`--backend ray`, issue 21 item 4) give the verdicts of a run one cell after another;
a worker that dies fails the cells whose runs it held, which `--resume` runs again; no scratch run is made twice.

The worker is killed from inside: a reward file that calls os._exit the first time a worker scores with it after a
marker file appears (the first caller takes the marker by renaming it, so exactly one worker dies).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from conftest import DEFAULT_SPEC
from harness.cli import main

DIES = '''
import os

MARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "die-once")


def right_or_die(prompts, completions, answer, **kwargs):
    """1 for the right number; the first call in a worker after die-once appears kills that worker (as the OOM
    killer would). die-once holds the driver's pid: the driver checks the reward before any run, and lives."""
    try:
        driver = int(open(MARK).read())
        if os.getpid() != driver:
            os.rename(MARK, MARK + ".taken")  # one caller wins the marker, however many workers race for it
            os._exit(17)
    except FileNotFoundError:
        pass
    return [float(a in (c[0]["content"] if isinstance(c, list) else c)) for c, a in zip(completions, answer)]
'''

CELLS = "matched,loss_type=dapo,batch=naive"


def verdicts(doc: dict) -> list:
    return [(c["name"], c["verdict"], c["ok"], c["attribution"], c["first_divergence"]) for c in doc["cells"]]


@pytest.fixture
def dying_spec(tmp_path):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "dies.py").write_text(DIES)
    text = DEFAULT_SPEC.read_text().replace('functions = ["correctness", "format"]',
                                            'functions = ["rewards/dies.py:right_or_die", "format"]')
    path = tmp_path / "spec.toml"
    path.write_text(text.replace("STEPS = 30", "STEPS = 2"))
    return path


@pytest.fixture
def ray_cluster():
    """A local Ray cluster of 2 CPUs for the test (started by the first --backend ray run), shut down after."""
    ray = pytest.importorskip("ray", reason="Ray is in the [test] extra: `make env` installs it")
    yield ray
    ray.shutdown()


def run_with_a_death(tmp_path, spec, flags: list[str]) -> tuple[dict, dict, dict]:
    """The sequential reference, then the same cells on the backend with one worker killed, then --resume."""
    ref_out, out = tmp_path / "sequential", tmp_path / "parallel"
    assert main(["parity", "--spec", str(spec), "--cells", CELLS, "--quiet", "--out", str(ref_out)]) == 0
    ref = json.loads((ref_out / "verdict.json").read_text())
    (spec.parent / "rewards" / "die-once").write_text(str(os.getpid()))
    argv = ["parity", "--spec", str(spec), "--cells", CELLS, "--quiet", "--out", str(out), *flags]
    assert main(argv) == 3  # a failed cell: exit 3
    killed = json.loads((out / "verdict.json").read_text())
    assert (spec.parent / "rewards" / "die-once.taken").exists()  # the death happened, in a worker
    assert main(["parity", "--resume", str(out), "--quiet", *flags]) == 0
    return ref, killed, json.loads((out / "verdict.json").read_text())


def check(ref: dict, killed: dict, resumed: dict, died: str) -> None:
    failed = [c for c in killed["cells"] if c["verdict"] == "failed"]
    assert failed and not killed["ok"], verdicts(killed)  # the death is reported, never a pass
    assert all(died in c["error"] and "--resume" in c["error"] for c in failed), [c["error"] for c in failed]
    for c in killed["cells"]:  # the cells the death did not touch are right
        if c["verdict"] != "failed":
            assert (c["name"], c["verdict"], c["ok"]) in [v[:3] for v in verdicts(ref)]
    assert resumed["complete"] and resumed["ok"]
    assert verdicts(resumed) == verdicts(ref)


def test_ray_local_cluster_same_verdicts_and_a_dead_worker_rerun_on_resume(tmp_path, dying_spec, ray_cluster,
                                                                            capsys):
    ref, killed, resumed = run_with_a_death(tmp_path, dying_spec, ["--backend", "ray"])
    check(ref, killed, resumed, "WorkerDied: the Ray worker running this pair died")
    out = capsys.readouterr().out
    assert "backend: Ray cluster with" in out and "running 3 cells" in out


def test_jobs_same_verdicts_and_a_dead_worker_process_rerun_on_resume(tmp_path, dying_spec):
    ref, killed, resumed = run_with_a_death(tmp_path, dying_spec, ["--jobs", "2"])
    check(ref, killed, resumed, "WorkerDied: the worker process running this pair died")


def counting_pool(calls: list, die_at: str | None = None):
    """A parallel backend whose runs happen in this process, one at a time (torch's seeding is per process), and
    are counted: the pool's logic (threads, scratch once, shared re-runs) without worker start-up. `die_at`: the
    first pair into a folder of that name fails as a dead worker's would."""
    from harness.diagnose import backends

    one_at_a_time = threading.Lock()

    class Counting(backends._Pool):
        slots = 3

        def _run(self, fn, spec, *args):
            with one_at_a_time:
                calls.append("scratch" if fn is backends._scratch_job else "pair")
                if die_at and fn is backends._pair_job and Path(args[1]).name.startswith(die_at) and \
                        "died" not in calls:
                    calls.append("died")
                    raise backends.WorkerDied("the worker process running this pair died (simulated); --resume "
                                              "runs it again")
                return fn(*args)

    return Counting


def test_a_scratch_run_shared_by_cells_is_made_once_on_a_backend(tmp_path, monkeypatch):
    """Cells (and re-runs) whose scratch side is set up alike wait for one scratch run on a parallel backend: the
    default matrix's first three cells share one, so one scratch run, one make_scratch call, three pairs."""
    from harness.diagnose import pairs
    from harness.diagnose.matrix import run_matrix
    from harness.experiment.spec import load_spec

    calls = []
    Counting = counting_pool(calls)
    made = []
    real = pairs._scratch_side

    def counted(spec, out_dir, progress, store, held=None):
        had = store is not None and store.has(spec)
        made.append(not had)
        return real(spec, out_dir, progress, store, held)

    monkeypatch.setattr(pairs, "_scratch_side", counted)
    monkeypatch.setattr("harness.diagnose.matrix.make_backend", lambda *a, **k: Counting())
    spec = load_spec(DEFAULT_SPEC, ["STEPS=2"])
    doc = run_matrix(spec, tmp_path / "m", "default", log=lambda *_: None, only=CELLS.split(","), jobs=3)
    assert doc["ok"], verdicts(doc)
    assert calls.count("scratch") == 1, calls
    assert sum(made) == 1, made  # one scratch run trained; every other pair copied it from the store
    # three cells, and the two confirmations both resolve to the matched cell's spec: they wait for its pair when
    # it is still running, and take it (attribution.own_pair), whatever order the threads run in
    assert calls.count("pair") == 3, calls


def test_the_several_causes_search_on_a_parallel_backend_names_the_same_causes(tmp_path, monkeypatch):
    """The lesson's three mistakes at once: with room for 3 runs the search runs each pass's candidates and the
    shares' re-runs together, and names the same causes, statuses and shares as one run after another."""
    from conftest import ROOT
    from harness.diagnose.matrix import run_matrix
    from harness.experiment.spec import load_spec

    spec = load_spec(ROOT / "harness" / "specs" / "lesson-mistakes.toml", ["STEPS=6"])
    one = run_matrix(spec, tmp_path / "one", "none", log=lambda *_: None)
    calls = []
    monkeypatch.setattr("harness.diagnose.matrix.make_backend", lambda *a, **k: counting_pool(calls)())
    par = run_matrix(spec, tmp_path / "par", "none", log=lambda *_: None, jobs=3)

    def causes(doc):
        return [(d["cause"], d["status"], {k: round(v, 9) for k, v in d.get("share", {}).items()})
                for d in doc["cells"][0]["attribution_detail"]]

    assert [d[1] for d in causes(one)].count("confirmed") == 3, causes(one)
    assert causes(par) == causes(one)
    assert verdicts(par) == verdicts(one)
    assert calls.count("scratch") == 1 and calls.count("pair") >= 1 + one["cells"][0]["attribution_detail"][0]["reruns"]


def test_a_worker_that_dies_in_a_confirmation_rerun_fails_its_cell_and_resume_runs_it(tmp_path, monkeypatch):
    """A dead worker is not a re-run's answer: the cell is failed (not diverged with a wrong cause, which --resume
    would keep), the cells it did not touch are right, and --resume gives the uninterrupted verdicts."""
    from harness.diagnose.matrix import run_matrix
    from harness.experiment.spec import load_spec

    spec = load_spec(DEFAULT_SPEC, ["STEPS=2"])
    only = ["matched", "is=sequence_mask"]  # its confirmation is a spec no cell has
    ref = run_matrix(spec, tmp_path / "ref", "default", log=lambda *_: None, only=only)
    calls = []
    monkeypatch.setattr("harness.diagnose.matrix.make_backend", lambda *a, **k: counting_pool(calls, "aligned-")())
    killed = run_matrix(spec, tmp_path / "m", "default", log=lambda *_: None, only=only, jobs=3)
    assert "died" in calls
    by = {c["name"]: c for c in killed["cells"]}
    cell = by["is=sequence_mask"]
    assert cell["verdict"] == "failed" and "WorkerDied" in cell["error"], verdicts(killed)
    assert by["matched"]["verdict"] == "parity" and by["matched"]["ok"]
    assert not killed["ok"]
    resumed = run_matrix(spec, tmp_path / "m", "default", log=lambda *_: None, only=only, jobs=3, resume=True)
    assert resumed["ok"] and verdicts(resumed) == verdicts(ref)


def test_one_dead_jobs_worker_fails_only_the_pair_it_ran(tmp_path, monkeypatch):
    """--jobs 2, real worker processes: the worker given is=sequence_mask's confirmation re-run dies (os._exit in
    place of the run); that cell fails, the other cells, whose pairs ran beside it, are right."""
    from harness.diagnose import backends
    from harness.diagnose.matrix import run_matrix
    from harness.experiment.spec import load_spec

    died = []

    class DiesOnce(backends.Processes):
        def _submit(self, fn, spec, *args):
            run = Path(args[1])  # is=sequence_mask's re-run (loss_type=dapo's may run too, when matched's pair is late)
            if fn is backends._pair_job and run.parent.name == "is-sequence_mask" and run.name.startswith("aligned-") \
                    and not died:
                died.append(args[1])
                return super()._submit(os._exit, spec, 17)  # the worker process goes, as under the OOM killer
            return super()._submit(fn, spec, *args)

    monkeypatch.setattr("harness.diagnose.matrix.make_backend", lambda *a, **k: DiesOnce(2, log=lambda *_: None))
    doc = run_matrix(load_spec(DEFAULT_SPEC, ["STEPS=2"]), tmp_path / "m", "default", log=lambda *_: None,
                     only=["matched", "is=sequence_mask", "loss_type=dapo"], jobs=2)
    by = {c["name"]: c for c in doc["cells"]}
    assert died and by["is=sequence_mask"]["verdict"] == "failed", verdicts(doc)
    assert "WorkerDied: the worker process running this pair died" in by["is=sequence_mask"]["error"]
    assert by["matched"]["ok"] and by["matched"]["verdict"] == "parity", verdicts(doc)
    assert by["loss_type=dapo"]["ok"] and by["loss_type=dapo"]["verdict"] == "diverged", verdicts(doc)


def test_a_stop_request_cancels_the_runs_on_workers_and_leaves_a_resumable_folder(tmp_path):
    """SIGTERM to the driver (Slurm's, say) stops the workers' runs, not only the driver: the matrix ends within
    seconds with `complete: false`, and no worker process is left."""
    import multiprocessing
    import time

    from harness.diagnose.matrix import run_matrix
    from harness.experiment.spec import load_spec
    from harness.runlog.stops import STOP, Interrupted

    spec = load_spec(DEFAULT_SPEC, ["STEPS=400"])  # a scratch run of about a minute here: the stop lands inside it
    timer = threading.Timer(6.0, lambda: setattr(STOP, "requested", "SIGTERM"))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(Interrupted):
            run_matrix(spec, tmp_path / "m", "default", log=lambda *_: None, only=CELLS.split(","), jobs=2)
        stopped = time.monotonic() - t0
    finally:
        timer.cancel()
        STOP.requested = None
    assert stopped < 6.0 + 10, stopped  # the workers' runs were killed, not waited for
    doc = json.loads((tmp_path / "m" / "verdict.json").read_text())
    assert doc["complete"] is False and doc["ok"] is False
    assert not multiprocessing.active_children()


def test_closing_the_jobs_backend_leaves_no_worker_process():
    """A worker process whose executor let go of it while it ran (shut down without waiting) is killed by close(),
    and said: a safety net, since a CI run once found a cancelled run's process alive after a stop (cause unknown)."""
    import time

    from harness.diagnose import backends

    said = []
    pool = backends.Processes(1, log=said.append)
    worker, _fut, procs = pool._submit(time.sleep, None, 60)
    try:
        assert procs and all(p.is_alive() for p in procs.values())
        worker[0].shutdown(wait=False)  # the executor lets go; its process runs on
        t0 = time.monotonic()
        pool.close()
        assert not [p for p in procs.values() if not backends.gone(p)]
        assert time.monotonic() - t0 < 35
        assert "still running after shutdown" in said[-1] and "killed" in said[-1], said
    finally:  # a failing check leaves no sleeper behind
        backends._kill([p for p in procs.values() if not backends.gone(p)])


def test_a_process_reaped_by_another_thread_counts_as_gone():
    """The race a CI run hit: the executor's thread reaped the killed worker, so our `is_alive()` still said True
    (its waitpid got ECHILD). A pid that no longer exists is gone; a live one is not."""
    import subprocess

    from harness.diagnose import backends

    class Racing:  # what multiprocessing says in that moment: no exit code yet
        def __init__(self, pid):
            self.pid = pid

        def is_alive(self):
            return True

    child = subprocess.Popen(["true"])
    child.wait()  # reaped here, as the executor's thread would: the pid is free
    assert backends.gone(Racing(child.pid))
    assert not backends.gone(Racing(os.getpid()))


def test_backend_flags_are_checked_before_any_model_loads(tmp_path, capsys, monkeypatch):
    base = ["parity", "--spec", str(DEFAULT_SPEC), "--out", str(tmp_path / "x")]
    assert main([*base, "--backend", "ray", "--jobs", "2"]) == 2
    assert "--jobs is for --backend local" in capsys.readouterr().err
    assert main([*base, "--ray-address", "auto"]) == 2
    assert "--ray-address is for --backend ray" in capsys.readouterr().err
    assert main([*base, "--jobs", "0"]) == 2
    assert "--jobs 0: at least 1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    assert main([*base, "--backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert "--backend ray needs Ray, which is not installed: pip install -e '.[ray]'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_worker_without_the_run_folder_says_so(tmp_path):
    """On a cluster without a shared filesystem the worker refuses instead of writing to its own disk."""
    from harness.diagnose.backends import _pair_job
    from harness.experiment.spec import load_spec

    spec = load_spec(DEFAULT_SPEC, ["STEPS=1"])
    with pytest.raises(RuntimeError, match="is not there; --out must be on a filesystem every worker mounts"):
        _pair_job(spec, str(tmp_path / "elsewhere" / "cell"), "lockstep", ("scratch", "trl"), None)
    assert not (tmp_path / "elsewhere").exists()
