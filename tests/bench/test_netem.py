"""The emulated network: set-up, verification of what was built, teardown, and the fallback.

Namespace tests need root (CAP_NET_ADMIN) and iproute2; elsewhere they are skipped with the
reason. They use only the addresses of the namespaces they create.
"""
import os
import subprocess
import sys
import time

import pytest

from hvd_gradcomp.bench import launch as launcher, linkcheck, netem

_OK, _WHY = netem.emulation_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"network emulation unavailable: {_WHY}")


def test_link_config_and_link_model():
    assert netem.LinkConfig(100).bytes_per_second == 12.5e6
    with pytest.raises(ValueError, match="bandwidth_mbit must be > 0, got 0"):
        netem.LinkConfig(0)
    with pytest.raises(ValueError, match="latency_ms must be >= 0"):
        netem.LinkConfig(100, -1)
    # 2 ranks: each sends the whole buffer once; 100 MB over 1 Gbit/s = 0.8 s (more in tests/core/test_ring.py)
    assert linkcheck.link_model_seconds(100e6, 2, netem.LinkConfig(1000)) == pytest.approx(0.8)
    assert linkcheck.link_model_seconds(100e6, 4, netem.LinkConfig(1000, 1)) == pytest.approx(1.2 + 0.006)
    assert linkcheck.link_model_seconds(100e6, 1, netem.LinkConfig(1000)) == 0.0


def _read_logs(folder, n):
    return [open(os.path.join(folder, f"rank{r}.log")).read().strip() for r in range(n)]


_PRINT_ENV = ("import os, socket; e = os.environ; print(e.get('HOROVOD_RANK'), e.get('HOROVOD_SIZE'), "
              "e.get('HOROVOD_GLOO_IFACE'), e.get('HOROVOD_GLOO_RENDEZVOUS_ADDR'), e.get('HOROVOD_HOSTNAME'), "
              "e.get('RANK'), e.get('MASTER_ADDR'), e.get('GLOO_SOCKET_IFNAME'), "
              "socket.gethostbyname(socket.gethostname()))")


def test_fallback_without_root_is_loopback_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(netem, "emulation_available", lambda: (False, "not running as root (test)"))
    net = netem.make_network(2, netem.LinkConfig(200))
    assert isinstance(net, netem.LoopbackNetwork)
    d = net.describe()
    assert d["mode"] == "loopback" and d["bandwidth_mbit"] is None
    assert d["note"].startswith("LOOPBACK") and "not running as root (test)" in d["note"]
    with net:  # set-up and teardown are no-ops
        run = launcher.launch(net, [sys.executable, "-c", _PRINT_ENV], log_dir=str(tmp_path))
        assert run.wait(timeout=60) == 0
    logs = _read_logs(tmp_path, 2)
    assert logs[0].split()[:5] == ["0", "2", "lo", "127.0.0.1", "localhost"]
    assert logs[1].split()[:3] == ["1", "2", "lo"]
    assert isinstance(netem.make_network(2, netem.LinkConfig(200), loopback=True), netem.LoopbackNetwork)


def test_launch_ddp_variables_and_failure_stops_the_others(tmp_path):
    net = netem.LoopbackNetwork(2)
    run = launcher.launch(net, [sys.executable, "-c", _PRINT_ENV], kind="ddp", log_dir=str(tmp_path))
    assert run.wait(timeout=60) == 0
    fields = _read_logs(tmp_path, 2)[1].split()
    assert fields[5:8] == ["1", "127.0.0.1", "lo"]
    # rank 0 fails at once, rank 1 would sleep for a minute: wait() stops it and reports rank 0's code
    script = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '0' else time.sleep(60)"
    t0 = time.monotonic()
    run = launcher.launch(net, [sys.executable, "-c", script], kind="ddp", log_dir=str(tmp_path))
    assert run.wait(timeout=60) == 3
    assert time.monotonic() - t0 < 30 and all(p.poll() is not None for p in run.procs)
    with pytest.raises(ValueError, match="kind must be 'horovod' or 'ddp'"):
        launcher.launch(net, ["true"], kind="mpi")


