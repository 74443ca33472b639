"""Starting the ranks of one run on a network of :mod:`.netem` (emulated or loopback).

Ranks are launched without ``horovodrun`` (whose rendezvous sits on 127.0.0.1, unreachable
from a namespace): :func:`launch` starts Horovod's own ``RendezvousServer`` in this process
(it listens on all addresses of the root namespace, so the bridge address reaches it), builds
the host plan with ``get_host_assignments`` (one host per namespace), and starts each rank
with the network's wrapper (``ip netns exec`` on an emulated network) and the variables
``horovodrun`` would set. For ``torch.distributed`` (kind ``"ddp"``) it sets ``MASTER_ADDR``
(rank 0's address), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``GLOO_SOCKET_IFNAME``
instead. Every rank runs in its own process group; :class:`Launch` waits for them and stops
them all when one fails.
"""
import os
import random
import signal
import socket
import subprocess
import time

__all__ = ["launch", "Launch", "IMPORT_ROOT", "MALLOC_POLICIES", "MALLOC_KEEP_TUNABLES", "MALLOC_TRIM_THRESHOLD", "malloc_env"]

# The folder holding the ``hvd_gradcomp`` package: a source checkout's root, or site-packages.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The "keep" malloc policy, shared by the TTA sweep's ranks (:func:`malloc_env`) and the
# overhead benchmark's own process (``overhead.apply_malloc_policy``): glibc keeps freed memory
# for reuse, with no mmap'd blocks and no trimming of the heap. glibc's default maps every
# block over its dynamic mmap threshold (128 KiB at first, at most 32 MiB) and unmaps it on
# free, so each new gradient-sized tensor is page-faulted in again, every step: on the 2-core
# VM the digits model's FP16 codec took 46 ms a step against 10 ms kept (5 elementwise
# passes over 17 MB), and Horovod FP16's 1 Gbit/s TTA 28.0 s against 21.1 s (docs/bench.md,
# "CPU effects"). GPU tensors are unaffected (CUDA's caching allocator keeps its blocks);
# PyTorch's CPU tuning guide gives the same advice (jemalloc or tcmalloc). The resident
# memory stays at its peak.
MALLOC_POLICIES = ("keep", "system")
MALLOC_TRIM_THRESHOLD = 2 ** 31 - 1  # bytes of free heap top glibc may keep
MALLOC_KEEP_TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={MALLOC_TRIM_THRESHOLD}"


