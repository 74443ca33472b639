"""Triton fused forms of PowerSGD's projection basis (:func:`hvd_gradcomp.orthogonalize.basis_rows`),
of the batched basis (:func:`basis_batched`, ``basis_rows_batched``) and of the check on receipt
(:func:`agree`, ``powersgd._agree_kernel``; CUDA, the "cuda" provider of
:mod:`torch_backend.kernels`, whose docstring is the contract). The basis:

One program per factor: its ``r`` rows (the basis' columns) in turn, each held whole in
registers (a tile of ``next_pow2(n)``): a zero row takes the fill's, it is scaled by its peak,
projected twice on the rows already made (the coefficients from the same row, then the update)
and normalised, or made exactly zero when what is left is below ``rel_tol`` of its scaled norm;
a NaN/inf row stays non-finite. The reference runs about 15 launches a row (65 at rank 4).
Float operations are rounded once each (``tl.div_rn``, ``tl.sqrt_rn``, no multiply-add fused:
``enable_fp_fusion=False``); the sums are tree reductions, so the result is within float32
rounding of the reference's (and the same bits on every rank, as PowerSGD's basis fingerprints
need).

The batched basis (PowerSGD batched, :mod:`hvd_gradcomp.powersgd_batched`) is one launch for the
whole batch: one program per matrix (``program_id(0)``), each the per-matrix program above on
its matrix (the same jit body, ``_rows``). Both read the rows in place through their strides
(the payload's and fill's first ``n`` columns need no copy). In the interpreter each matrix gets the
per-matrix form's bits; compiled, within the same float32 rounding (a load's layout, and so a
sum's order, may follow its pointer's alignment), the same bits on every rank (every rank
launches the same shapes and strides). The reference runs about 65 launches a batch at rank 4.

Plans covered: every ``rel_tol``; factors (batches of factors) of float32 CUDA tensors with
``r <=`` :data:`MAX_RANK` rows of ``n <=`` :data:`MAX_N` (else the reference). Launch path: no
host read, one launch (one program; the batch: one a matrix), the current stream of the
tensors' device. Tested in Triton's interpreter on CPU tensors and compiled ahead of time for
sm_90 (:data:`AOT`); not yet run on a GPU.
"""
import torch
import triton
import triton.language as tl

from hvd_gradcomp.orthogonalize import basis_rows, basis_rows_batched
from hvd_gradcomp.powersgd import CONTROL, _agree_kernel, agree_tolerance

from torch_backend.reference_ops import REFERENCE_OPS

from .forms import register
from .triton_thc import _OPTIONS, _on

__all__ = ["basis", "basis_batched", "agree", "AOT", "MAX_N", "MAX_RANK"]

MAX_N = 4096  # a row is one register tile
MAX_RANK = 64
_TINY = 1e-30


@triton.jit
def _finite_peak(x):
    """(max |x| over the finite entries, count of NaN entries): torch.amax's NaN is the caller's."""
    nan = tl.sum(tl.where(x != x, 1, 0), 0)
    return tl.max(tl.where(x != x, 0.0, tl.abs(x)), 0), nan


