"""An emulated bandwidth-limited cluster on one machine, and launching ranks into it.

On one machine loopback makes communication free, which hides everything compression is for.
:class:`EmulatedNetwork` gives each worker its own Linux network namespace and a link of a
chosen rate (and optional latency) to a bridge in the root namespace:

    1. A bridge ``hgc<pid>br`` with address ``10.231.S.1/24`` (S: the first third octet whose
       /24 no interface of this machine uses), in the root namespace.
    2. Per worker i: a namespace ``hgc<pid>w<i>``, a veth pair whose inner end is ``eth0``
       (address ``10.231.S.(10+i)``) and whose outer end ``hgc<pid>v<i>`` joins the bridge.
    3. Rate limit: ``tc tbf`` at the link rate on both ends of every veth, so each worker's
       upload and download are each limited to the rate. Latency (optional): a ``netem
       delay`` on the inner end, under the ``tbf``, so one worker-to-worker hop costs the
       latency once.
    4. A hosts file ``/etc/netns/<ns>/hosts`` that maps this machine's hostname and the
       workers' labels to the namespace's own address. ``ip netns exec`` mounts it over
       ``/etc/hosts``: Horovod 0.28.1 binds its process-set Gloo contexts to whatever the
       hostname resolves to (127.0.0.1 otherwise, unreachable from another namespace).
    5. Teardown removes the namespaces (their veths go with them), the bridge and the
       ``/etc/netns`` folders; it runs from ``finally``/``__exit__`` (Ctrl-C and SIGTERM
       included), is idempotent, and :func:`cleanup_stale` removes what a killed run left.

Only addresses of these namespaces and of the bridge are ever used; no other host is
contacted. Everything here needs root (``CAP_NET_ADMIN``) and iproute2. Without them,
:class:`LoopbackNetwork` runs the same ranks on 127.0.0.1 with no rate limit, and every
output of the harness says so (``network.mode == "loopback"``).

Ranks are launched without ``horovodrun`` (whose rendezvous sits on 127.0.0.1, unreachable
from a namespace): :func:`launch` starts Horovod's own ``RendezvousServer`` in this process
(it listens on all addresses of the root namespace, so the bridge address reaches it), builds
the host plan with ``get_host_assignments`` (one host per namespace), and starts each rank
with ``ip netns exec`` and the variables ``horovodrun`` would set. For ``torch.distributed``
(kind ``"ddp"``) it sets ``MASTER_ADDR`` (rank 0's namespace address), ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE`` and ``GLOO_SOCKET_IFNAME`` instead.

:func:`verify_link` times an all-reduce of a known size on the ranks and compares it with
the ring model (:func:`ring_allreduce_seconds`); :class:`LinkError` stops a run whose link is
off by more than the stated factor.
"""
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["LinkConfig", "EmulatedNetwork", "LoopbackNetwork", "LinkError", "emulation_available",
           "netem_available",
           "make_network", "launch", "Launch", "ring_allreduce_seconds", "verify_link",
           "cleanup_stale", "IMPORT_ROOT"]

# The folder holding the ``hvd_gradcomp`` package: a source checkout's root, or site-packages.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PREFIX = "hgc"  # names of everything we create: hgc<pid>br, hgc<pid>w<i>, hgc<pid>v<i>
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)(?:br|w\d+|v\d+)$")
_SUBNET = "10.231"  # 10.231.S.0/24, S chosen free on this machine
_NETNS_ETC = "/etc/netns"


class LinkError(RuntimeError):
    """The emulated link could not be set up, or does not behave like the stated model."""


@dataclass(frozen=True)
class LinkConfig:
    """One worker's link to the bridge.

    Attributes:
        bandwidth_mbit: rate limit in Mbit/s (10^6 bit/s), each direction, > 0.
        latency_ms: one-way added delay per worker link in milliseconds, >= 0 (netem).
    """

    bandwidth_mbit: float = 200.0
    latency_ms: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_mbit > 0:
            raise ValueError(f"netem: bandwidth_mbit must be > 0, got {self.bandwidth_mbit}")
        if not self.latency_ms >= 0:
            raise ValueError(f"netem: latency_ms must be >= 0, got {self.latency_ms}")

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8


def ring_allreduce_seconds(nbytes: int, world_size: int, bandwidth_mbit: float,
                           latency_ms: float = 0.0) -> float:
    """Ring all-reduce time model: ``2(N-1)/N * nbytes / rate + 2(N-1) * latency``.

    Each rank sends (and receives) ``2(N-1)/N`` of the buffer over its own link (reduce-scatter
    then all-gather), in ``2(N-1)`` rounds that each pay the one-way latency once.
    """
    n = world_size
    if n <= 1:
        return 0.0
    rate = bandwidth_mbit * 1e6 / 8
    return 2 * (n - 1) / n * nbytes / rate + 2 * (n - 1) * latency_ms / 1e3


