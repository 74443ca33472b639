"""Run a function on N real Horovod processes (Gloo on CPU) and collect each rank's result.

Each launch costs seconds (TensorFlow's import more), so tests group many checks into one
worker function and assert on its returned values. Workers must return picklable values
(Python numbers, lists, dicts, NumPy arrays).

Every launch has a hard timeout, so a hang (a collective one rank never joins) fails the test
instead of stalling CI: ``run(..., timeout=s)``, else ``$HVD_GRADCOMP_TEST_TIMEOUT``, else
:data:`DEFAULT_TIMEOUT` seconds. ``horovod.run`` runs in a child process in its own session;
at the timeout the worker ranks first dump their Python stacks (``faulthandler``, into the
error message), then every process of the launch is killed: the child's whole process tree
(Horovod's launcher puts each worker in a session of its own, so a process-group kill alone
misses them), anything that escaped it carrying the launch's marker in its environment, and
the child's session. Then :class:`TimeoutError` ("... hung for N s; ranks killed") is raised.

:func:`run_command` launches a command the way a user does (``horovodrun -np N --gloo
...``, for the example scripts and the smoke test), under the same timeout and kill-all.

An exception raised by the worker function on any rank surfaces in the caller: a built-in
exception (ValueError, AssertionError, ...) is re-raised as the same type with the same
message; any other as :class:`WorkerError` with ``"<type>: <message>"``, so
``pytest.raises(ValueError, match="^thc: ...$")`` works as for a local call. Its cause (a
:class:`WorkerError`, printed by pytest) says which rank raised it and holds that rank's
traceback; ``rank``, ``worker_traceback`` and ``errors`` (every rank that raised) are set on
it too. When several ranks raise, the first to do so is reported.
"""
import builtins
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TIMEOUT = 180.0
TIMEOUT_ENV = "HVD_GRADCOMP_TEST_TIMEOUT"
MARKER_ENV = "HVD_GRADCOMP_HVDRUN_ID"  # set in every process of one launch, to find them all
STACK_LINES = 40  # lines of each rank's stack dump kept in a TimeoutError's message


class LogRecords(logging.Handler):
    """A logging handler that keeps each record's message, for workers to return and tests
    to assert on (``logging.getLogger("hvd_gradcomp").addHandler(LogRecords())``)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def value_error(fn):
    """The message of the ValueError ``fn()`` raises (None when it raises nothing)."""
    try:
        fn()
        return None
    except ValueError as e:
        return str(e)


class WorkerError(RuntimeError):
    """A worker raised an exception that is not a built-in one, or ``horovod.run`` failed.

    Attributes: ``rank`` (the reporting rank, or None), ``worker_traceback`` (its text) and
    ``errors`` (one dict per rank that raised: rank, type, message, traceback).
    """

    def __init__(self, message, rank=None, worker_traceback="", errors=()):
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.errors = list(errors)


def default_timeout():
    """``$HVD_GRADCOMP_TEST_TIMEOUT`` (seconds) when set, else :data:`DEFAULT_TIMEOUT`."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


