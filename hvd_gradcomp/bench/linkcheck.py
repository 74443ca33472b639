"""One timed float32 all-reduce of known size, run on every rank by :func:`netem.verify_link`.

``python -m hvd_gradcomp.bench.linkcheck --nbytes N --repeats R --out PATH`` (under Horovod):
one warm-up all-reduce (op Sum) of ``N`` bytes, then ``R`` timed ones; rank 0 writes
``{"seconds": median, "all_seconds": [...], "world_size": n}`` to ``PATH``.
"""
import argparse
import json
import statistics
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
