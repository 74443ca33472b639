"""``python -m hvd_gradcomp.bench percall``: the codec per step on Horovod's per-tensor path, warm
and with the caches evicted before each call, as training runs it.

``hvd.DistributedOptimizer`` without groups calls ``compress`` once per gradient, in its
backward hook, and ``decompress`` once per gradient in ``synchronize()``. In training the
backward's kernels run between two hooks and the optimizer's work between steps: they evict the
caches that the codec's code (Python frames, PyTorch's dispatcher, the C loops) and data were
in, so each call runs cold. A codec that costs a few microseconds a call in a tight loop costs
several times that there: on ``lm-comm``'s sweeps the codec's share of the step was 2.6x what a
warm loop of the same calls predicts (docs/bench.md, "THC's per-call cost"). This command
measures both.

Method: one process after ``hvd.init()`` (world size 1: neither call waits on another rank, so
the codec's cost is the same at any world size but for the world size's layouts); the
workload's model (``lm-comm``: 29 tensors, 470,528 parameters; ``lm``: the wider one) with
gradients drawn once from a normal distribution; for each spec (``Compression.from_spec``), a
step compresses every gradient in backward order (the last parameter first, with its name, as
the hooks do) and then decompresses every payload in that order, each call timed with the host
clock and summed. Cold: before every call, one pass (``neg_``) over a buffer of ``--evict-mb``
MiB (default 16, well above a core's L2), outside the timed part. Warm and cold steps alternate;
the table gives the medians over ``--steps`` steps of each, and each against the ``fp16`` row of
the same run (added when missing).

Run it on a quiet machine, one thread (``--threads``, default 1): the figures are times.
"""
import argparse
import statistics
import time

__all__ = ["main", "measure"]


def _model(workload: str):
    import torch
    from hvd_gradcomp.bench.workers.torch_workloads import WORKLOADS, ByteTransformer
    if workload not in ("lm", "lm-comm"):
        raise ValueError(f"percall: --workload must be lm or lm-comm, got {workload!r}")
    cls = WORKLOADS[workload]
    torch.manual_seed(0)
    return ByteTransformer(64, cls.width, 4, cls.layers)


def measure(specs, workload="lm-comm", steps=20, warmup=3, evict_mb=16.0):
    """``{spec: (warm ms, cold ms)}``: the medians of the codec's time per step (module
    docstring). Raises ValueError for an unknown spec or workload, before anything is timed."""
    import torch
    from torch_backend import Compression
    model = _model(workload)
    named = [(n, torch.randn_like(p)) for n, p in model.named_parameters()][::-1]  # backward order
    compressors = {spec: Compression.from_spec(spec) for spec in specs}
    junk = torch.ones(max(1, int(evict_mb * (1 << 20)) // 4))

    def step(c, cold):
        total, payloads = 0.0, []
        for name, g in named:
            if cold:
                junk.neg_()
            t0 = time.perf_counter()
            payloads.append(c.compress(g, name=name))
            total += time.perf_counter() - t0
        for payload, ctx in payloads:
            if cold:
                junk.neg_()
            t0 = time.perf_counter()
            c.decompress(payload, ctx)
            total += time.perf_counter() - t0
        return total

    out = {}
    for spec, c in compressors.items():
        for _ in range(warmup):
            step(c, False)
        warm, cold = [], []
        for _ in range(steps):
            warm.append(step(c, False))
            cold.append(step(c, True))
        out[spec] = (1e3 * statistics.median(warm), 1e3 * statistics.median(cold))
    return out, len(named), sum(g.numel() for _, g in named)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench percall",
                                 description="codec time per step on Horovod's per-tensor path, warm and "
                                             "with the caches evicted before each call")
    ap.add_argument("--specs", default="fp16; thc; thc:error_feedback=false; topkc:0.1",
                    help="specs separated by ';' (a spec's options use ','; fp16 is added first "
                         "when missing)")
    ap.add_argument("--workload", default="lm-comm", help="lm-comm (default) or lm: whose gradients")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode and spec (median; default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--evict-mb", type=float, default=16.0, help="MiB passed over before each cold call (16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.evict_mb < 0:
        ap.error("--steps must be >= 1, --warmup and --evict-mb >= 0")
    import subprocess
    import torch
    import horovod.torch as hvd
    torch.set_num_threads(args.threads)
    hvd.init()
    specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    if "fp16" not in specs:
        specs.insert(0, "fp16")
    results, tensors, params = measure(specs, args.workload, args.steps, args.warmup, args.evict_mb)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    print(f"codec per step on Horovod's per-tensor path: {args.workload} ({tensors} tensors, {params:,} "
          f"parameters), compress then decompress each, one process; {args.threads} thread(s), host clock, "
          f"medians of {args.steps} steps; cold: {args.evict_mb:g} MiB evicted before each call; "
          f"torch {torch.__version__}; commit {commit}")
    warm16, cold16 = results["fp16"]
    head = f"{'spec':<28} {'warm ms':>8} {'cold ms':>8} {'cold/warm':>9} {'warm/fp16':>9} {'cold/fp16':>9}"
    print(head)
    print("-" * len(head))
    for spec, (warm, cold) in results.items():
        print(f"{spec:<28} {warm:8.2f} {cold:8.2f} {cold / warm:8.2f}x {warm / warm16:8.2f}x {cold / cold16:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
