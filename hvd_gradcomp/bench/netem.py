"""An emulated bandwidth-limited cluster on one machine: namespaces, veths and ``tc`` (only).

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
    5. Hosts of several ranks (``ranks_per_host`` K > 1, :class:`EmulatedNetwork`): one
       namespace, veth and address per *host*, holding ranks ``h*K .. h*K + K-1``. Traffic
       between ranks of one host goes to the namespace's own address, which Linux routes over
       the namespace's loopback, not through ``eth0``: it is not rate-limited (a node's
       internal fabric), while traffic between hosts crosses both hosts' rate-limited links,
       which the host's ranks share (one NIC per node). This is how the harness gives HSDP's
       rows a slow link between replicas only: one host per replica (``tta --fsdp-mesh``).
    6. Teardown removes the namespaces (their veths go with them), the bridge and the
       ``/etc/netns`` folders; it runs from ``finally``/``__exit__`` (Ctrl-C and SIGTERM
       included), is idempotent, and :func:`cleanup_stale` removes what a killed run left.

Only addresses of these namespaces and of the bridge are ever used; no other host is
contacted. Everything here needs root (``CAP_NET_ADMIN``) and iproute2. Without them,
:class:`LoopbackNetwork` runs the same ranks on 127.0.0.1 with no rate limit, and every
output of the harness says so (``network.mode == "loopback"``).

Ranks are started on these networks by :mod:`.launch`; :mod:`.linkcheck` verifies that a
network carries the rate it was asked for.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

__all__ = ["LinkConfig", "EmulatedNetwork", "LoopbackNetwork", "LinkError", "emulation_available",
           "netem_available", "make_network", "cleanup_stale"]

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
        bandwidth_mbit: rate limit in Mbit/s (10^6 bit/s), each direction, > 0; default 500,
            the TTA harness's ``--bandwidth`` default.
        latency_ms: one-way added delay per worker link in milliseconds, >= 0 (netem).
    """

    bandwidth_mbit: float = 500.0
    latency_ms: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_mbit > 0:
            raise ValueError(f"netem: bandwidth_mbit must be > 0, got {self.bandwidth_mbit}")
        if not self.latency_ms >= 0:
            raise ValueError(f"netem: latency_ms must be >= 0, got {self.latency_ms}")

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8


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

        from hvd_gradcomp.bench.launch import launch
        with EmulatedNetwork(2, LinkConfig(200, 0)) as net:
            launch(net, [sys.executable, "train.py"]).wait()

    Raises:
        LinkError: a setup command failed (everything created so far is removed first).
    """

    world_size: int
    link: LinkConfig = field(default_factory=LinkConfig)
    tag: str = field(default_factory=lambda: str(os.getpid()))
    ranks_per_host: int = 1
    mode = "netns"
    iface = "eth0"

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"netem: world_size must be >= 1, got {self.world_size}")
        k = self.ranks_per_host
        if not isinstance(k, int) or k < 1 or self.world_size % k:
            raise ValueError(f"netem: ranks_per_host must be an integer >= 1 dividing world_size "
                             f"{self.world_size}, got {k!r}")
        self.hosts = self.world_size // k
        self.bridge = f"{_PREFIX}{self.tag}br"
        self.namespaces = [f"{_PREFIX}{self.tag}w{i}" for i in range(self.hosts)]
        self.veths = [f"{_PREFIX}{self.tag}v{i}" for i in range(self.hosts)]
        if max(len(n) for n in [self.bridge] + self.veths) > 15:
            raise ValueError(f"netem: tag {self.tag!r} too long for Linux interface names")
        self.subnet = None
        self._active = False

    # ---- addresses ----
    @property
    def rendezvous_addr(self):
        return f"{self.subnet}.1"

    def host_addresses(self):
        """One address per host (namespace)."""
        return [f"{self.subnet}.{10 + i}" for i in range(self.hosts)]

    def addresses(self):
        """Per rank: its host's address."""
        hosts = self.host_addresses()
        return [hosts[r // self.ranks_per_host] for r in range(self.world_size)]

    def hostnames(self):
        """Per rank: its host's label (``hgc-w<host>``)."""
        return [f"{_PREFIX}-w{r // self.ranks_per_host}" for r in range(self.world_size)]

    def wrap(self, rank, argv):
        return ["ip", "netns", "exec", self.namespaces[rank // self.ranks_per_host]] + list(argv)

    def describe(self):
        k = self.ranks_per_host
        where = ("per worker link" if k == 1 else
                 f"per host link, {self.hosts} hosts of {k} ranks (traffic between ranks of one "
                 f"host unthrottled: ranks {', '.join(f'{h * k}-{h * k + k - 1}' for h in range(self.hosts))})")
        return {"mode": "netns", "bandwidth_mbit": self.link.bandwidth_mbit,
                "latency_ms": self.link.latency_ms, "world_size": self.world_size,
                "ranks_per_host": k, "hosts": self.hosts,
                "subnet": f"{self.subnet}.0/24", "qdisc": self._qdisc_text(),
                "note": f"emulated: {self.link.bandwidth_mbit:g} Mbit/s {where}"
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
        hosts = self.host_addresses()
        names = [f"{_PREFIX}-w{h}" for h in range(self.hosts)]
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.veths, hosts)):
            _run(["ip", "netns", "add", ns])
            folder = os.path.join(_NETNS_ETC, ns)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n")
                f.write(f"{addr} {host} {names[i]}\n")
                for j, other in enumerate(hosts):
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


def make_network(world_size: int, link: LinkConfig, loopback: bool = False, ranks_per_host: int = 1):
    """An :class:`EmulatedNetwork` when possible (``ranks_per_host`` ranks per namespace, their
    traffic among themselves unthrottled), else a :class:`LoopbackNetwork` saying why.

    Raises:
        ValueError: ``ranks_per_host`` < 1 or not dividing ``world_size`` (also on loopback).
    """
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1 or world_size % ranks_per_host:
        raise ValueError(f"netem: ranks_per_host must be an integer >= 1 dividing world_size "
                         f"{world_size}, got {ranks_per_host!r}")
    if loopback:
        return LoopbackNetwork(world_size, "loopback requested")
    ok, reason = emulation_available()
    if not ok:
        return LoopbackNetwork(world_size, reason)
    cleanup_stale()
    return EmulatedNetwork(world_size, link, ranks_per_host=ranks_per_host)
