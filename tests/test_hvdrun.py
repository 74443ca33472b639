"""tests/hvdrun.py: results come back, worker errors surface, and a hang is killed in time.

The workers here import no framework, so each launch costs Horovod's start-up only.
"""
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests import hvdrun
from tests.hvdrun import WorkerError, run

HANG_TIMEOUT = 25  # room for Horovod's start-up (both ranks must be running) on a busy machine


def worker_echo(a, b=0):
    return {"rank": int(os.environ["HOROVOD_RANK"]), "a": a, "b": b, "env": os.environ.get("HVDRUN_TEST_ENV"),
            "marker": os.environ.get(hvdrun.MARKER_ENV)}


def worker_raises():
    rank = int(os.environ["HOROVOD_RANK"])
    if rank == 1:
        raise ValueError(f"boom on rank {rank}: bad option 'x'")
    return rank


def worker_hangs(piddir, token):
    """Rank 1 starts a grandchild in a session of its own, then sleeps forever."""
    rank = int(os.environ["HOROVOD_RANK"])
    with open(os.path.join(piddir, f"worker-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        escaped = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(1000)", token],
                                   start_new_session=True)
        with open(os.path.join(piddir, "escaped"), "w") as f:
            f.write(str(escaped.pid))
        while True:
            time.sleep(1)
    return rank


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_results_args_kwargs_env():
    results = run(worker_echo, np=2, args=(3,), kwargs={"b": 4}, env={"HVDRUN_TEST_ENV": "yes"}, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["a"] == 3 and r["b"] == 4 and r["env"] == "yes" for r in results)
    assert results[0]["marker"] and results[0]["marker"] == results[1]["marker"]
    assert hvdrun.MARKER_ENV not in os.environ and "HVDRUN_TEST_ENV" not in os.environ


def test_worker_error_surfaces_with_its_text():
    with pytest.raises(ValueError, match=r"^boom on rank 1: bad option 'x'$") as err:
        run(worker_raises, np=2, timeout=60)
    cause = str(err.value.__cause__)
    assert isinstance(err.value.__cause__, WorkerError)
    assert "raised on rank 1 of 2 in worker_raises" in cause and "Traceback" in cause, cause
    assert err.value.rank == "1" and "worker_raises" in err.value.worker_traceback


def test_non_builtin_exception_is_worker_error(tmp_path):
    """Offline (no launch): what the parent makes of the files a failed launch leaves."""
    import pickle
    import cloudpickle
    (tmp_path / "result.pkl").write_bytes(cloudpickle.dumps({"ok": False, "error": "RuntimeError: x",
                                                            "traceback": ""}))
    for rank, when, typ, module in ((0, 2.0, "CustomError", __name__), (1, 1.0, "KeyError", "builtins")):
        record = {"rank": str(rank), "time": when, "type": typ, "module": module, "message": f"m{rank}",
                  "args": pickle.dumps((f"m{rank}",)), "traceback": f"Traceback {rank}"}
        (tmp_path / f"error-{rank}").write_bytes(pickle.dumps(record))
    with pytest.raises(KeyError, match="m1") as err:  # the earliest error wins
        hvdrun._collect(str(tmp_path), "w", 2, 1)
    assert "rank 0: CustomError: m0" in str(err.value.__cause__)
    (tmp_path / "error-1").unlink()
    with pytest.raises(WorkerError, match="^CustomError: m0$") as err:
        hvdrun._collect(str(tmp_path), "w", 2, 1)
    assert err.value.rank == "0" and "Traceback 0" in err.value.worker_traceback
    (tmp_path / "error-0").unlink()
    with pytest.raises(WorkerError, match="no rank reported an exception"):
        hvdrun._collect(str(tmp_path), "w", 2, 1)


def test_hang_is_killed_with_every_process(tmp_path):
    token = f"hvdrun-escaped-{os.getpid()}-{time.time_ns()}"
    hvdrun._gloo_built()  # once per session, before the clock starts
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"hung for {HANG_TIMEOUT} s; ranks killed") as err:
        run(worker_hangs, np=2, args=(str(tmp_path), token), timeout=HANG_TIMEOUT)
    elapsed = time.monotonic() - start
    assert elapsed < HANG_TIMEOUT + 15, elapsed
    # both ranks had started (so the hang was real), and the stack dump shows where rank 1 was
    pids = [int((tmp_path / f"worker-{r}").read_text()) for r in (0, 1)]
    escaped = int((tmp_path / "escaped").read_text())
    assert "worker_hangs" in str(err.value), str(err.value)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids + [escaped]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids + [escaped]), [(p, _alive(p)) for p in pids + [escaped]]
    survivors = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if token in cmd and _alive(p.info["pid"]):
            survivors.append(p.info["pid"])
    assert not survivors


def test_default_timeout_from_env(monkeypatch):
    monkeypatch.delenv(hvdrun.TIMEOUT_ENV, raising=False)
    assert hvdrun.default_timeout() == hvdrun.DEFAULT_TIMEOUT
    monkeypatch.setenv(hvdrun.TIMEOUT_ENV, "42.5")
    assert hvdrun.default_timeout() == 42.5
    monkeypatch.setenv(hvdrun.TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match=hvdrun.TIMEOUT_ENV):
        hvdrun.default_timeout()


_HANGING_RANK = ("import os, sys, time\n"
                 "open(os.path.join(sys.argv[1], 'rank-' + os.environ['HOROVOD_RANK']), 'w').write(str(os.getpid()))\n"
                 "print('rank', os.environ['HOROVOD_RANK'], 'up', flush=True)\n"
                 "time.sleep(1000)\n")


def test_run_command_hang_is_killed(tmp_path):
    """``run_command`` (horovodrun): a hanging launch is killed with every rank and says what
    the ranks printed (finished launches: tests/test_examples.py, tests/smoke)."""
    with pytest.raises(TimeoutError, match=rf"hung for {HANG_TIMEOUT} s; ranks killed") as err:
        hvdrun.run_command([sys.executable, "-c", _HANGING_RANK, str(tmp_path)], np=2, timeout=HANG_TIMEOUT)
    pids = [int((tmp_path / f"rank-{r}").read_text()) for r in (0, 1)]  # both ranks had started
    assert "rank 1 up" in str(err.value)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