def run(fn, np=2, args=(), kwargs=None, env=None, timeout=None):
    """``horovod.run(fn, num_proc=np, use_gloo=True)`` from the repository root; returns [rank0, rank1, ...].

    Args:
        fn: the worker function (a module-level function of an importable module, or anything
            cloudpickle can send); called as ``fn(*args, **kwargs)`` on every rank.
        env: extra environment variables for the workers (the caller's are passed too, with
            the repository root put first on PYTHONPATH).
        timeout: seconds before every process of the launch is killed and TimeoutError raised;
            None: ``$HVD_GRADCOMP_TEST_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.
    """
    import cloudpickle
    timeout = default_timeout() if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    what = getattr(fn, "__qualname__", None) or repr(fn)
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="hvdrun-") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            cloudpickle.dump({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs or {}), "np": np,
                              "gloo_built": _gloo_built()}, f)
        child_env = dict(os.environ)  # horovod.run passes its environment on to the workers
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        child_env.setdefault("OMP_NUM_THREADS", "1")
        child_env.update(env or {})
        child_env[MARKER_ENV] = run_id
        code = "import sys; from tests.hvdrun import _child_main; _child_main(sys.argv[1])"
        proc = subprocess.Popen([sys.executable, "-c", code, tmp], env=child_env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = _dump_stacks(tmp)
            killed = _kill_all(proc, run_id)
            raise TimeoutError(f"hvdrun: {what} on {np} Horovod ranks hung for {timeout:g} s; ranks killed "
                               f"({killed} processes){stacks}") from None
        except BaseException:  # KeyboardInterrupt, pytest's own timeouts: leave nothing behind
            _kill_all(proc, run_id)
            raise
        _kill_all(proc, run_id)  # stragglers of a finished launch (normally none)
        return _collect(tmp, what, np, proc.returncode)


def run_command(argv, np=2, env=None, timeout=None, transport="gloo"):
    """``horovodrun -np N --gloo <argv>`` from the repository root, as a user launches a script.

    Args:
        argv: the command every rank runs, e.g. ``[sys.executable, "examples/x.py", "--epochs", "2"]``.
        np: ranks.
        env: extra environment variables (the caller's are passed too, with the repository
            root first on PYTHONPATH and ``OMP_NUM_THREADS=1`` unless set).
        timeout: seconds before every process of the launch is killed (horovodrun, its ranks
            and anything they started) and TimeoutError raised, with the output so far;
            None: ``$HVD_GRADCOMP_TEST_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.
        transport: ``"gloo"`` or ``"mpi"`` (horovodrun's ``--gloo`` / ``--mpi``).

    Returns:
        ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr`` (text;
        horovodrun prefixes each rank's lines with ``[<rank>]<stdout>:`` / ``<stderr>:``).
    """
    if transport not in ("gloo", "mpi"):
        raise ValueError(f"transport must be 'gloo' or 'mpi', got {transport!r}")
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(np), f"--{transport}"]
    if transport == "mpi":
        cmd += ["--mpi-args=--allow-run-as-root --oversubscribe"]
    cmd += [str(a) for a in argv]
    defaults = {k: v for k, v in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("OMP_NUM_THREADS", "1")) if k not in os.environ}
    return run_process(cmd, env={**defaults, **(env or {})}, timeout=timeout, what="hvdrun")


def run_process(cmd, env=None, timeout=None, what=None):
    """Run ``cmd`` from the repository root in a session of its own, with a timeout that kills
    every process it started, wherever they went (their own sessions too: each carries this
    launch's marker in its environment). For commands that launch workers themselves:
    horovodrun (:func:`run_command`), the benchmark's sweeps.

    Args:
        cmd: the argv list.
        env: extra environment variables (the caller's are passed too, with the repository
            root first on PYTHONPATH).
        timeout: seconds, as :func:`run_command`'s.
        what: the name in the TimeoutError's message (default: the program).

    Returns:
        ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr`` (text).

    Raises:
        TimeoutError: at the timeout, once every process is killed, with the output so far.
    """
    timeout = default_timeout() if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    run_id = uuid.uuid4().hex
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    child_env.update(env or {})
    child_env[MARKER_ENV] = run_id
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = _kill_all(proc, run_id)
            out.seek(0)
            err.seek(0)
            raise TimeoutError(f"{what or os.path.basename(cmd[0])}: `{' '.join(cmd)}` hung for {timeout:g} s; "
                               f"ranks killed ({killed} processes)\n--- stdout (end) ---\n{out.read()[-3000:]}\n"
                               f"--- stderr (end) ---\n{err.read()[-3000:]}") from None
        except BaseException:
            _kill_all(proc, run_id)
            raise
        _kill_all(proc, run_id)  # stragglers (normally none)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


# ---------------------------------------------------------------- parent side helpers

_GLOO_BUILT = None


