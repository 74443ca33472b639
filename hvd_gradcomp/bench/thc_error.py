"""THC on ``n`` emulated ranks in one process: one-step error by world size, and a drop in scale.

``python -m hvd_gradcomp.bench.thc_error layouts``: bytes per coordinate and the one-step error
of the averaged gradient, ``||out - mean_r g_r|| / ||mean_r g_r||``, at each world size.
Every rank compresses its own gradient with the scheme's own functions
(:func:`~hvd_gradcomp.base.compress_tensor`, :func:`~hvd_gradcomp.base.finish_tensor`, PyTorch
primitives); the all-reduce is the int64 sum of the int32 payloads, or Horovod's Average
``trunc(W * (1/n))`` in double. Gradients: ``g_r = s + z_r``, ``s`` a shared Student-t(3) signal
and ``z_r`` per-rank Gaussian noise of ``--noise`` times the signal's RMS. No error feedback;
a first step on the same distribution agrees the ranges (the first step of a tensor sends
nothing), the second is measured; the median over ``--repeats`` draws.

``python -m hvd_gradcomp.bench.thc_error drop``: 2 ranks with error feedback, ``--before`` steps
at scale 1, then the gradients fall by ``--factor``; per step after the drop, the RMS of the
output over the RMS of the true averaged gradient, for each spec given.

Run this file by path with another checkout on ``PYTHONPATH`` to measure that checkout's THC
(options it lacks are left out of its specs).
"""
import argparse
import dataclasses
import math
import sys

import numpy as np


def _ops():
    from hvd_gradcomp.primitives import one_rank
    from torch_backend import OPS
    return one_rank(OPS)


def _scheme(spec):
    from hvd_gradcomp.registry import make_scheme, parse_spec
    name, opts = parse_spec(spec)
    fields = {f.name for f in dataclasses.fields(make_scheme(name).config)}
    return make_scheme(name, **{k: v for k, v in opts.items() if k in fields})


class Emulated:
    """``n`` ranks of one tensor of ``d`` coordinates, all-reduced with ``op``."""

    def __init__(self, spec, n, d, op):
        import torch
        from hvd_gradcomp.base import TensorInfo
        self.torch, self.ops, self.n, self.op = torch, _ops(), n, op
        self.scheme = _scheme(spec)
        self.infos = [TensorInfo("w", (d,), "float32", n, r, op) for r in range(n)]
        like = torch.zeros(d)
        self.states = [self.scheme.init(self.ops, info, like) for info in self.infos]

    def step(self, grads):
        """One step; ``grads`` float32 [n, d]; returns the output (float64 [d]) of rank 0."""
        from hvd_gradcomp.base import compress_tensor, finish_tensor
        torch = self.torch
        ops = self.ops
        if self.scheme.blocking:  # range="current": the Max side all-reduce, recorded then agreed
            seen = []
            record = dataclasses.replace(ops, allreduce=lambda v, *a, **k: seen.append(v) or v)
            for g, st, info in zip(grads, self.states, self.infos):
                compress_tensor(self.scheme, record, torch.as_tensor(g), st, info)
            agreed = torch.stack(seen).max(0).values
            ops = dataclasses.replace(ops, allreduce=lambda v, *a, **k: agreed.clone())
        sent = [compress_tensor(self.scheme, ops, torch.as_tensor(g), st, info)
                for g, st, info in zip(grads, self.states, self.infos)]
        total = torch.stack([p.to(torch.int64) for p, _ in sent]).sum(0)
        assert int(total.min()) >= -2 ** 31 and int(total.max()) < 2 ** 31
        if self.op == "average":
            total = torch.trunc(total.to(torch.float64) * (1.0 / self.n))
        reduced = total.to(torch.int32)
        out, new = None, []
        for (_, ctx), st, info in zip(sent, self.states, self.infos):
            o, s = finish_tensor(self.scheme, self.ops, reduced.clone(), ctx, st, info)
            out = o if out is None else out
            new.append(s)
        self.states = new
        return out.numpy().astype(np.float64)

    def pending(self):
        """The ranks' residuals in the gradient's coordinates, summed (float64 [d])."""
        from hvd_gradcomp import composite
        return sum(composite.residual_of(self.scheme, self.ops, st, info).numpy().astype(np.float64)
                   for st, info in zip(self.states, self.infos))


def _grads(rng, n, d, noise):
    signal = rng.standard_t(3, d)
    signal /= np.sqrt(np.mean(signal ** 2))
    return (signal[None, :] + noise * rng.standard_normal((n, d))).astype(np.float32)


def layouts(args):
    from hvd_gradcomp import thc
    rows = []
    for n in args.ranks:
        for spec in args.specs:
            for op in args.ops:
                errs = []
                for rep in range(args.repeats):
                    rng = np.random.default_rng([n, rep])
                    em = Emulated(spec + (",error_feedback=false" if ":" in spec else ":error_feedback=false"),
                                  n, args.d, op)
                    em.step(_grads(rng, n, args.d, args.noise))
                    g = _grads(rng, n, args.d, args.noise)
                    out = em.step(g)
                    mean = g.astype(np.float64).mean(0)
                    errs.append(np.linalg.norm(out / (n if op == "sum" else 1) - mean) / np.linalg.norm(mean))
                wire = em.scheme.wire(em.infos[0]).payload
                lay = em.scheme.layout(em.infos[0]).levels
                top = getattr(lay, "top", None) or (1 << em.scheme.config.bits) - 1
                rows.append((n, spec, op, 8.0 * wire / args.d, top, float(np.median(errs))))
                print(f"n={n:4d} {spec:24s} {op:8s} bits/coord {8.0 * wire / args.d:6.2f} L={top:3d} "
                      f"error {rows[-1][-1]:.4f}", flush=True)
    return rows


def drop(args):
    for spec in args.specs:
        rng = np.random.default_rng(0)
        em = Emulated(spec, 2, args.d, "average")
        given = np.zeros(args.d)
        delivered = np.zeros(args.d)
        ratios = []
        for t in range(args.before + args.after):
            scale = 1.0 if t < args.before else 1.0 / args.factor
            g = _grads(rng, 2, args.d, args.noise) * np.float32(scale)
            out = em.step(g)
            mean = g.astype(np.float64).mean(0)
            given += mean
            delivered += out
            if t >= args.before:
                ratios.append(np.sqrt(np.mean(out ** 2)) / np.sqrt(np.mean(mean ** 2)))
        owed = np.linalg.norm(delivered + em.pending() / 2 - given) / np.linalg.norm(given)
        print(f"{spec:40s} " + " ".join(f"{r:.3g}" for r in ratios) + f"  | (out + pending - given) / given {owed:.1e}",
              flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench.thc_error", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("layouts")
    a.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[2, 8, 64, 128])
    a.add_argument("--specs", type=lambda s: s.split(";"), default=["thc"])
    a.add_argument("--ops", type=lambda s: s.split(","), default=["average", "sum"])
    a.add_argument("--d", type=int, default=1 << 16)
    a.add_argument("--noise", type=float, default=1.0)
    a.add_argument("--repeats", type=int, default=3)
    b = sub.add_parser("drop")
    b.add_argument("--specs", type=lambda s: s.split(";"), default=["thc", "thc:range=current"])
    b.add_argument("--d", type=int, default=1 << 14)
    b.add_argument("--noise", type=float, default=1.0)
    b.add_argument("--before", type=int, default=10)
    b.add_argument("--after", type=int, default=10)
    b.add_argument("--factor", type=float, default=1e6)
    args = p.parse_args(argv)
    {"layouts": layouts, "drop": drop}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