@triton.jit
def _rows(pt_ptr, fill_ptr, out_ptr, n, r, pt_row, fill_row, rel_tol, NP: tl.constexpr):
    """One factor's basis (module docstring): row ``j`` of ``pt`` at ``pt_ptr + j * pt_row``, of
    ``fill`` at ``fill_ptr + j * fill_row``, of ``out`` at ``out_ptr + j * n``."""
    idx = tl.arange(0, NP)
    inside = idx < n
    for j in range(0, r):
        row = tl.load(pt_ptr + j * pt_row + idx, mask=inside, other=0.0)
        top, nan = _finite_peak(row)
        # basis(): an exactly zero row (a finite peak of 0) takes the fill's
        fill = tl.load(fill_ptr + j * fill_row + idx, mask=inside, other=0.0)
        src = tl.where((nan == 0) & (top == 0.0), fill, row)
        # step 1: 1 / max(peak, tiny), NaN propagating as torch.maximum's
        peak, nan = _finite_peak(src)
        peak = tl.where(nan > 0, float("nan"), tl.maximum(peak, 1e-30))
        v = src * tl.div_rn(1.0, peak)
        norm0 = tl.sqrt_rn(tl.sum(v * v, 0))
        # step 2, twice: the coefficients from the same v, then v minus their combination
        for _ in tl.static_range(2):
            acc = tl.zeros((NP,), dtype=tl.float32)
            for k in range(0, j):
                done = tl.load(out_ptr + k * n + idx, mask=inside, other=0.0)
                acc = acc + tl.sum(done * v, 0) * done
            v = v - acc
        # step 3: unit norm, or exact zeros below rel_tol (NaN * 0 stays NaN)
        norm = tl.sqrt_rn(tl.sum(v * v, 0))
        scale = tl.where(norm > norm0 * rel_tol, tl.div_rn(1.0, tl.maximum(norm, 1e-30)), 0.0)
        tl.store(out_ptr + j * n + idx, v * scale, mask=inside)
        tl.debug_barrier()  # the next rows read this one


@triton.jit
def _basis(pt_ptr, fill_ptr, out_ptr, n, r, pt_row, fill_row, rel_tol, NP: tl.constexpr):
    _rows(pt_ptr, fill_ptr, out_ptr, n, r, pt_row, fill_row, rel_tol, NP)