def _gloo_built():
    """Whether Horovod has Gloo, asked once per session instead of by every launch.

    ``horovod.run`` calls ``gloo_built()``, which imports Horovod's TensorFlow extension (so
    TensorFlow: 10-30 s on a small machine) in a fork, cached per process; the child process
    of each launch would pay it every time. Here the PyTorch extension answers (a few
    seconds, once), and Horovod's own check only when that one is not available.
    """
    global _GLOO_BUILT
    if _GLOO_BUILT is None:
        from horovod.common import util
        result = util._check_extension_lambda("torch", lambda ext: ext.gloo_built(), "built with Gloo", False)
        _GLOO_BUILT = bool(result if result is not None else util.gloo_built())
    return _GLOO_BUILT


def _dump_stacks(tmp, wait_s=2.0):
    """Ask every started worker to write its Python stacks; returns them as message text."""
    pids = {}
    for name in os.listdir(tmp):
        if name.startswith("pid-"):
            try:
                with open(os.path.join(tmp, name)) as f:
                    pids[name[4:]] = int(f.read().strip())
            except (OSError, ValueError):
                pass
    if not pids:
        return "\nNo worker had started the function (stuck in start-up?)."
    returned = {r for r in pids if os.path.exists(os.path.join(tmp, f"returned-{r}"))}
    for rank, pid in pids.items():
        if rank not in returned:
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
    texts = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for rank in pids:
            try:
                with open(os.path.join(tmp, f"stack-{rank}.txt")) as f:
                    texts[rank] = f.read()
            except OSError:
                pass
        if all(texts.get(r) for r in pids if r not in returned):
            break
        time.sleep(0.1)
    parts = []
    for rank in sorted(pids, key=lambda r: (len(r), r)):
        if rank in returned:
            parts.append(f"--- rank {rank} (pid {pids[rank]}): the function had returned")
            continue
        lines = (texts.get(rank) or "(no stack dumped)").rstrip().splitlines()
        if len(lines) > STACK_LINES:
            lines = lines[:STACK_LINES] + [f"... {len(lines) - STACK_LINES} more lines"]
        parts.append(f"--- rank {rank} (pid {pids[rank]}), most recent call first:\n" + "\n".join(lines))
    return "\nPython stacks of the ranks at the timeout:\n" + "\n".join(parts)


def _launch_processes(proc, run_id):
    """The launch's live processes: the child's tree plus any process carrying its marker."""
    import psutil
    found = {}
    try:
        root = psutil.Process(proc.pid)
        found[root.pid] = root
        for p in root.children(recursive=True):
            found[p.pid] = p
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        if p.pid in found or p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARKER_ENV) == run_id:
                found[p.pid] = p
        except (psutil.Error, OSError):
            pass  # gone, a zombie, or not ours to read
    return found


def _kill_all(proc, run_id):
    """Kill every process of the launch; returns how many were found alive."""
    import psutil
    seen = {}
    # Freeze before killing, and look again, so nothing forks or slips out of the tree meanwhile.
    for _ in range(3):
        new = {pid: p for pid, p in _launch_processes(proc, run_id).items() if pid not in seen}
        if not new:
            break
        for p in new.values():
            try:
                p.suspend()
            except psutil.Error:
                pass
        seen.update(new)
    for p in seen.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's session (its pid is the group id)
    except OSError:
        pass
    psutil.wait_procs(list(seen.values()), timeout=10)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return sum(1 for p in seen.values() if p.pid != proc.pid)