def _run(cmd, check=True):
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and res.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def emulation_available():
    """``(True, "")`` when namespaces, veths and tc can be used here, else ``(False, reason)``.

    Checks: effective uid 0, ``ip`` and ``tc`` on PATH, and that a namespace can actually be
    created and removed (containers may refuse it even to root).
    """
    if os.name != "posix" or os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{_PREFIX}{os.getpid()}w99"
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        return False, f"`ip netns add` failed: {res.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def netem_available():
    """``(True, "")`` when the kernel has the ``netem`` qdisc (needed for ``latency_ms > 0``).

    Probed on the loopback of a throwaway namespace; some kernels (e.g. minimal VM kernels)
    are built without ``sch_netem`` and answer "Specified qdisc kind is unknown".
    """
    probe = f"{_PREFIX}{os.getpid()}w98"
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        return False, f"`ip netns add` failed: {res.stderr.strip()}"
    try:
        res = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                    "netem", "delay", "1ms"], check=False)
        return (True, "") if res.returncode == 0 else (False, res.stderr.strip())
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(verbose=False):
    """Remove namespaces, links and ``/etc/netns`` folders left by harness processes that died.

    Only names of our own pattern (``hgc<pid>...``) whose pid is no longer running are touched.
    Returns the names removed.
    """
    removed = []
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None:
        return removed
    netns = _run(["ip", "netns", "list"], check=False).stdout.split()
    links = re.findall(r"^\d+:\s+([^:@\s]+)", _run(["ip", "-o", "link", "show"], check=False).stdout, re.M)
    folders = os.listdir(_NETNS_ETC) if os.path.isdir(_NETNS_ETC) else []
    for name in sorted(set(netns) | set(links) | set(folders)):
        m = _NAME_RE.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if name in netns:
            _run(["ip", "netns", "del", name], check=False)
        if name in links:
            _run(["ip", "link", "del", name], check=False)
        if name in folders:
            shutil.rmtree(os.path.join(_NETNS_ETC, name), ignore_errors=True)
        removed.append(name)
    if verbose and removed:
        print(f"netem: removed stale {removed}", file=sys.stderr)
    return removed


class _Network:
    """What the launcher needs to know about a network (see the two subclasses)."""

    mode = "?"
    world_size = 0
    iface = "lo"
    rendezvous_addr = "127.0.0.1"
    link = None

    def addresses(self):
        raise NotImplementedError

    def wrap(self, rank, argv):
        """The command that runs ``argv`` as rank ``rank`` on this network."""
        return list(argv)

    def hostnames(self):
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    def setup(self):
        pass

    def teardown(self):
        pass


class LoopbackNetwork(_Network):
    """All ranks on 127.0.0.1 with no rate limit: the fallback without root.

    Communication is then nearly free, so time-to-accuracy differences between compressors
    show only their compute cost; every output of the harness says this.
    """

    mode = "loopback"

    def __init__(self, world_size: int, reason: str = ""):
        self.world_size = world_size
        self.reason = reason

    def addresses(self):
        return ["127.0.0.1"] * self.world_size

    def hostnames(self):
        return ["localhost"] * self.world_size

    def describe(self):
        return {"mode": "loopback", "bandwidth_mbit": None, "latency_ms": None,
                "world_size": self.world_size,
                "note": "LOOPBACK: no rate limit, communication nearly free"
                        + (f" ({self.reason})" if self.reason else "")}


