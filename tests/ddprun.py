"""Run a function on N real ``torch.distributed`` processes (Gloo on CPU) and collect each
rank's result: the DDP twin of :mod:`tests.hvdrun`.

``run(fn, np=2, args=(), timeout=None)``: ``fn`` (a module-level function, imported by name
in each rank) is called as ``fn(*args)`` on every rank after
``dist.init_process_group("gloo")`` (rank, world size and a free TCP port in the
environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as ``torchrun``
sets them). It returns ``[result of rank 0, result of rank 1, ...]`` (picklable values).

A launch is one child process in a session of its own that starts the ranks; at the timeout
(``timeout``, else ``$HVD_GRADCOMP_TEST_TIMEOUT``, else :data:`tests.hvdrun.DEFAULT_TIMEOUT`
seconds) the whole session is killed and :class:`TimeoutError` raised. An exception on a rank
is re-raised in the caller as the same built-in type with the same message (else
:class:`~tests.hvdrun.WorkerError`), the rank and its traceback in the cause.
"""
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile

import builtins

from tests.hvdrun import ROOT, WorkerError, default_timeout

__all__ = ["run", "launch_command"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def launch_command(argv, env=None, timeout=None):
    """Run ``argv`` (e.g. ``torchrun ... script``) in a session of its own; returns
    ``(returncode, output)``; at the timeout the session is killed and TimeoutError raised."""
    timeout = default_timeout() if timeout is None else timeout
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        raise TimeoutError(f"{' '.join(argv)} hung for {timeout:g} s; its processes were killed") from None
    return proc.returncode, out


def run(fn, np=2, args=(), timeout=None):
    """``[fn(*args) on rank 0, on rank 1, ...]`` on ``np`` Gloo ranks (module docstring)."""
    timeout = default_timeout() if timeout is None else timeout
    with tempfile.TemporaryDirectory(prefix="ddprun-") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((fn.__module__, fn.__qualname__, np, args), f)
        argv = [sys.executable, "-c", f"from tests.ddprun import _child; _child({tmp!r})"]
        code, out = launch_command(argv, timeout=timeout)
        results, errors = [], []
        for rank in range(np):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append((rank, None, None, f"rank {rank} returned nothing (exit {code}):\n{out[-4000:]}"))
                results.append(None)
                continue
            with open(path, "rb") as f:
                value, kind, message, trace = pickle.load(f)
            results.append(value)
            if kind is not None:
                errors.append((rank, kind, message, trace))
        if errors:
            rank, kind, message, trace = errors[0]
            cause = WorkerError(f"rank {rank}: {trace}", rank=rank, worker_traceback=trace,
                                errors=[e[0] for e in errors])
            cls = getattr(builtins, kind or "", None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(message) from cause
            raise WorkerError(f"{kind}: {message}", rank=rank, worker_traceback=trace) from cause
        return results


def _child(tmp):
    """The launch: one process per rank, all in this session."""
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        _, _, np, _ = pickle.load(f)
    port = str(_free_port())
    procs = []
    for rank in range(np):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(np), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c",
                                       f"from tests.ddprun import _rank; _rank({tmp!r})"], env=env))
    codes = [p.wait() for p in procs]
    sys.exit(max(codes))


def _rank(tmp):
    import importlib
    import traceback
    rank = int(os.environ["RANK"])
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        module, name, np, args = pickle.load(f)
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        result = (fn(*args), None, None, "")
    except BaseException as e:  # noqa: B036 - every failure goes back to the caller
        result = (None, type(e).__name__ if type(e).__module__ == "builtins" else
                  f"{type(e).__module__}.{type(e).__name__}", str(e), traceback.format_exc())
    with open(os.path.join(tmp, f"rank{rank}.pkl.part"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(tmp, f"rank{rank}.pkl.part"), os.path.join(tmp, f"rank{rank}.pkl"))
    sys.stdout.flush()
    os._exit(0 if result[1] is None else 1)  # no teardown: a peer that raised may never reach a barrier