@triton.jit
def _basis_batched(pt_ptr, fill_ptr, out_ptr, n, r, pt_mat, pt_row, fill_mat, fill_row, rel_tol,
                   NP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # the matrix of the batch
    _rows(pt_ptr + b * pt_mat, fill_ptr + b * fill_mat, out_ptr + b * r * n, n, r, pt_row, fill_row, rel_tol, NP)


def basis(rel_tol, pt, fillt):
    """Fused ``basis_rows``: ``pt``, ``fillt`` float32 [r, n] on one CUDA device (any strides; the
    payload's and fill's first ``n`` columns are read in place); returns float32 [r, n], the
    orthonormal basis' columns as rows (module docstring)."""
    if (pt.dim() != 2 or pt.shape != fillt.shape or pt.dtype != torch.float32 or fillt.dtype != torch.float32
            or pt.shape[0] > MAX_RANK or pt.shape[1] > MAX_N or pt.device != fillt.device):
        return basis_rows(REFERENCE_OPS, rel_tol, pt, fillt)
    r, n = pt.shape
    out = torch.empty((r, n), dtype=torch.float32, device=pt.device)
    if r and n:
        pt, fillt = _rows_of(pt), _rows_of(fillt)
        with _on(pt):
            _basis[(1,)](pt, fillt, out, n, r, pt.stride(0), fillt.stride(0), float(rel_tol),
                         NP=triton.next_power_of_2(n), **_OPTIONS)
    return out


def _rows_of(t):
    """``t`` (float32 [..., n]) with unit stride along its rows (a copy only where it has not)."""
    return t if t.stride(-1) == 1 else t.contiguous()



def basis_batched(rel_tol, pt, fillt):
    """Fused ``basis_rows_batched`` (PowerSGD batched), one launch for the batch: ``pt``, ``fillt``
    float32 [B, r, n] on one CUDA device (any strides; slices of a payload are read in place);
    returns float32 [B, r, n], each matrix's basis as :func:`basis` gives it (the same program
    on each matrix, ``program_id`` the matrix; module docstring)."""
    if (pt.dim() != 3 or pt.shape != fillt.shape or pt.dtype != torch.float32 or fillt.dtype != torch.float32
            or pt.shape[1] > MAX_RANK or pt.shape[2] > MAX_N or pt.device != fillt.device):
        return basis_rows_batched(REFERENCE_OPS, rel_tol, pt, fillt)
    b, r, n = pt.shape
    out = torch.empty((b, r, n), dtype=torch.float32, device=pt.device)
    if b and r and n:
        pt, fillt = _rows_of(pt), _rows_of(fillt)
        with _on(pt):
            _basis_batched[(b,)](pt, fillt, out, n, r, pt.stride(0), pt.stride(1), fillt.stride(0), fillt.stride(1),
                                 float(rel_tol), NP=triton.next_power_of_2(n), **_OPTIONS)
    return out

@triton.jit
def _agree(payload_ptr, keep_ptr, ok_ptr, length, tol_factor, T: tl.constexpr):
    acc = tl.zeros((T,), dtype=tl.float32)
    for start in range(0, length, T):
        i = start + tl.arange(0, T)
        acc = acc + tl.load(payload_ptr + i, mask=i < length, other=0.0)
    total = tl.sum(acc, 0)
    ok = (total == total) & (tl.abs(total) < float("inf"))
    c = payload_ptr + length - 6
    ce, co = tl.load(c), tl.load(c + 1)
    both = (ce + co) * tol_factor
    v0 = ce * co
    s1 = tl.load(c + 2)
    v1 = tl.load(c + 3) * both - s1 * s1
    s1 = tl.load(c + 4)
    v2 = tl.load(c + 5) * both - s1 * s1
    nan = (v0 != v0) | (v1 != v1) | (v2 != v2)
    bad = (v0 > 0.0) | (v1 > 0.0) | (v2 > 0.0)
    tl.store(keep_ptr, tl.where(nan, 1.0, tl.where(bad, 0.0, 1.0)))  # torch.max's NaN is not > 0
    tl.store(ok_ptr, ok)


def agree(world_size, payload):
    """Fused ``_agree_kernel`` (PowerSGD's check on receipt), one launch: ``(keep float32 0-d,
    ok bool 0-d)``; ``keep`` the reference's (the same float32 operations on the six control
    values), ``ok`` from a float32 sum in another order (the same verdict but where the finite
    values sum to within rounding of float32's largest)."""
    if payload.dim() != 1 or payload.dtype != torch.float32 or payload.shape[0] < CONTROL:
        return _agree_kernel(REFERENCE_OPS, world_size, payload)
    payload = payload.contiguous()
    keep = torch.empty((), dtype=torch.float32, device=payload.device)
    ok = torch.empty((), dtype=torch.bool, device=payload.device)
    tol = agree_tolerance(world_size)
    with _on(payload):
        _agree[(1,)](payload, keep, ok, payload.shape[0], 1.0 - tol, T=1024, **_OPTIONS)
    return keep, ok


register(basis_rows, "cuda", lambda plan: True, basis, "triton_powersgd.basis")
register(basis_rows_batched, "cuda", lambda plan: True, basis_batched, "triton_powersgd.basis_batched")
register(_agree_kernel, "cuda", lambda plan: True, agree, "triton_powersgd.agree")

# Ahead-of-time compile (tests): (name, kernel, signature, constexprs) at a small and the
# largest row.
_SIGNATURE = {"pt_ptr": "*fp32", "fill_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "r": "i32", "pt_row": "i32",
              "fill_row": "i32", "rel_tol": "fp32", "NP": "constexpr"}
AOT = [(f"basis[NP={np_}]", _basis, _SIGNATURE, {"NP": np_}) for np_ in (256, MAX_N)] + [
    (f"basis_batched[NP={np_}]", _basis_batched,
     {"pt_ptr": "*fp32", "fill_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "r": "i32", "pt_mat": "i32",
      "pt_row": "i32", "fill_mat": "i32", "fill_row": "i32", "rel_tol": "fp32", "NP": "constexpr"}, {"NP": np_})
    for np_ in (256, MAX_N)] + [
    ("agree", _agree, {"payload_ptr": "*fp32", "keep_ptr": "*fp32", "ok_ptr": "*i1", "length": "i32",
                       "tol_factor": "fp32", "T": "constexpr"}, {"T": 1024})]
