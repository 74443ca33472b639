"""(Helper, not a test.) The checks of PowerSGD's Triton forms (:mod:`torch_backend.kernels.triton_powersgd`)
against the core's reference compositions, run with the other kernels' checks by
:mod:`tests.core.triton_checks` (whose docstring states what "agrees" means): the basis
(``basis_rows``, :func:`check_powersgd`), the batched basis (``basis_rows_batched``,
:func:`check_powersgd_batched`) and the check on receipt (``_agree_kernel``,
:func:`check_powersgd_agree`). The basis' contract (its provider's docstring): within float32
rounding of the reference (1e-6 absolute on unit rows), the same rows exactly zero, NaN exactly
where the reference has it; the batched form gives each matrix the per-matrix form's bits in the
interpreter (compiled, within the same contract: a sum's order may follow the rows' alignment). No
``tl.dot`` here and no matrix product of an inf in the reference (an inf row turns NaN in the
scaling before any product), so nothing depends on the CPU's vector width.
"""
import os
import warnings

import torch

from tests.core.triton_compare import close_relative, equal_values, randn_on, same_structure, seeded
from torch_backend import kernels
from torch_backend.ops import REFERENCE_OPS

__all__ = ["POWERSGD_CASES", "POWERSGD_BATCHED_CASES", "check_powersgd", "check_powersgd_batched",
           "check_powersgd_agree", "check_powersgd_batched_scheme"]

R = REFERENCE_OPS


def _basis_problems(tag, got, want):
    """The basis' contract (module docstring) for ``got`` against the reference's ``want`` ([..., r, n])."""
    problems = same_structure(tag, got, want)
    if problems:
        return problems
    if not torch.equal(got.isnan().cpu(), want.isnan().cpu()):
        return [f"{tag}: NaN where the reference has none, or the reverse"]
    finite = ~want.isnan()
    err = float((got - want)[finite].abs().max()) if bool(finite.any()) else 0.0
    if err > 1e-6:
        problems.append(f"{tag}: max difference {err:.3g} > 1e-6")
    if not torch.equal((got.abs().sum(-1) > 0).cpu(), (want.abs().sum(-1) > 0).cpu()):
        problems.append(f"{tag}: other rows are zero than the reference's")
    return problems


