"""Triton fused forms of THC's kernels (CUDA; the "cuda" provider of :mod:`torch_backend.kernels`,
whose docstring is the contract).

The math is :mod:`hvd_gradcomp.thc_kernels` (steps 1-8 of :mod:`hvd_gradcomp.thc`), written here
once more as Triton kernels for the default plan, rotation blocks of ``B = 1024``
(:func:`accepts`; any other block keeps the reference). This module holds the kernels that run
one program per block or tile of the gradient and registers every THC form; the small steps
around them (statistics, noise, the payload's tail, receive, finish) are single launches in
:mod:`torch_backend.kernels.triton_thc_words`.

- :func:`rotate` (``_rotate_kernel``, steps 1-2): one program per 1024-coordinate block. It
  loads ``x`` (zero past ``d``) and ``diag`` as a [32, 32] tile ``X`` (row-major, the
  reference's ``(32, 32)`` view), forms ``H32 (X * D) H32`` with two ``tl.dot`` in
  ``input_precision="ieee"`` (full float32 products and sums: never TF32), adds the error
  feedback (clipped to ``flush`` times the block's own range, the clipped part stored as
  ``held``), and stores ``y`` and the block's wanted range (``T`` times its RMS, or its peak;
  NaN propagates); then ``triton_thc_words.scales``.
- :func:`quantize` (``_quantize_kernel``, steps 3-5): one program per tile of ``TILE`` level
  words. Word ``i`` of the planar layout holds coordinates ``j w + i`` (lane ``j``,
  :func:`hvd_gradcomp.lanes.pack`), so the program visits, lane by lane, ``TILE`` contiguous
  coordinates each: grid position, clip, saturation count, noise ``bitcast(rows[b] ^ cols[c])``,
  floor, residual, and the level shifted into its lane; then the offset comes off and the word
  is stored, with per-program saturation counts (int32); then ``triton_thc_words.tail``.
- :func:`decode` (``_decode_kernel``, steps 6-7): one program per block. Each coordinate reads
  its word, recovers the exact sum (:func:`hvd_gradcomp.lanes.exact_words`, in int64), adds
  ``count * offset``, takes its lane, forms ``(total - offset) * a`` with the block's scale
  ``a`` and offset (from the 0-d ``count``, ``bad``, ``mismatch`` and ``inferred`` tensors,
  loaded in the kernel: no host read), and rotates back, ``H32 V H32 * diag``.

Exactness. Every float operation is the reference's, in its order, rounded once in float32
(``tl.div_rn``, ``tl.sqrt_rn``, kernels compiled with ``enable_fp_fusion=False`` so that no
multiply-add is contracted into an FMA): the quantiser's levels, residual and saturation count,
and the decoder's lanes and pre-rotation values, equal the reference's bit for bit given equal
inputs. The two Walsh-Hadamard products and the block norms sum in another order than the
reference's matmul and ``vector_norm``: ``y``, the held residual, the ranges and the decoded
output differ from the reference by float32 rounding (tested: ``y``, held and output at most
``2**-20`` of the block's Euclidean norm in each coordinate, each range within ``2**-17`` of
itself; ``tests/core/triton_checks.py``). A non-finite ``y`` gives undefined levels, as in the reference (its "not finite" control word makes every rank ignore them).

Launch path: no host read and no synchronisation; grid sizes from the tensors' static shapes;
Triton launches on the current stream of the tensors' device. Inputs are made contiguous
(a no-op for the scheme's own tensors).

Tested in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
``HVD_GRADCOMP_KERNELS=triton``) and compiled ahead of time for sm_90 (:data:`AOT`); not yet run
on a GPU.
"""
import math

import torch
import triton
import triton.language as tl

from hvd_gradcomp import thc_kernels as core

from .forms import register, writable
from .triton_thc_words import _OPTIONS, _exact, _on, finish, noise, op_code, receive, scales, tail

