"""THC's error on ``n`` emulated ranks in one process (figures: docs/thc.md).

Commands: ``layouts`` (by world size), ``drop`` (after a drop in scale), ``variants`` (by
variant and bits), ``stages`` (by ``rotation_stages``), ``blocks`` (per-block ranges).

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

``python -m hvd_gradcomp.bench.thc_error variants``: one rank, Sum, ``d = 20000``, Gaussian or
Student-t(3) gradients; the worst relative error ``||out - target|| / ||target||`` over
``--seeds`` seeds and steps 1-3 (0-3 with ``range=current``), ``target`` the gradient plus the
residual it carried in, less what the flush bound held back; per variant and ``bits``. The
bounds that tests/core/test_thc.py asserts (``ERROR_BOUNDS``) sit about 20 % above these.

``python -m hvd_gradcomp.bench.thc_error stages``: against ``rotation_stages``, at ``d = 2**22``
(world size 4, one rank, ``--threads`` PyTorch threads, the fastest of ``--reps`` rounds): the
time of the WHT and of THC's compress and finish, and the error and saturated count of the
second of two steps on the same tensor without error feedback.

``python -m hvd_gradcomp.bench.thc_error blocks``: per-block ranges on 2 ranks (Average):
the relative error of each block when blocks are 1000x apart in scale, and the NMSE of a
row-sparse embedding gradient whose touched rows recur or change every step.

Run this file by path with another checkout on ``PYTHONPATH`` to measure that checkout's THC
(options it lacks are left out of its specs).
"""
import argparse
import dataclasses
import math
import sys

import numpy as np

from hvd_gradcomp import composite


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

    def __init__(self, spec, n, d, op, key="w"):
        import torch
        from hvd_gradcomp.base import TensorInfo
        self.torch, self.ops, self.n, self.op = torch, _ops(), n, op
        self.scheme = _scheme(spec)
        self.infos = [TensorInfo(key, (d,), "float32", n, r, op) for r in range(n)]
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
        self.ctxs = [ctx for _, ctx in sent]
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
        total = np.zeros(self.infos[0].numel)
        for st, info in zip(self.states, self.infos):
            residual = composite.residual_of(self.scheme, self.ops, st, info)
            if residual is not None:
                total += residual.numpy().astype(np.float64)
        return total

    def held(self, rank=0):
        """What the flush bound held back at the last step on ``rank``, in the gradient's
        coordinates (float64 [d]); zeros without error feedback."""
        ctx, st, info = self.ctxs[rank], self.states[rank], self.infos[rank]
        if ctx.held is None:
            return np.zeros(info.numel)
        return composite.residual_of(self.scheme, self.ops, st._replace(residual=ctx.held), info).numpy().astype(np.float64)


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


# The variants of THC whose one-rank error tests/core/test_thc.py bounds (ERROR_BOUNDS there).
VARIANTS = {
    "simple": "thc:rotation=full,saturation=false,range=current",
    "simple_previous": "thc:rotation=full,saturation=false",
    "saturation": "thc:rotation=full,saturation=true",
    "partial": "thc:rotation=partial,saturation=true",
}


def variants(args):
    """Worst relative error per variant, bits and distribution, over seeds and steps."""
    rows = []
    for variant, spec in VARIANTS.items():
        first = 0 if "range=current" in spec else 1  # with "previous", step 0 sends nothing
        for bits in args.bits:
            cells = []
            for dist in ("gaussian", "student_t"):
                worst = 0.0
                for seed in range(args.seeds):
                    rng = np.random.default_rng(seed)
                    em = Emulated(f"{spec},bits={bits}", 1, args.d, "sum", key="layer.w")
                    for t in range(args.steps):
                        x = (rng.standard_normal(args.d) if dist == "gaussian" else
                             rng.standard_t(3.0, args.d)).astype(np.float32)
                        owed = em.pending()
                        out = em.step(x[None])
                        target = x.astype(np.float64) + owed - em.held()
                        if t >= first:
                            worst = max(worst, np.linalg.norm(out - target) / np.linalg.norm(target))
                cells.append(worst)
            rows.append((variant, bits, *cells))
            print(f"{variant:>16} {bits}: {cells[0]:.4f} / {cells[1]:.4f}", flush=True)
    return rows


