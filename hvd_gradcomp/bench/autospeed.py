"""``python -m hvd_gradcomp.bench autospeed``: ``auto`` against fixed fp16 on the link as it is.

On an unthrottled link ``auto`` should settle on fp16 and then cost what fp16 costs: its
plain steps are the chosen candidate's own step plus one count lane (:mod:`hvd_gradcomp.auto`,
*Agreement*). This measures it with real Horovod ranks (PyTorch, Gloo, CPU):

1. Build an ``auto`` compressor (default candidates, the link measured by ``calibrate()``) and
   time it; build a second one (the calibration is shared: :data:`hvd_gradcomp.auto.CALIBRATIONS`).
2. Run ``--steps`` steps of a model's gradients (random float32 tensors of ``--shapes``, one
   all-reduce each, sequential), first with ``fp16``, then with ``auto``, then fp16 again,
   each step timed on the host after the last all-reduce returns, the slowest rank's time.
3. Report: the first window's cost (``auto``'s steps ``0 .. warmup - 1``: the sync step and
   the measured steps, against fp16's median step), and after it ``auto``'s median step
   against fp16's (the mean of the two fp16 runs' medians), and what ``auto`` chose.

Timings on a shared machine are noisy; repeat the run and read the spread.
"""
import argparse
import json
import statistics
import sys
import time

DEFAULT_SHAPES = "1024x1024,1024,512x1024,512,10x512,10"


def _worker(shapes, steps, candidates):
    import horovod.torch as hvd
    import numpy as np
    import torch

    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    gen = np.random.default_rng([rank, 11])
    grads = [[torch.as_tensor(gen.standard_normal(s), dtype=torch.float32) for s in shapes]
             for _ in range(4)]

    def slowest(seconds):
        return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="autospeed.max")[0])

    start = time.perf_counter()
    auto = Compression.auto(**({"candidates": candidates} if candidates else {}))
    built_s = slowest(time.perf_counter() - start)
    start = time.perf_counter()
    Compression.auto(**({"candidates": candidates} if candidates else {}))
    cached_s = slowest(time.perf_counter() - start)

    def run(comp, tag):
        times = []
        for t in range(steps):
            start = time.perf_counter()
            for i, g in enumerate(grads[t % len(grads)]):
                hvd.allreduce(g, name=f"{tag}.{i}", compression=comp, op=hvd.Average)
            times.append(slowest(time.perf_counter() - start))
        return times

    fp16 = Compression.fp16()
    first = run(fp16, "fp16a")
    auto_times = run(auto, "auto")
    second = run(fp16, "fp16b")
    chosen = {k: v.get("scheme") for k, v in auto.metrics().items()}
    return {"built_s": built_s, "cached_s": cached_s, "fp16_a": first, "auto": auto_times,
            "fp16_b": second, "chosen": chosen, "warmup": auto.scheme.config.warmup,
            "link": list(auto.scheme.link)}


def summarize(result: dict) -> dict:
    """The figures of one run (seconds -> ms): first-window cost and settled ratio."""
    warmup = result["warmup"]
    fp16 = (statistics.median(result["fp16_a"]) + statistics.median(result["fp16_b"])) / 2
    settled = statistics.median(result["auto"][warmup:])
    window = sum(result["auto"][:warmup]) - warmup * fp16
    return {"fp16_step_ms": 1e3 * fp16, "auto_step_ms": 1e3 * settled,
            "auto_over_fp16": settled / fp16, "first_window_extra_ms": 1e3 * window,
            "first_window_steps": warmup, "build_s": result["built_s"],
            "cached_build_s": result["cached_s"], "chosen": sorted(set(result["chosen"].values()))}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench autospeed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated tensor shapes, AxB (default {DEFAULT_SHAPES})")
    parser.add_argument("--candidates", default="", help="auto's candidates (default: its own)")
    parser.add_argument("--json", default="", help="write the raw and summarized figures here")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    from horovod.runner import run
    results = run(_worker, args=(shapes, args.steps, args.candidates), np=args.np, use_gloo=True)
    summary = summarize(results[0])
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rank0": results[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