__all__ = ["accepts", "rotate", "rotate_blocks", "quantize", "quantize_lane", "decode", "encode", "AOT", "BLOCK", "TILE"]

BLOCK = 1024  # the rotation block these kernels cover (a [32, 32] tile)
SIDE = 32
TILE = 256  # level words per quantise program


def accepts(plan) -> bool:
    """True for THC plans with 1024-coordinate rotation blocks (the default partial rotation)."""
    return isinstance(plan, core._Plan) and plan.block == BLOCK


# ---- Triton kernels ----
@triton.jit
def _max_nan(a, b):
    """max that propagates NaN (torch.amax's and torch.maximum's rule)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_range(v, scale, SATURATION: tl.constexpr):
    """_own_range of a [32, 32] block: ||v|| * scale (T / sqrt(B)) or max |v|; NaN propagates."""
    if SATURATION:
        r = tl.sqrt_rn(tl.sum(tl.sum(v * v, 1), 0)) * scale
    else:
        r = tl.reduce(tl.reduce(tl.abs(v), 1, _max_nan), 0, _max_nan)
    return r


@triton.jit
def _rotate(x_ptr, res_ptr, diag_ptr, h_ptr, y_ptr, held_ptr, wanted_ptr, d, range_scale, flush,
            EF: tl.constexpr, FLUSH: tl.constexpr, SATURATION: tl.constexpr, S: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, S)
    tile = r[:, None] * S + r[None, :]
    off = b.to(tl.int64) * (S * S) + tile
    x = tl.load(x_ptr + off, mask=off < d, other=0.0)
    h = tl.load(h_ptr + tile)
    xd = x * tl.load(diag_ptr + off)
    # wht's two factors: H @ X (the batched product), then (.) @ H
    y = tl.dot(tl.dot(h, xd, input_precision="ieee"), h, input_precision="ieee")
    if EF:
        e = tl.load(res_ptr + off)
        if FLUSH:
            bound = _block_range(y, range_scale, SATURATION) * flush
            bound = tl.where(bound > 0.0, bound, float("inf"))
            flushed = tl.minimum(tl.maximum(e, -bound, propagate_nan=tl.PropagateNan.ALL), bound,
                                 propagate_nan=tl.PropagateNan.ALL)
            tl.store(held_ptr + off, e - flushed)
            y = y + flushed
        else:
            y = y + e
    tl.store(y_ptr + off, y)
    tl.store(wanted_ptr + b, _block_range(y, range_scale, SATURATION))


@triton.jit
def quantize_lane(y, top, noise, m, grid_step, tiny, centre, upper, below, above):
    """One lane's levels ``floor(clip(y / delta + centre) + noise)`` of the coordinates ``y``
    (their blocks' ranges ``top``, masked by ``m``): ``(q, delta, saturated 0/1)``; shared by
    the five-launch encode and the fused one (:mod:`.triton_thc_fused`)."""
    live = top > 0.0
    delta = top * grid_step
    inv = tl.where(live, tl.div_rn(1.0, tl.maximum(delta, tiny)), 0.0)
    u = y * inv + tl.where(live, centre, -1.0)
    clipped = tl.minimum(tl.maximum(u, -1.0, propagate_nan=tl.PropagateNan.ALL), upper,
                         propagate_nan=tl.PropagateNan.ALL)
    return tl.floor(clipped + noise), delta, tl.where(m & ((u < below) | (u > above)), 1, 0)


@triton.jit
def _quantize(y_ptr, held_ptr, ranges_ptr, rows_ptr, cols_ptr, payload_ptr, res_ptr, sat_ptr,
              P, W, grid_step, tiny, centre, upper, below, above,
              LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr, OFFSET: tl.constexpr,
              EF: tl.constexpr, FLUSH: tl.constexpr, B: tl.constexpr, TILE_W: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * TILE_W + tl.arange(0, TILE_W)
    in_words = i < W
    word = tl.zeros((TILE_W,), dtype=tl.int32)
    saturated = tl.zeros((TILE_W,), dtype=tl.int32)
    for j in tl.static_range(LANES):
        c = j * W + i
        m = in_words & (c < P)
        y = tl.load(y_ptr + c, mask=m, other=0.0)
        blk = c // B
        top = tl.load(ranges_ptr + blk, mask=m, other=0.0)
        row = tl.load(rows_ptr + blk, mask=m, other=0)
        col = tl.load(cols_ptr + (c % B), mask=m, other=0)
        q, delta, sat = quantize_lane(y, top, (row ^ col).to(tl.float32, bitcast=True), m, grid_step, tiny,
                                      centre, upper, below, above)
        saturated += sat
        if EF:
            res = y - q * delta + top
            if FLUSH:
                res = res + tl.load(held_ptr + c, mask=m, other=0.0)
            tl.store(res_ptr + c, res, mask=m)
        level = tl.where(m, q.to(tl.int32), 0)
        word += level << (GUARD + j * WIDTH)
    word = word - OFFSET
    tl.store(payload_ptr + i, word, mask=in_words)
    tl.store(sat_ptr + pid, tl.sum(saturated, 0))


@triton.jit
def _decode(payload_ptr, ranges_ptr, diag_ptr, h_ptr, count_ptr, bad_ptr, mismatch_ptr, inferred_ptr,
            own_ptr, out_ptr, W, D, grid_step, inv_n, half_top, factor,
            N: tl.constexpr, OP: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr,
            OFFSET: tl.constexpr, OWN: tl.constexpr, FACTOR: tl.constexpr, S: tl.constexpr):
    # Writes coordinates c < D only (out may be an engine's [d] bucket slice); FACTOR: the result
    # times factor, rounded after it (the reference's separate product).
    # OP: 0 Average, 1 Sum, 2 unknown (the count word's inference decides). OWN: lanes for the
    # other ranks only (lanes.others_words): own_ptr holds this rank's words as sent.
    b = tl.program_id(0)
    r = tl.arange(0, S)
    tile = r[:, None] * S + r[None, :]
    c = b.to(tl.int64) * (S * S) + tile
    word_at = c % W
    lane = c // W
    count = tl.load(count_ptr)
    inferred = tl.load(inferred_ptr) != 0
    exact = _exact(tl.load(payload_ptr + word_at).to(tl.int64), inferred, N, OP, GUARD)
    if OFFSET:
        exact = exact + count * OFFSET
    mask: tl.constexpr = (1 << WIDTH) - 1
    shift = (GUARD + lane * WIDTH).to(tl.int64)
    if OWN:
        mine = tl.load(own_ptr + word_at).to(tl.int64) & 0xFFFFFFFF
        total = ((((exact - mine) & 0xFFFFFFFF) >> shift) & mask) + ((mine >> shift) & mask)
        total = total.to(tl.float32)
    else:
        total = ((exact >> shift) & mask).to(tl.float32)
    # as_reduced(where(mismatch, 0, 1)), then a = R * (grid * scale)
    scale = tl.where(tl.load(mismatch_ptr) != 0, 0.0, 1.0)
    if OP == 0:
        scale = scale * inv_n
    elif OP == 2:
        scale = scale * tl.where(inferred, 1.0, inv_n)
    a = tl.load(ranges_ptr + b) * (grid_step * scale)
    offset = count.to(tl.float32) * half_top + tl.where(tl.load(bad_ptr) > 0, float("nan"), 0.0)
    v = (total - offset) * a
    h = tl.load(h_ptr + tile)
    back = tl.dot(tl.dot(h, v, input_precision="ieee"), h, input_precision="ieee")
    value = back * tl.load(diag_ptr + c)
    if FACTOR:
        value = value * factor
    tl.store(out_ptr + c, value, mask=c < D)


def _range_scale(plan) -> float:
    return plan.threshold / math.sqrt(plan.block) if plan.threshold else 1.0


# ---- fused forms (run(plan, *tensors), the reference's inputs and outputs) ----
def rotate(plan, x, residual, diag, hmat, finite):
    """Fused ``_rotate_kernel`` (steps 1-2).

    Args:
        x: float32 [d], ``d <= P``; residual: float32 [P] (error feedback), else unused;
        diag: float32 [P], ``P`` a multiple of 1024; hmat: float32 [32, 32], Sylvester;
        finite: bool 0-d.

    Returns:
        (y float32 [P], held float32 [P] with a flush bound else [0], wanted float32 [nb],
        statistics int32 [ceil(2 nb / lanes)] or [0] with ``range="current"``, finite bool 0-d),
        as the reference's.
    """
    y, held, wanted = rotate_blocks(plan, x, residual, diag, hmat)
    stats, ok = scales(plan, wanted, finite)
    return y, held, wanted, stats, ok


def rotate_blocks(plan, x, residual, diag, hmat):
    """The block programs of :func:`rotate` (one launch): ``(y float32 [P], held float32 [P]
    with a flush bound else [0], wanted float32 [nb])``, without the statistics program."""
    x, residual, diag, hmat = x.contiguous(), residual.contiguous(), diag.contiguous(), hmat.contiguous()
    padded = diag.shape[0]
    nb = padded // BLOCK
    flush = plan.error_feedback and plan.flush is not None
    y = torch.empty(padded, dtype=torch.float32, device=x.device)
    held = torch.empty(padded if flush else 0, dtype=torch.float32, device=x.device)
    wanted = torch.empty(nb, dtype=torch.float32, device=x.device)
    with _on(x):
        _rotate[(nb,)](x, residual if plan.error_feedback else y, diag, hmat, y, held if flush else y, wanted,
                       x.shape[0], _range_scale(plan), float(plan.flush) if flush else 1.0,
                       EF=bool(plan.error_feedback), FLUSH=flush, SATURATION=bool(plan.threshold), S=SIDE,
                       **_OPTIONS)
    return y, held, wanted


def quantize(plan, y, held, ranges, rows, cols, fingerprint, finite, stats_words):
    """Fused ``_quantize_kernel`` (steps 3-5).

    Args:
        y: float32 [P]; held: float32 [P] (flush bound) else unused; ranges: float32 [nb];
        rows: int32 [nb]; cols: int32 [1024]; fingerprint: int64 0-d; finite: bool 0-d;
        stats_words: int32 [S].

    Returns:
        (payload int32 [w + S + 4], residual float32 [P] with error feedback else [0],
        saturated int64 0-d), as the reference's.
    """
    y, ranges, rows, cols = y.contiguous(), ranges.contiguous(), rows.contiguous(), cols.contiguous()
    lay, padded = plan.levels, y.shape[0]
    w = -(-padded // lay.lanes)
    flush = plan.error_feedback and plan.flush is not None
    stats = stats_words.shape[0]
    payload = torch.empty(w + stats + core._CONTROL, dtype=torch.int32, device=y.device)
    residual = torch.empty(padded if plan.error_feedback else 0, dtype=torch.float32, device=y.device)
    programs = -(-w // TILE)
    partial = torch.empty(programs, dtype=torch.int32, device=y.device)
    top_level = core._top_level(lay.top)
    margin = top_level * 2.0 ** -21
    with _on(y):
        _quantize[(programs,)](y, held.contiguous() if flush else y, ranges, rows, cols, payload,
                               residual if plan.error_feedback else y, partial, padded, w,
                               core._grid(lay.top), core._TINY_RANGE, 0.5 * top_level - 1.0, top_level - 1.0,
                               -1.0 - margin, top_level - 1.0 + margin,
                               LANES=lay.lanes, WIDTH=lay.width, GUARD=lay.guard, OFFSET=lay.offset,
                               EF=bool(plan.error_feedback), FLUSH=flush, B=BLOCK, TILE_W=TILE, **_OPTIONS)
    return payload, residual, tail(plan, payload, w, stats_words, fingerprint, finite, partial)


def decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own=None, into=None):
    """Fused ``_decode_kernel`` (steps 6-7, times ``plan.factor``).

    Args:
        payload: int32 [w + S + 4], all-reduced; ranges: float32 [nb]; diag: float32 [P];
        hmat: float32 [32, 32]; count, bad: int64 0-d; mismatch, inferred: bool 0-d;
        own: int32 [w], this rank's level words as sent, with lanes for the other ranks only
            (``plan.levels.others``), else None.
        into: None, or a float32 [d <= P] tensor on the same device (an engine's bucket slice).

    Returns:
        float32 [P]: the rotated-back sum (or average) of the contributors, as the reference's;
        ``into`` itself, its d coordinates written, when it is contiguous float32.
    """
    payload, ranges, diag, hmat = payload.contiguous(), ranges.contiguous(), diag.contiguous(), hmat.contiguous()
    lay, n = plan.levels, plan.world_size
    padded = diag.shape[0]
    out = into if writable(into, padded, diag.device) else torch.empty(padded, dtype=torch.float32,
                                                                       device=diag.device)
    op = op_code(plan.op)
    mine = own.contiguous() if lay.others else payload
    with _on(diag):
        _decode[(-(-out.shape[0] // BLOCK),)](payload, ranges, diag, hmat, count, bad, mismatch, inferred, mine,
                                              out, -(-padded // lay.lanes), out.shape[0], core._grid(lay.top),
                                              1.0 / n, 0.5 * core._top_level(lay.top), plan.factor, N=n, OP=op,
                                              WIDTH=lay.width, GUARD=lay.guard, OFFSET=lay.offset,
                                              OWN=bool(lay.others), FACTOR=plan.factor != 1.0, S=SIDE,
                                              **_OPTIONS)
    return out


def encode(plan, x, residual, diag, hmat, ranges, key, fingerprint, finite):
    """``_encode_kernel`` (steps 1-5 with agreed ranges) as :func:`rotate`, ``noise`` and
    :func:`quantize` in turn (five launches), the outputs as theirs (``y`` [0] without error
    feedback, as the reference's). Not registered: the registered form is
    :func:`torch_backend.kernels.triton_thc_fused.encode` (two launches, the same bits); this
    one is what the tests compare it with."""
    y, held, _, stats, finite = rotate(plan, x, residual, diag, hmat, finite)
    rows, cols = noise(plan, key, ranges)
    payload, residual, saturated = quantize(plan, y, held, ranges, rows, cols, fingerprint, finite, stats)
    return payload, residual, y if plan.error_feedback else y[:0], held, saturated


def _accepts_stats(plan) -> bool:
    """:func:`accepts`, with the statistics words of ``range="previous"`` (the default)."""
    return accepts(plan) and plan.stats is not None


register(core._rotate_kernel, "cuda", accepts, rotate, "triton_thc.rotate")
register(core._noise_kernel, "cuda", accepts, noise, "triton_thc_words.noise")
register(core._receive_kernel, "cuda", accepts, receive, "triton_thc_words.receive")
register(core._finish_kernel, "cuda", _accepts_stats, finish, "triton_thc_words.finish")
register(core._quantize_kernel, "cuda", accepts, quantize, "triton_thc.quantize")
register(core._decode_kernel, "cuda", accepts, decode, "triton_thc.decode")


# ---- ahead-of-time compile (tests): (name, kernel, signature, constexprs) ----
_ROTATE_SIG = {"x_ptr": "*fp32", "res_ptr": "*fp32", "diag_ptr": "*fp32", "h_ptr": "*fp32", "y_ptr": "*fp32",
               "held_ptr": "*fp32", "wanted_ptr": "*fp32", "d": "i32", "range_scale": "fp32", "flush": "fp32",
               "EF": "constexpr", "FLUSH": "constexpr", "SATURATION": "constexpr", "S": "constexpr"}
_QUANTIZE_SIG = {"y_ptr": "*fp32", "held_ptr": "*fp32", "ranges_ptr": "*fp32", "rows_ptr": "*i32",
                 "cols_ptr": "*i32", "payload_ptr": "*i32", "res_ptr": "*fp32", "sat_ptr": "*i32", "P": "i32",
                 "W": "i32", "grid_step": "fp32", "tiny": "fp32", "centre": "fp32", "upper": "fp32",
                 "below": "fp32", "above": "fp32", "LANES": "constexpr", "WIDTH": "constexpr",
                 "GUARD": "constexpr", "OFFSET": "constexpr", "EF": "constexpr", "FLUSH": "constexpr",
                 "B": "constexpr", "TILE_W": "constexpr"}
_DECODE_SIG = {"payload_ptr": "*i32", "ranges_ptr": "*fp32", "diag_ptr": "*fp32", "h_ptr": "*fp32",
               "count_ptr": "*i64", "bad_ptr": "*i64", "mismatch_ptr": "*i1", "inferred_ptr": "*i1",
               "own_ptr": "*i32", "out_ptr": "*fp32", "W": "i32", "D": "i32", "grid_step": "fp32",
               "inv_n": "fp32", "half_top": "fp32", "factor": "fp32", "N": "constexpr", "OP": "constexpr",
               "WIDTH": "constexpr", "GUARD": "constexpr", "OFFSET": "constexpr", "OWN": "constexpr",
               "FACTOR": "constexpr", "S": "constexpr"}


def _aot():
    """The variants compiled for sm_90 by the tests: the rotation in each of its six
    (error feedback, flush bound, saturation) combinations; the quantiser and decoder at THC's
    default layouts for 8 ranks under Average (guard bits, offset) and 2 ranks under Sum (no
    guard bits), the decoder with the op unknown, and the decoder with lanes for the other ranks
    only (``subtract_own``) at 2 ranks under Average; the decoders at 2 ranks with an engine's
    ``1 / n`` folded in (``FACTOR``). The small steps' programs:
    ``triton_thc_words.AOT``."""
    from hvd_gradcomp.lanes import lane_layout
    out = [(f"rotate[ef={ef},flush={flush},saturation={sat}]", _rotate, _ROTATE_SIG,
            {"EF": ef, "FLUSH": flush, "SATURATION": sat, "S": SIDE})
           for ef, flush in ((True, True), (True, False), (False, False)) for sat in (True, False)]
    for n, op, ef, flush in ((8, "average", True, True), (2, "sum", False, False), (3, None, True, False)):
        lay = lane_layout(4, n, 8, op)
        out.append((f"quantize[n={n},op={op},ef={ef},flush={flush}]", _quantize, _QUANTIZE_SIG,
                    {"LANES": lay.lanes, "WIDTH": lay.width, "GUARD": lay.guard, "OFFSET": lay.offset,
                     "EF": ef, "FLUSH": flush, "B": BLOCK, "TILE_W": TILE}))
        out.append((f"decode[n={n},op={op}]", _decode, _DECODE_SIG,
                    {"N": n, "OP": op_code(op), "WIDTH": lay.width, "GUARD": lay.guard,
                     "OFFSET": lay.offset, "OWN": False, "FACTOR": n == 2, "S": SIDE}))
    lay = lane_layout(4, 2, 8, "average", subtract_own=True)
    out.append(("decode[n=2,op=average,own]", _decode, _DECODE_SIG,
                {"N": 2, "OP": op_code("average"), "WIDTH": lay.width, "GUARD": lay.guard,
                 "OFFSET": 0, "OWN": True, "FACTOR": True, "S": SIDE}))
    return out


AOT = _aot()