@dataclass
class EmulatedNetwork(_Network):
    """Per-worker namespaces joined by rate-limited veth links to one bridge (module docs).

    Use as a context manager (set up on enter, always torn down on exit)::

        with EmulatedNetwork(2, LinkConfig(200, 0)) as net:
            launch(net, [sys.executable, "train.py"]).wait()

    Raises:
        LinkError: a setup command failed (everything created so far is removed first).
    """

    world_size: int
    link: LinkConfig = field(default_factory=LinkConfig)
    tag: str = field(default_factory=lambda: str(os.getpid()))
    mode = "netns"
    iface = "eth0"

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"netem: world_size must be >= 1, got {self.world_size}")
        self.bridge = f"{_PREFIX}{self.tag}br"
        self.namespaces = [f"{_PREFIX}{self.tag}w{i}" for i in range(self.world_size)]
        self.veths = [f"{_PREFIX}{self.tag}v{i}" for i in range(self.world_size)]
        if max(len(n) for n in [self.bridge] + self.veths) > 15:
            raise ValueError(f"netem: tag {self.tag!r} too long for Linux interface names")
        self.subnet = None
        self._active = False

    # ---- addresses ----
    @property
    def rendezvous_addr(self):
        return f"{self.subnet}.1"

    def addresses(self):
        return [f"{self.subnet}.{10 + i}" for i in range(self.world_size)]

    def hostnames(self):
        return [f"{_PREFIX}-w{i}" for i in range(self.world_size)]

    def wrap(self, rank, argv):
        return ["ip", "netns", "exec", self.namespaces[rank]] + list(argv)

    def describe(self):
        return {"mode": "netns", "bandwidth_mbit": self.link.bandwidth_mbit,
                "latency_ms": self.link.latency_ms, "world_size": self.world_size,
                "subnet": f"{self.subnet}.0/24", "qdisc": self._qdisc_text(),
                "note": f"emulated: {self.link.bandwidth_mbit:g} Mbit/s per worker link"
                        + (f", {self.link.latency_ms:g} ms one-way latency" if self.link.latency_ms else "")}

    def _qdisc_text(self):
        return f"tbf rate {self.link.bandwidth_mbit:g}mbit burst {self._burst_bytes()}b latency 100ms" + (
            f" under netem delay {self.link.latency_ms:g}ms" if self.link.latency_ms else "")

    def _burst_bytes(self):
        # Bucket depth: 2 ms of line rate, at least 32 KiB (a 64 KiB GSO segment is split by tbf
        # itself; a smaller bucket than that only adds scheduling jitter at high rates).
        return max(32768, int(self.link.bytes_per_second * 2e-3))

    @staticmethod
    def _free_subnet_octet():
        used = set(re.findall(rf"inet {re.escape(_SUBNET)}\.(\d+)\.",
                              _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout))
        used |= set(re.findall(rf"^{re.escape(_SUBNET)}\.(\d+)\.",
                               _run(["ip", "-4", "route", "show"], check=False).stdout, re.M))
        start = os.getpid() % 200
        for k in range(250):
            s = str((start + k) % 250 + 1)
            if s not in used:
                return s
        raise LinkError(f"netem: no free /24 in {_SUBNET}.0.0/16")

    # ---- setup / teardown ----
    def setup(self):
        if self._active:
            return
        self._active = True  # teardown removes whatever part of this got created
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise

    def _tc(self, ns, dev):
        pre = ["ip", "netns", "exec", ns] if ns else []
        rate = f"{self.link.bandwidth_mbit:g}mbit"
        tbf = ["tbf", "rate", rate, "burst", f"{self._burst_bytes()}b", "latency", "100ms"]
        if ns and self.link.latency_ms > 0:
            _run(pre + ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{self.link.latency_ms:g}ms", "limit", "100000"])
            _run(pre + ["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"] + tbf)
        else:
            _run(pre + ["tc", "qdisc", "replace", "dev", dev, "root"] + tbf)

    def _setup(self):
        if self.link.latency_ms > 0:
            ok, why = netem_available()
            if not ok:
                raise LinkError(f"netem: latency {self.link.latency_ms:g} ms needs the kernel's netem "
                                f"qdisc, which this kernel lacks ({why}); run without a latency")
        self.subnet = f"{_SUBNET}.{self._free_subnet_octet()}"
        host = socket.gethostname()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        names = self.hostnames()
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.veths, self.addresses())):
            _run(["ip", "netns", "add", ns])
            folder = os.path.join(_NETNS_ETC, ns)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n")
                f.write(f"{addr} {host} {names[i]}\n")
                for j, other in enumerate(self.addresses()):
                    if j != i:
                        f.write(f"{other} {names[j]}\n")
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._tc(None, veth)
            self._tc(ns, "eth0")

    def teardown(self):
        """Remove namespaces, bridge and /etc/netns folders; safe to call more than once."""
        if not self._active:
            return
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(os.path.join(_NETNS_ETC, ns), ignore_errors=True)
        for veth in self.veths:  # normally gone with their namespace
            if os.path.exists(f"/sys/class/net/{veth}"):
                _run(["ip", "link", "del", veth], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        if os.path.isdir(_NETNS_ETC) and not os.listdir(_NETNS_ETC):
            os.rmdir(_NETNS_ETC)
        self._active = False

    def exists(self) -> dict:
        """What of this network is present now: ``{"namespaces": [...], "bridge": bool, "folders": [...]}``."""
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        return {"namespaces": [n for n in self.namespaces if n in listed],
                "bridge": os.path.exists(f"/sys/class/net/{self.bridge}"),
                "folders": [n for n in self.namespaces if os.path.isdir(os.path.join(_NETNS_ETC, n))]}


def make_network(world_size: int, link: LinkConfig, loopback: bool = False):
    """An :class:`EmulatedNetwork` when possible, else a :class:`LoopbackNetwork` saying why."""
    if loopback:
        return LoopbackNetwork(world_size, "loopback requested")
    ok, reason = emulation_available()
    if not ok:
        return LoopbackNetwork(world_size, reason)
    cleanup_stale()
    return EmulatedNetwork(world_size, link)


# ---- launching ranks ----

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
        """Wait for every rank; a failing rank stops the others. Returns the first non-zero code or 0."""
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
        net: an :class:`EmulatedNetwork` (set up) or :class:`LoopbackNetwork`.
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
        raise ValueError(f"netem: kind must be 'horovod' or 'ddp', got {kind!r}")
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


def verify_link(net, mbytes=None, repeats=3, factor=2.0, timeout=120):
    """Time a float32 all-reduce of known size on ``net``'s ranks and check it against the model.

    Args:
        net: the network (set up). On loopback nothing is checked; the rate is only reported.
        mbytes: buffer size in MiB; default: what the model says takes about 0.5 s (1..64 MiB).
        repeats: timed all-reduces (the median is used), after one warm-up.
        factor: the measured time must lie in ``[model / 1.25, model * factor]``: slower means
            the link or the stack is not what was asked for; faster means no rate limit acts.

    Returns:
        dict with ``nbytes``, ``seconds`` (median), ``model_seconds``, ``ratio`` (measured /
        model), ``effective_mbit`` (2(N-1)/N * bytes * 8 / seconds / 1e6), ``ok``, ``factor``.

    Raises:
        LinkError: the ranks failed, or (emulated networks) the ratio is out of range; the
            message says what was measured and what was expected.
    """
    n = net.world_size
    link = net.link
    if mbytes is None:
        if link is None:
            mbytes = 16
        else:
            target = 0.5 * link.bytes_per_second * n / (2 * max(1, n - 1))
            mbytes = min(64, max(1, round(target / 2 ** 20)))
    nbytes = int(mbytes * 2 ** 20) // 4 * 4
    with tempfile.TemporaryDirectory(prefix="hgc-link-") as tmp:
        out = os.path.join(tmp, "link.json")
        run = launch(net, [sys.executable, "-m", "hvd_gradcomp.bench.linkcheck", "--nbytes",
                           str(nbytes), "--repeats", str(repeats), "--out", out], log_dir=tmp)
        code = run.wait(timeout=timeout)
        if code != 0 or not os.path.exists(out):
            logs = "".join(open(os.path.join(tmp, f)).read()[-2000:] for f in sorted(os.listdir(tmp))
                           if f.endswith(".log"))
            raise LinkError(f"link check: the all-reduce ranks failed (exit {code}) on the "
                            f"{net.mode} network.\n{logs}")
        with open(out) as f:
            result = json.load(f)
    seconds = result["seconds"]
    effective = 2 * (n - 1) / n * nbytes * 8 / seconds / 1e6 if n > 1 else float("inf")
    result.update(nbytes=nbytes, effective_mbit=effective, factor=factor, mode=net.mode)
    if link is None or net.mode == "loopback":
        result.update(model_seconds=None, ratio=None, ok=True)
        return result
    model = ring_allreduce_seconds(nbytes, n, link.bandwidth_mbit, link.latency_ms)
    ratio = seconds / model
    ok = 1 / 1.25 <= ratio <= factor
    result.update(model_seconds=model, ratio=ratio, ok=ok)
    if not ok:
        why = ("slower than the link allows: the emulation or the CPU cannot keep up with this rate; "
               "try a lower --bandwidth" if ratio > factor else
               "faster than the link allows: the rate limit is not acting")
        raise LinkError(
            f"link check failed: a {nbytes / 2**20:.1f} MiB float32 all-reduce over {n} ranks took "
            f"{seconds:.3f} s; the ring model at {link.bandwidth_mbit:g} Mbit/s"
            f"{f', {link.latency_ms:g} ms' if link.latency_ms else ''} says {model:.3f} s "
            f"(ratio {ratio:.2f}, allowed {1/1.25:.2f}..{factor:g}): {why}.")
    return result