def malloc_env(policy, environ=None):
    """The variables that give child processes malloc ``policy`` (one of :data:`MALLOC_POLICIES`):
    ``{"GLIBC_TUNABLES": ...}`` for ``"keep"``, nothing for ``"system"``.

    A ``GLIBC_TUNABLES`` already set in ``environ`` (default ``os.environ``) is kept, with ours
    appended (glibc applies the tunables in order, so ours win where they repeat one).

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in MALLOC_POLICIES:
        raise ValueError(f"malloc policy must be one of {list(MALLOC_POLICIES)}, got {policy!r}")
    if policy == "system":
        return {}
    old = (os.environ if environ is None else environ).get("GLIBC_TUNABLES")
    return {"GLIBC_TUNABLES": f"{old}:{MALLOC_KEEP_TUNABLES}" if old else MALLOC_KEEP_TUNABLES}


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _site_dirs():
    import site
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    return {os.path.realpath(d) for d in dirs + ([user] if user else [])}


def _base_env(world_size):
    """The ranks' environment: ours, plus what makes ``python -m hvd_gradcomp...`` import.

    A source checkout that is not installed goes first on PYTHONPATH, so the ranks import the
    same code as this process; an installed package is found by the interpreter anyway (and a
    site-packages folder on PYTHONPATH would shadow the standard library, so it is not added).
    """
    env = dict(os.environ)
    if os.path.realpath(IMPORT_ROOT) not in _site_dirs():
        env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    # One process per core: the ranks share this machine's cores.
    threads = max(1, (os.cpu_count() or 1) // max(1, world_size))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


class Launch:
    """The rank processes of one launch (and Horovod's rendezvous server, if any).

    Attributes:
        procs: one ``subprocess.Popen`` per rank; rank 0's stdout is a pipe when requested.
    """

    def __init__(self, procs, server=None, logs=()):
        self.procs, self._server, self._logs = procs, server, list(logs)

    def poll(self):
        """None while any rank runs; else the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            return next(c for c in codes if c not in (None, 0))
        return None if any(c is None for c in codes) else 0

    def wait(self, timeout=None):
        """Wait for every rank; a failing rank stops the others. Returns the first non-zero code
        or 0. Interrupted (Ctrl-C, the sweep's SIGTERM handler, any exception), it stops every
        rank before passing the exception on, so no rank outlives its launcher."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                code = self.poll()
                if code is not None:
                    if code != 0:
                        self.kill()
                    return code
                if deadline is not None and time.monotonic() > deadline:
                    self.kill()
                    return 124
                time.sleep(0.1)
        except BaseException:
            self.kill()
            raise
        finally:
            self.close()

    def kill(self):
        """Stop every rank still running (its whole process group: SIGTERM, then SIGKILL)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()

    def close(self):
        if self._server is not None:
            self._server.stop()
            self._server = None
        for f in self._logs:
            f.close()
        self._logs = []


def launch(net, argv, *, kind="horovod", env=None, log_dir=None, pipe_rank0=False):
    """Start ``argv`` once per rank of ``net``.

    Args:
        net: a :class:`.netem.EmulatedNetwork` (set up) or :class:`.netem.LoopbackNetwork`.
        argv: the command each rank runs (list of str; the same for every rank).
        kind: ``"horovod"`` (rendezvous server + HOROVOD_* variables) or ``"ddp"``
            (torch.distributed env:// variables).
        env: extra environment variables for every rank.
        log_dir: where each rank's stdout/stderr go (``rank<i>.log``); default: inherited.
        pipe_rank0: make rank 0's stdout a text pipe (``launch.procs[0].stdout``) for progress.

    The ranks run in this process's working directory (relative paths in ``argv`` mean the
    same to them as here).

    Returns:
        a :class:`Launch`.
    """
    n = net.world_size
    base = _base_env(n)
    base.update(env or {})
    server = None
    per_rank = [{} for _ in range(n)]
    if kind == "horovod":
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        names = net.hostnames()
        slots = {}
        for h in names:
            slots[h] = slots.get(h, 0) + 1
        plan = get_host_assignments(parse_hosts(",".join(f"{h}:{c}" for h, c in slots.items())), n)
        server = RendezvousServer(verbose=0)
        port = server.start()
        server.init(plan)
        for slot in plan:
            per_rank[slot.rank] = {
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": net.rendezvous_addr,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": net.iface,
                "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
                "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
                "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
                "HOROVOD_CROSS_SIZE": str(slot.cross_size)}
    elif kind == "ddp":
        # A fresh namespace has every port free; loopback asks the OS for one.
        port = _free_port() if net.mode == "loopback" else random.randrange(20000, 60000)
        for r in range(n):
            per_rank[r] = {"MASTER_ADDR": net.addresses()[0], "MASTER_PORT": str(port),
                           "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                           "GLOO_SOCKET_IFNAME": net.iface}
    else:
        raise ValueError(f"launch: kind must be 'horovod' or 'ddp', got {kind!r}")
    procs, logs = [], []
    try:
        for r in range(n):
            renv = dict(base)
            renv.update(per_rank[r])
            out = err = None
            if log_dir is not None:
                f = open(os.path.join(log_dir, f"rank{r}.log"), "w")
                logs.append(f)
                out = err = f
            if r == 0 and pipe_rank0:
                out = subprocess.PIPE
            procs.append(subprocess.Popen(net.wrap(r, argv), env=renv, stdout=out, stderr=err,
                                          start_new_session=True,
                                          text=True if out is subprocess.PIPE else None,
                                          bufsize=1 if out is subprocess.PIPE else -1))
    except BaseException:
        Launch(procs, server, logs).kill()
        if server is not None:
            server.stop()
        for f in logs:
            f.close()
        raise
    return Launch(procs, server, logs)
