"""The link check: does the network carry the rate it was asked for?

Root side, :func:`verify_link`: times a float32 all-reduce of known size on the network's
ranks and compares it with the ring model (:func:`link_model_seconds`, i.e.
:func:`.ring.ring_allreduce_seconds` with one link latency per round); :class:`.netem.LinkError`
stops a run whose link is off by more than the stated factor.

Rank side, ``python -m hvd_gradcomp.bench.linkcheck --nbytes N --repeats R --out PATH`` (under
Horovod; :func:`verify_link` launches it): one warm-up all-reduce (op Sum) of ``N`` bytes, then
``R`` timed ones; rank 0 writes ``{"seconds": median, "all_seconds": [...], "world_size": n}``
to ``PATH``.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from .launch import launch
from .netem import LinkConfig, LinkError
from ..ring import ring_allreduce_seconds, ring_rounds, ring_wire_bytes

__all__ = ["verify_link", "link_model_seconds", "main"]


def link_model_seconds(nbytes: float, world_size: int, link: LinkConfig) -> float:
    """Ring model of one all-reduce on emulated links, seconds.

    ``2(N-1)/N * nbytes / rate + 2(N-1) * latency``: each rank sends (and receives) ``2(N-1)/N``
    of the buffer over its own link (reduce-scatter then all-gather), in ``2(N-1)`` rounds that
    each pay the one-way link latency once. 0.0 for one rank.

    Args:
        nbytes: buffer size in bytes.
        world_size: N, ranks.
        link: the per-worker link (rate in Mbit/s, latency in ms).
    """
    return ring_allreduce_seconds(nbytes, world_size, link.bytes_per_second,
                                  latency_s=ring_rounds(world_size) * link.latency_ms / 1e3)


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
            target = 0.5 * link.bytes_per_second * n / (2 * max(1, n - 1))  # 0.5 s of ring traffic
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
    effective = ring_wire_bytes(nbytes, n) * 8 / seconds / 1e6 if n > 1 else float("inf")
    result.update(nbytes=nbytes, effective_mbit=effective, factor=factor, mode=net.mode)
    if link is None or net.mode == "loopback":
        result.update(model_seconds=None, ratio=None, ok=True)
        return result
    model = link_model_seconds(nbytes, n, link)
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


def main(argv=None):
    """The rank side (``python -m hvd_gradcomp.bench.linkcheck``, under Horovod; module docs).

    Returns 0; raises SystemExit when the all-reduce returns a wrong sum.
    """
    parser = argparse.ArgumentParser(description="One timed float32 all-reduce of known size, "
                                                 "on every rank (the link check).")
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch
    import horovod.torch as hvd
    hvd.init()
    x = torch.ones(args.nbytes // 4, dtype=torch.float32)
    hvd.allreduce(torch.ones(1), op=hvd.Sum, name="linkcheck.warm0")
    hvd.allreduce(x, op=hvd.Sum, name="linkcheck.warm1")
    times = []
    for i in range(args.repeats):
        hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"linkcheck.sync{i}")  # start together
        t0 = time.perf_counter()
        y = hvd.allreduce(x, op=hvd.Sum, name=f"linkcheck.{i}")
        times.append(time.perf_counter() - t0)
    if float(y[0]) != hvd.size():
        raise SystemExit(f"linkcheck: all-reduce returned {float(y[0])}, expected {hvd.size()}")
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"seconds": statistics.median(times), "all_seconds": times,
                       "world_size": hvd.size()}, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