def check_powersgd(device, r, n, special):
    """PowerSGD's ``basis_rows`` (module docstring): within float32 rounding of the reference,
    the same rows zero; ``special``: a zero row (takes the fill's) and a dependent one (exact
    zeros), or a NaN row (it and the rows after it non-finite). An odd ``n``'s rows are slices of
    wider ones (the payload's and fill's first ``n`` columns, read through their strides)."""
    from hvd_gradcomp.orthogonalize import DEPENDENT_TOL, basis_rows
    from torch_backend.kernels import triton_powersgd
    form = kernels.fused_form(basis_rows, DEPENDENT_TOL, "cuda")
    if form is not triton_powersgd.basis:
        return [f"powersgd: the registry gives {form}, not triton_powersgd.basis"]
    g, dev = seeded(r * 7 + n, device)
    wide, fwide = (n + 4, n + 3) if n % 2 else (n, n)  # odd n: slices read in place, as PowerSGD's
    pt = randn_on(g, r * wide, dev).reshape(r, wide)[:, :n]
    fill = randn_on(g, r * fwide, dev).reshape(r, fwide)[:, :n]
    if special == "dependent":
        pt[1] = 0.0
        pt[2] = pt[0] * -3.0
    elif special == "nan":
        pt[1, n // 2] = float("nan")
    tag = f"powersgd basis r={r} n={n} {special}"
    got = form(DEPENDENT_TOL, pt, fill)
    want = basis_rows(R, DEPENDENT_TOL, pt, fill)
    return _basis_problems(tag, got, want)


def check_powersgd_batched(device, b, r, n, width, special):
    """PowerSGD batched's ``basis_rows_batched``: ``b`` matrices ``[r, n]`` read as slices of
    ``[b, r, width]`` and of a wider fill (as PowerSGD batched passes its payload's and fill's
    first ``n`` columns), against the reference (module docstring), and each matrix against the
    per-matrix Triton form: bit for bit in the interpreter, within the contract on CUDA.
    ``special``: "dependent" (matrix 0: a zero row, which takes the fill's, and a dependent row,
    exact zeros; the last matrix all zero: the whole fill's basis),
    "nan" (a NaN in matrix 1's row 1: it and the rows after it non-finite, the other matrices
    finite), "inf" (an inf in matrix 0's row 0), "over" (more than ``MAX_RANK`` rows: the
    reference runs, the same bits)."""
    from hvd_gradcomp.orthogonalize import DEPENDENT_TOL, basis_rows_batched
    from torch_backend.kernels import triton_powersgd
    form = kernels.fused_form(basis_rows_batched, DEPENDENT_TOL, "cuda")
    if form is not triton_powersgd.basis_batched:
        return [f"powersgd batched: the registry gives {form}, not triton_powersgd.basis_batched"]
    g, dev = seeded(b * 1000 + r * 7 + n, device)
    pt = randn_on(g, b * r * width, dev).reshape(b, r, width)[:, :, :n]
    fill = randn_on(g, b * r * (n + 3), dev).reshape(b, r, n + 3)[:, :, :n]
    if special == "dependent":
        pt[0, 1] = 0.0
        pt[0, 2] = pt[0, 0] * -3.0
        pt[b - 1] = 0.0
    elif special == "nan":
        pt[1, 1, n // 2] = float("nan")
    elif special == "inf":
        pt[0, 0, n - 1] = float("inf")
    tag = f"powersgd basis_batched b={b} r={r} n={n} width={width} {special}"
    got = form(DEPENDENT_TOL, pt, fill)
    want = basis_rows_batched(R, DEPENDENT_TOL, pt, fill)
    if special == "over":
        return same_structure(tag, got, want) or equal_values(tag, got, want)
    problems = _basis_problems(tag, got, want)
    for j in range(b if not problems else 0):
        one = triton_powersgd.basis(DEPENDENT_TOL, pt[j], fill[j])
        # Compiled, a load's layout (and so a sum's order) follows its pointer's alignment, which
        # strides change: on CUDA, the per-matrix form's contract instead of its bits.
        problems += (equal_values(f"{tag}: matrix {j} against triton_powersgd.basis", got[j], one)
                     if got.device.type == "cpu" else _basis_problems(f"{tag}: matrix {j} vs basis", got[j], one))
    return problems


def _batched_run(mode, device, steps=4):
    """PowerSGD batched (rank 2) over 2 simulated ranks (torch_backend/simulated.py), one bucket
    of three 32 x 48 matrices and two 16 x 4 x 3 x 3 kernels (two batches) and a 24 x 40 matrix
    (alone in its view: per matrix), ``steps`` steps with ``HVD_GRADCOMP_KERNELS=mode``: each
    step's outputs, rank by rank."""
    from hvd_gradcomp.buckets import Member
    from torch_backend.simulated import SimulatedEngine
    shapes = [(32, 48)] * 3 + [(16, 4, 3, 3)] * 2 + [(24, 40)]
    members, offset = [], 0
    for j, shape in enumerate(shapes):
        numel = int(torch.Size(shape).numel())
        members.append(Member(f"m{j}", f"layer.m{j}", shape, offset, numel))
        offset += numel
    g, dev = seeded(5, device)
    grads = [[randn_on(g, offset, dev) for _ in range(2)] for _ in range(steps)]
    old = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = mode
    try:
        engine = SimulatedEngine(2)
        comps = engine.compressors("powersgd:2")
        return [engine.allreduce_bucket(comps, [x.clone() for x in bufs], tuple(members)) for bufs in grads]
    finally:
        if old is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = old


def check_powersgd_batched_scheme(device):
    """Whole steps of PowerSGD batched with the Triton forms (``HVD_GRADCOMP_KERNELS=triton``:
    ``ops.fuse`` picks ``basis_batched``, ``basis`` and ``agree``, no fallback warning) against the
    reference compositions (``off``): every rank's output within 1e-5 of the reference's norm
    (the bases differ by float32 rounding, the steps after follow them)."""
    kernels._CHOSEN.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "hvd_gradcomp: the fused form", RuntimeWarning)
        got = _batched_run("triton", device)
    chosen = {getattr(form, "__name__", None) for form in kernels._CHOSEN.values() if form is not None}
    problems = [f"powersgd batched: ops.fuse never ran {name} (chosen: {sorted(chosen)})"
                for name in ("basis_batched", "basis", "agree") if name not in chosen]
    want = _batched_run("off", device)
    for step, (outs, refs) in enumerate(zip(got, want)):
        for rank, (a, b) in enumerate(zip(outs, refs)):
            problems += close_relative(f"powersgd batched step {step} rank {rank}", a, b, 1e-5)
    return problems


def check_powersgd_agree(device):
    """PowerSGD's ``_agree_kernel``: the reference's ``(keep, ok)`` for payloads whose ranks
    agree, disagree in parity or in a fingerprint, or hold a NaN or an inf (longer than one
    tile of the sum, and shorter)."""
    from hvd_gradcomp.powersgd import _agree_kernel
    from torch_backend.kernels import triton_powersgd
    form = kernels.fused_form(_agree_kernel, 2, "cuda")
    if form is not triton_powersgd.agree:
        return [f"powersgd agree: the registry gives {form}, not triton_powersgd.agree"]
    g, dev = seeded(11, device)
    problems = []
    for n, length in ((2, 3000), (64, 40)):
        body = randn_on(g, length, dev)
        f = randn_on(g, 2, dev)
        agreed = torch.stack([torch.tensor(float(n), device=dev), torch.tensor(0.0, device=dev), n * f[0],
                              n * f[0] ** 2, n * f[1], n * f[1] ** 2])
        variants = {"agreed": agreed.clone(), "parity": agreed.clone(), "print": agreed.clone()}
        variants["parity"][1] = 1.0
        variants["print"][3] = variants["print"][3] * 1.01 + 0.5
        for name, control in list(variants.items()):
            variants[name] = torch.cat([body, control])
        variants["nan"] = variants["agreed"].clone()
        variants["nan"][5] = float("nan")
        variants["inf"] = variants["agreed"].clone()
        variants["inf"][-1] = float("inf")
        for name, payload in variants.items():
            got, want = form(n, payload), _agree_kernel(R, n, payload)
            tag = f"powersgd agree n={n} len={length} {name}"
            problems += same_structure(tag, got, want)
            if [float(got[0]), bool(got[1])] != [float(want[0]), bool(want[1])]:
                problems.append(f"{tag}: {float(got[0]), bool(got[1])} against {float(want[0]), bool(want[1])}")
    return problems


POWERSGD_CASES = [
    # (r, n, special)
    (4, 256, "dependent"),
    (1, 5, "none"),
    (8, 1001, "dependent"),
    (3, 4096, "nan"),
]


POWERSGD_BATCHED_CASES = [
    # (b, r, n, width, special): width > n reads the rows in place, as PowerSGD batched does
    (3, 4, 256, 300, "dependent"),
    (1, 1, 5, 5, "none"),
    (4, 8, 1001, 1001, "dependent"),
    (2, 3, 4096, 4100, "nan"),
    (3, 2, 33, 40, "inf"),
    (2, 65, 9, 9, "over"),
]