# Frees a 64 MiB block and prints how many free bytes glibc's heap then holds.
_FREED_KEPT = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(64 << 20)
ctypes.memset(p, 1, 64 << 20)
libc.free(ctypes.c_void_p(p))
print(libc.mallinfo2().fordblks)
"""


def test_malloc_keep_keeps_freed_memory_in_the_heap(tmp_path):
    assert launcher.malloc_env("keep", {}) == {"GLIBC_TUNABLES": launcher.MALLOC_KEEP_TUNABLES}
    appended = launcher.malloc_env("keep", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert appended["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + launcher.MALLOC_KEEP_TUNABLES
    assert launcher.malloc_env("system", {"GLIBC_TUNABLES": "x"}) == {}
    with pytest.raises(ValueError, match=r"malloc policy must be one of \['keep', 'system'\], got 'fast'"):
        launcher.malloc_env("fast")
    # Through launch(), on every rank: the freed 64 MiB stays in the heap (keep) or goes back
    # to the kernel (glibc's default maps blocks over 32 MiB and unmaps them on free).
    net = netem.LoopbackNetwork(2)
    for env, kept in ((launcher.malloc_env("keep", {}), True), ({"GLIBC_TUNABLES": ""}, False)):
        run = launcher.launch(net, [sys.executable, "-c", _FREED_KEPT], kind="ddp", env=env,
                              log_dir=str(tmp_path))
        assert run.wait(timeout=60) == 0
        for text in _read_logs(tmp_path, 2):
            assert (int(text.split()[-1]) >= 64 << 20) is kept, (env, text)


def test_interrupted_wait_stops_every_rank(tmp_path):
    """Ctrl-C (or the sweep's SIGTERM handler) while waiting, e.g. in the link check, must not
    leave ranks running."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt("test")

    net = netem.LoopbackNetwork(2)
    run = launcher.launch(net, [sys.executable, "-c", "import time; time.sleep(60)"], kind="ddp",
                          log_dir=str(tmp_path))
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            run.wait(timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert all(p.poll() is not None for p in run.procs)


def _qdiscs(net, i):
    inner = subprocess.run(["ip", "netns", "exec", net.namespaces[i], "tc", "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout
    outer = subprocess.run(["tc", "qdisc", "show", "dev", net.veths[i]], capture_output=True, text=True).stdout
    return inner, outer


def _gone(net):
    state = net.exists()
    return not state["namespaces"] and not state["bridge"] and not state["folders"] and not any(
        os.path.exists(f"/sys/class/net/{v}") for v in net.veths)


@needs_netns
def test_namespaces_are_built_verified_and_removed(tmp_path):
    has_netem, why = netem.netem_available()
    net = netem.EmulatedNetwork(2, netem.LinkConfig(200, latency_ms=2 if has_netem else 0))
    with net:
        state = net.exists()
        assert state == {"namespaces": net.namespaces, "bridge": True, "folders": net.namespaces}
        for i in range(2):
            inner, outer = _qdiscs(net, i)
            assert "tbf" in inner and "200Mbit" in inner
            assert ("netem" in inner and "delay 2ms" in inner) if has_netem else "netem" not in inner
            assert "tbf" in outer and "200Mbit" in outer and "netem" not in outer
        # The launcher's variables, and the hosts file: the hostname resolves to the
        # namespace's own address (what Horovod's process-set contexts bind to).
        run = launcher.launch(net, [sys.executable, "-c", _PRINT_ENV], log_dir=str(tmp_path))
        assert run.wait(timeout=60) == 0
        for r, line in enumerate(_read_logs(tmp_path, 2)):
            f = line.split()
            assert f[:5] == [str(r), "2", "eth0", net.rendezvous_addr, f"hgc-w{r}"]
            assert f[-1] == net.addresses()[r]
        # Worker 1 reaches worker 0 through the bridge (a TCP round trip).
        server = subprocess.Popen(
            ["ip", "netns", "exec", net.namespaces[0], sys.executable, "-c",
             "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             f"s.bind(('{net.addresses()[0]}', 47001)); s.listen(1); c, _ = s.accept(); c.sendall(c.recv(16))"])
        client = ("import socket, time\nfor _ in range(50):\n    try:\n"
                  f"        c = socket.create_connection(('{net.addresses()[0]}', 47001), timeout=2); break\n"
                  "    except OSError: time.sleep(0.1)\nc.sendall(b'ping'); print(c.recv(16).decode())")
        out = subprocess.run(["ip", "netns", "exec", net.namespaces[1], sys.executable, "-c", client],
                             capture_output=True, text=True, timeout=30)
        server.wait(timeout=10)
        assert out.stdout.strip() == "ping", out.stderr
    assert _gone(net)
    net.teardown()  # idempotent


@needs_netns
def test_teardown_runs_after_an_error_and_stale_leftovers_are_removed():
    net = netem.EmulatedNetwork(2, netem.LinkConfig(100))
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            assert net.exists()["bridge"]
            raise RuntimeError("boom")
    assert _gone(net)
    # A network whose owner died (a finished child's pid) is found and removed by cleanup_stale.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = netem.EmulatedNetwork(2, netem.LinkConfig(100), tag=str(child.pid))
    stale.setup()
    assert stale.exists()["bridge"]
    removed = netem.cleanup_stale()
    assert set(stale.namespaces) | {stale.bridge} <= set(removed)
    assert _gone(stale)


@needs_netns
def test_latency_without_netem_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(netem, "netem_available", lambda: (False, "Specified qdisc kind is unknown."))
    net = netem.EmulatedNetwork(2, netem.LinkConfig(100, latency_ms=5))
    with pytest.raises(netem.LinkError, match="latency 5 ms needs the kernel's netem qdisc"):
        net.setup()
    assert _gone(net)


@needs_netns
def test_setup_failure_leaves_nothing(monkeypatch):
    net = netem.EmulatedNetwork(2, netem.LinkConfig(100))
    real = netem.EmulatedNetwork._tc
    calls = []

    def failing_tc(self, ns, dev):
        calls.append(dev)
        if len(calls) == 3:  # second worker's outer end
            raise netem.LinkError("tc refused (test)")
        return real(self, ns, dev)

    monkeypatch.setattr(netem.EmulatedNetwork, "_tc", failing_tc)
    with pytest.raises(netem.LinkError, match="tc refused"):
        net.setup()
    assert _gone(net)