def _collect(tmp, what, np, returncode):
    """The ranks' results, or the worker's exception, from the child's files."""
    import cloudpickle
    path = os.path.join(tmp, "result.pkl")
    if not os.path.exists(path):
        raise WorkerError(f"hvdrun: the launcher of {what} on {np} ranks exited with status "
                          f"{returncode} without a result")
    with open(path, "rb") as f:
        result = cloudpickle.load(f)
    if result["ok"]:
        return result["results"]
    errors = []
    for name in os.listdir(tmp):
        if name.startswith("error-"):
            try:
                with open(os.path.join(tmp, name), "rb") as f:
                    errors.append(pickle.load(f))
            except Exception:  # noqa: BLE001 - a half-written file from a killed rank
                pass
    if not errors:
        raise WorkerError(f"hvdrun: horovod.run of {what} on {np} ranks failed and no rank reported "
                          f"an exception (crashed or killed?): {result['error']}",
                          worker_traceback=result["traceback"])
    errors.sort(key=lambda e: e["time"])
    first = errors[0]
    detail = (f"raised on rank {first['rank']} of {np} in {what} (hvdrun); worker traceback:\n"
              f"{first['traceback'].rstrip()}")
    others = [f"rank {e['rank']}: {e['type']}: {e['message']}" for e in errors[1:]]
    if others:
        detail += "\nlater, on other ranks:\n" + "\n".join(others)
    exc = _builtin_exception(first)
    if exc is None:
        exc = WorkerError(f"{first['type']}: {first['message']}")
    exc.rank, exc.worker_traceback, exc.errors = first["rank"], first["traceback"], errors
    # The worker's traceback rides as the cause: pytest prints it, and ``match=`` sees the
    # worker's message alone (anchors included).
    raise exc from WorkerError(detail, rank=first["rank"], worker_traceback=first["traceback"], errors=errors)


def _builtin_exception(error):
    """The worker's exception rebuilt, when its type is a built-in Exception; else None."""
    cls = getattr(builtins, error["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or error["module"] != "builtins":
        return None
    try:
        exc_args = pickle.loads(error["args"]) if error["args"] is not None else (error["message"],)
        return cls(*exc_args)
    except Exception:  # noqa: BLE001 - args this type does not take: fall back to WorkerError
        return None


# ---------------------------------------------------------------- child and worker side

class _Guarded:
    """Runs the worker function on a rank: records its pid (for stack dumps), and any exception."""

    def __init__(self, fn, tmp):
        self.fn = fn
        self.tmp = tmp

    def __call__(self, *args, **kwargs):
        import faulthandler
        import traceback
        rank = os.environ.get("HOROVOD_RANK", "x")
        global _STACK_FILE
        _STACK_FILE = open(os.path.join(self.tmp, f"stack-{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
        with open(os.path.join(self.tmp, f"pid-{rank}"), "w") as f:
            f.write(str(os.getpid()))
        try:
            result = self.fn(*args, **kwargs)
            open(os.path.join(self.tmp, f"returned-{rank}"), "w").close()
            return result
        except BaseException as e:
            try:
                exc_args = pickle.dumps(e.args)
                pickle.loads(exc_args)
            except Exception:  # noqa: BLE001
                exc_args = None
            record = {"rank": rank, "time": time.time(), "type": type(e).__qualname__,
                      "module": type(e).__module__, "message": str(e), "args": exc_args,
                      "traceback": traceback.format_exc()}
            part = os.path.join(self.tmp, f"error-{rank}.part")
            with open(part, "wb") as f:
                pickle.dump(record, f)
            os.replace(part, os.path.join(self.tmp, f"error-{rank}"))
            raise


_STACK_FILE = None


def _child_main(tmp):
    """The launcher process: ``horovod.run`` the job in ``tmp``; writes ``tmp/result.pkl``."""
    import traceback
    import cloudpickle
    try:  # orphaned descendants (workers whose middleman died) stay in this process's tree
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - not Linux: the marker scan still finds them
        pass
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        job = cloudpickle.load(f)
    try:
        import horovod
        import horovod.runner.launch
        if job["gloo_built"]:
            horovod.runner.launch.gloo_built = lambda verbose=False: True
        results = horovod.run(_Guarded(job["fn"], tmp), args=job["args"], kwargs=job["kwargs"],
                              num_proc=job["np"], use_gloo=True, verbose=0)
        result = {"ok": True, "results": results}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    part = os.path.join(tmp, "result.part")
    with open(part, "wb") as f:
        cloudpickle.dump(result, f)
    os.replace(part, os.path.join(tmp, "result.pkl"))