def stages(args):
    """WHT and THC time, error and saturation against ``rotation_stages`` at d = 2**22."""
    import time

    import torch
    from hvd_gradcomp import hadamard
    from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
    from hvd_gradcomp.cast import Fp16Scheme
    torch.set_num_threads(args.threads)
    ops = _ops()
    gen = torch.Generator().manual_seed(0)
    inputs = torch.relu(torch.randn(32, 1024, generator=gen)) * (torch.rand(1024, generator=gen) < 0.7)
    torch.manual_seed(0)
    errors = torch.distributions.StudentT(3.0).sample((32, 4096))
    tensors = {"layer grad": (inputs.T @ errors).contiguous(), "Gaussian": torch.randn(1024, 4096, generator=gen)}
    ks = [4, 6, 8, 10, 12, 14, 16, None]

    def roundtrip(scheme, x):
        """A first step (sets the ranges), and the second step as a callable."""
        info = TensorInfo("w", tuple(x.shape), "float32", 4, 0, "sum")
        state = scheme.init(ops, info, x)
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        kept = {}

        def call():
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            kept["out"], kept["state"] = finish_tensor(scheme, ops, payload, ctx, state, info)
        return call, kept

    jobs = {"fp16": roundtrip(Fp16Scheme(), tensors["layer grad"])[0]}
    kept = {}
    for k in ks:
        scheme = _scheme("thc:rotation=full,error_feedback=false" if k is None else
                         f"thc:rotation_stages={k},error_feedback=false")
        for name, x in tensors.items():
            call, kept[k, name] = roundtrip(scheme, x)
            if name == "layer grad":
                jobs["thc", k] = call
            else:
                call()
        factors = hadamard.hadamard_factors(ops, hadamard.block_size(2 ** 22, k), None)
        flat = tensors["Gaussian"].reshape(-1)
        jobs["wht", k] = lambda f=factors: hadamard.wht(ops, flat, f)
    best = dict.fromkeys(jobs, float("inf"))
    for _ in range(args.reps):
        for job, call in jobs.items():
            start = time.perf_counter()
            call()
            best[job] = min(best[job], time.perf_counter() - start)
    print(f"FP16 compress+finish {best['fp16'] * 1e3:.1f} ms")
    for k in ks:
        row = [f"k={k or 'full':>4} {str(hadamard.factor_sizes(hadamard.block_size(2 ** 22, k))):>20}",
               f"WHT {best['wht', k] * 1e3:6.1f} ms", f"THC c+f {best['thc', k] * 1e3:6.1f} ms"]
        for name, x in tensors.items():
            got = kept[k, name]
            err = float((got["out"] - x).norm() / x.norm())
            row.append(f"{name} {err:.4f} ({int(got['state'].saturated)})")
        print("  ".join(row), flush=True)


def _span(values):
    return f"{min(values):.3g}-{max(values):.3g}"


def blocks(args):
    """Per-block ranges: blocks 1000x apart in scale, and a row-sparse embedding gradient."""
    # Blocks of 1024 scaled 1, 1000, 1, 1000, 0.03, 1, 1000, 1; 2 ranks, Average, steps 1-3.
    scale = np.repeat(np.array([1, 1000, 1, 1000, 1000 ** -0.5, 1, 1000, 1]), 1024)
    groups = {"scale 1": [0, 2, 5, 7], "scale 1000": [1, 3, 6], "scale 0.03": [4]}
    rng = np.random.default_rng(1)
    grads = [np.array([rng.standard_normal(8192) * scale for _ in range(2)]) for _ in range(4)]
    for spec in ("thc", "thc:error_feedback=false", "thc:rotation=full,range=current,error_feedback=false"):
        em = Emulated(spec, 2, 8192, "average", key="layer.w")
        rel = []
        for t, xs in enumerate(grads):
            target = (xs.sum(0) + em.pending()) / 2
            out = em.step(xs.astype(np.float32))
            e = (out - target).reshape(8, 1024)
            if t >= 1:
                rel.append(np.linalg.norm(e, axis=1) / np.linalg.norm(target.reshape(8, 1024), axis=1))
        rel = np.array(rel)
        print(f"{spec:52s} per-block relative error, steps 1-3: " +
              ", ".join(f"{g} {_span(rel[:, i].ravel())}" for g, i in groups.items()), flush=True)
    # An embedding gradient, 20000 x 16, 20 rows touched a step (the same rows, or fresh ones).
    d = 20000 * 16
    for spec in ("thc", "thc:rotation=full"):
        for fresh in (False, True):
            nmse = []
            for seed in range(args.seeds):
                rng = np.random.default_rng(seed)
                rows = rng.choice(20000, 20, replace=False)
                em = Emulated(spec, 2, d, "average", key="layer.w")
                for t in range(4):
                    if fresh:
                        rows = rng.choice(20000, 20, replace=False)
                    xs = np.zeros((2, 20000, 16), np.float32)
                    xs[:, rows] = rng.standard_normal((2, 20, 16))
                    xs = xs.reshape(2, d)
                    target = (xs.astype(np.float64).sum(0) + em.pending()) / 2
                    out = em.step(xs)
                    if t >= 1:
                        nmse.append(np.sum((out - target) ** 2) / np.sum(target ** 2))
            print(f"{spec:20s} embedding, {'fresh' if fresh else 'same'} rows: NMSE steps 1-3, "
                  f"seeds 0-{args.seeds - 1}: {_span(nmse)}", flush=True)


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
    c = sub.add_parser("variants")
    c.add_argument("--bits", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8])
    c.add_argument("--d", type=int, default=20000)
    c.add_argument("--seeds", type=int, default=6)
    c.add_argument("--steps", type=int, default=4)
    e = sub.add_parser("stages")
    e.add_argument("--reps", type=int, default=12)
    e.add_argument("--threads", type=int, default=1)
    f = sub.add_parser("blocks")
    f.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    {"layouts": layouts, "drop": drop, "variants": variants, "stages": stages, "blocks": blocks}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
