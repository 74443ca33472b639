"""Triton fused forms of THC's kernels (CUDA; the "cuda" provider of :mod:`torch_backend.kernels`,
whose docstring is the contract).

The math is :mod:`hvd_gradcomp.thc_kernels` (steps 1-8 of :mod:`hvd_gradcomp.thc`), written here
once more as Triton kernels for the default plan, rotation blocks of ``B = 1024``
(:func:`accepts`; any other block keeps the reference). A THC call launches about ten kernels
whatever the tensor's size: rotate and statistics, noise, quantise and tail (compress); receive,
decode, finish with its ``exp2`` and choice (decompress); the rest of the call is the scheme's
few 0-d operations and the caller's finite check.

- :func:`rotate` (``_rotate_kernel``, steps 1-2): one program per 1024-coordinate block. It
  loads ``x`` (zero past ``d``) and ``diag`` as a [32, 32] tile ``X`` (row-major, the
  reference's ``(32, 32)`` view), forms ``H32 (X * D) H32`` with two ``tl.dot`` in
  ``input_precision="ieee"`` (full float32 products and sums: never TF32), adds the error
  feedback (clipped to ``flush`` times the block's own range, the clipped part stored as
  ``held``), and stores ``y`` and the block's wanted range (``T`` times its RMS, or its peak;
  NaN propagates). Then one program (``_scales``) narrows the finite flag to finite ranges and
  packs the statistics words (:func:`hvd_gradcomp.lanes.pack_scales`); its log code comes from
  each range's exponent and mantissa (four thresholds), not from a ``log2`` instruction.
- :func:`noise` (``_noise_kernel``): the ``nb + B`` hashed counters of
  :func:`hvd_gradcomp.rng.bits32` in int64 arithmetic, the key read in the kernel.
- :func:`quantize` (``_quantize_kernel``, steps 3-5): one program per tile of ``TILE`` level
  words. Word ``i`` of the planar layout holds coordinates ``j w + i`` (lane ``j``,
  :func:`hvd_gradcomp.lanes.pack`), so the program visits, lane by lane, ``TILE`` contiguous
  coordinates each: grid position, clip, saturation count, noise ``bitcast(rows[b] ^ cols[c])``,
  floor, residual, and the level shifted into its lane; then the offset comes off and the word
  is stored. The saturation counts are per program (int32); one more program (``_tail``) sums
  them into the int64 0-d count and writes the statistics and the four control words
  (:func:`hvd_gradcomp.lanes.control_words`) into the payload's tail.
- :func:`receive` (``_receive_kernel``) and :func:`finish` (``_finish_kernel``): one program
  each over the control words and the statistics words (:func:`hvd_gradcomp.lanes.agreed_scales`
  up to the ``exp2``, which stays PyTorch's so that the ranges are the reference's bit for bit).
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
itself; ``tests/core/triton_checks.py``). The statistics words are rounded log codes of the
ranges: equal unless a range sits within its rounding of a code's half-way point. A non-finite ``y`` gives undefined
levels, as in the reference (its "not finite" control word makes every rank ignore them).

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
from . import register

__all__ = ["accepts", "rotate", "quantize", "decode", "noise", "receive", "finish", "AOT", "BLOCK", "TILE"]

BLOCK = 1024  # the rotation block these kernels cover (a [32, 32] tile)
SIDE = 32
TILE = 256  # level words per quantise program
SMALL = 256  # elements per loop step of the one-program kernels (statistics, tail, finish)
NOISE_TILE = 1024  # counters per noise program


def _mantissa_threshold(k: int) -> int:
    """The smallest float32 mantissa (23 bits) of ``m`` in [1, 2) with ``round(4 log2 m) >=
    k``: ``ceil((2**((2k - 1) / 8) - 1) 2**23)``."""
    return math.ceil((2.0 ** ((2 * k - 1) / 8) - 1.0) * 2 ** 23)


# lanes.pack_scales' log code from a float32's bits: one more quarter octave per threshold passed
_MANTISSAS = tuple(_mantissa_threshold(k) for k in range(1, 5))


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
        live = top > 0.0
        delta = top * grid_step
        inv = tl.where(live, tl.div_rn(1.0, tl.maximum(delta, tiny)), 0.0)
        u = y * inv + tl.where(live, centre, -1.0)
        clipped = tl.minimum(tl.maximum(u, -1.0, propagate_nan=tl.PropagateNan.ALL), upper,
                             propagate_nan=tl.PropagateNan.ALL)
        saturated += tl.where(m & ((u < below) | (u > above)), 1, 0)
        row = tl.load(rows_ptr + blk, mask=m, other=0)
        col = tl.load(cols_ptr + (c % B), mask=m, other=0)
        noise = (row ^ col).to(tl.float32, bitcast=True)
        q = tl.floor(clipped + noise)
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
def _exact(words, inferred, N: tl.constexpr, OP: tl.constexpr, GUARD: tl.constexpr):
    """lanes.exact_words of int64 ``words``: the words under Sum (``OP`` 1, or no guard bits);
    under Average (``OP`` 0) the multiple of ``2**GUARD`` next to ``N * word`` away from zero,
    with the reference's ``2**40`` bias; ``OP`` 2 (unknown): ``inferred`` (the count word says
    Sum) chooses."""
    if OP == 1 or GUARD == 0:
        exact = words
    else:
        bias: tl.constexpr = 1 << 40
        scaled = words * N + bias
        up = ((scaled + ((1 << GUARD) - 1)) >> GUARD) << GUARD
        down = (scaled >> GUARD) << GUARD
        exact = tl.where(words < 0, down, up) - bias
        if OP == 2:
            exact = tl.where(inferred, words, exact)
    return exact


@triton.jit
def _lowbias32(x):
    """rng._lowbias32 of int64 values in [0, 2**32), in int64 with the products' low 32 bits
    kept (the reference's arithmetic)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _noise(key_ptr, rows_ptr, cols_ptr, NB, TOTAL, TILE_N: tl.constexpr):
    """_noise_bits: counter ``i`` of ``TOTAL = nb + B`` hashed with the key (int64 0-d, read
    here); ``rows[i] = bits | 1.0's bits`` for ``i < nb``, ``cols[i - nb] = bits`` after."""
    i = tl.program_id(0).to(tl.int64) * TILE_N + tl.arange(0, TILE_N)
    k = tl.load(key_ptr) & 0xFFFFFFFF
    offset = (k * 0x9E3779B9) & 0xFFFFFFFF
    bits = _lowbias32(_lowbias32((i + offset) & 0xFFFFFFFF) ^ k) >> 9
    tl.store(rows_ptr + i, (bits | 0x3F800000).to(tl.int32), mask=i < NB)
    tl.store(cols_ptr + (i - NB), bits.to(tl.int32), mask=(i >= NB) & (i < TOTAL))


@triton.jit
def _scales(wanted_ptr, finite_ptr, words_ptr, ok_ptr, NB, W, c1, c2, c3, c4,
            LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr, STATS: tl.constexpr,
            T: tl.constexpr):
    """One program: ``ok = finite and every wanted range finite``; with ``STATS``, the ``W``
    words of lanes.pack_scales (value ``k`` in lane ``k // W`` of word ``k % W``; pair ``b`` is
    values ``2b`` (log code) and ``2b + 1`` (has data)). The code ``round(4 log2 s) + 512``
    is taken from the exponent and the mantissa against ``c1..c4``, the float32 mantissas of
    ``2**(1/8), 2**(3/8), 2**(5/8), 2**(7/8)`` (no log2 instruction)."""
    bad = tl.zeros((T,), dtype=tl.int32)
    for start in range(0, NB, T):
        b = start + tl.arange(0, T)
        s = tl.load(wanted_ptr + b, mask=b < NB, other=0.0)
        bad += tl.where((s != s) | (tl.abs(s) == float("inf")), 1, 0)
    ok = (tl.load(finite_ptr) != 0) & (tl.sum(bad, 0) == 0)
    tl.store(ok_ptr, ok)
    if STATS:
        for start in range(0, W, T):
            i = start + tl.arange(0, T)
            word = tl.zeros((T,), dtype=tl.int32)
            for j in tl.static_range(LANES):
                k = j * W + i
                m = (i < W) & (k < 2 * NB)
                s = tl.load(wanted_ptr + k // 2, mask=m, other=0.0)
                usable = m & ok & (s > 1e-30)
                raw = s.to(tl.int32, bitcast=True)
                mant = raw & 0x7FFFFF
                quarter = (tl.where(mant >= c1, 1, 0) + tl.where(mant >= c2, 1, 0) + tl.where(mant >= c3, 1, 0)
                           + tl.where(mant >= c4, 1, 0))
                code = 4 * (((raw >> 23) & 0xFF) - 127) + quarter + 512
                code = tl.minimum(tl.maximum(code, 1), 1023)
                value = tl.where(usable, tl.where((k & 1) == 1, 1, code), 0)
                word += value << (GUARD + j * WIDTH)
            tl.store(words_ptr + i, word, mask=i < W)


@triton.jit
def _tail(payload_ptr, stats_ptr, fp_ptr, finite_ptr, partial_ptr, sat_ptr, W, S, PROGRAMS,
          GUARD: tl.constexpr, T: tl.constexpr):
    """One program after :func:`_quantize`: the ``S`` statistics words at ``payload[W:]``, the
    four control words (1, not finite, s, s**2) << GUARD wrapped to int32 after them, and the
    saturation count (the quantise programs' partial counts, summed in int64)."""
    for start in range(0, S, T):
        i = start + tl.arange(0, T)
        tl.store(payload_ptr + W + i, tl.load(stats_ptr + i, mask=i < S, other=0), mask=i < S)
    total = tl.zeros((T,), dtype=tl.int64)
    for start in range(0, PROGRAMS, T):
        i = start + tl.arange(0, T)
        total += tl.load(partial_ptr + i, mask=i < PROGRAMS, other=0).to(tl.int64)
    tl.store(sat_ptr, tl.sum(total, 0))
    s = tl.load(fp_ptr)
    bad = tl.where(tl.load(finite_ptr) != 0, 0, 1).to(tl.int64)
    at = payload_ptr + W + S
    tl.store(at, (tl.full((), 1, tl.int64) << GUARD).to(tl.int32))
    tl.store(at + 1, (bad << GUARD).to(tl.int32))
    tl.store(at + 2, (s << GUARD).to(tl.int32))
    tl.store(at + 3, ((s * s) << GUARD).to(tl.int32))


@triton.jit
def _receive(tail_ptr, counts_ptr, flags_ptr, N: tl.constexpr, OP: tl.constexpr, GUARD: tl.constexpr):
    """_receive_kernel: the four all-reduced control words (int32, ``tail_ptr``) to ``counts``
    (int64 [2]: contributors, not finite) and ``flags`` (bool [2]: fingerprints disagree, the
    count word says Sum)."""
    r = tl.arange(0, 4)
    words = tl.load(tail_ptr + r).to(tl.int64)
    count_word = tl.sum(tl.where(r == 0, words, 0), 0)
    inferred = count_word > (1 << GUARD)
    c = _exact(words, inferred, N, OP, GUARD) >> GUARD
    c0 = tl.sum(tl.where(r == 0, c, 0), 0)
    s1 = tl.sum(tl.where(r == 2, c, 0), 0)
    s2 = tl.sum(tl.where(r == 3, c, 0), 0)
    tl.store(counts_ptr + r, c, mask=r < 2)
    tl.store(flags_ptr, s2 * c0 != s1 * s1)
    tl.store(flags_ptr + 1, inferred)


@triton.jit
def _finish(words_ptr, e_ptr, inferred_ptr, step_ptr, realigned_ptr, saturated_ptr, new_saturated_ptr,
            bad_ptr, mismatch_ptr, fields_ptr, ok_ptr, NB, W,
            N: tl.constexpr, OP: tl.constexpr, LANES: tl.constexpr, WIDTH: tl.constexpr,
            GUARD: tl.constexpr, T: tl.constexpr):
    """_finish_kernel but for exp2 (one program): ``e[b] = ((code sum - have 512) / max(have,
    1)) / 4`` in float32 from the ``W`` all-reduced statistics words (lanes.agreed_scales),
    -inf where no rank had data; ``fields`` (int64 [3]: step, realigned, saturated after the
    step) and ``ok`` (no rank failed: otherwise all unchanged)."""
    inferred = tl.load(inferred_ptr) != 0
    mask: tl.constexpr = (1 << WIDTH) - 1
    for start in range(0, NB, T):
        b = start + tl.arange(0, T)
        m = b < NB
        k = 2 * b
        w0 = tl.load(words_ptr + k % W, mask=m, other=0).to(tl.int64)
        w1 = tl.load(words_ptr + (k + 1) % W, mask=m, other=0).to(tl.int64)
        code_sum = ((_exact(w0, inferred, N, OP, GUARD) >> (GUARD + (k // W) * WIDTH).to(tl.int64)) & mask)
        have = ((_exact(w1, inferred, N, OP, GUARD) >> (GUARD + ((k + 1) // W) * WIDTH).to(tl.int64)) & mask)
        code_sum, have = code_sum.to(tl.float32), have.to(tl.float32)
        mean = tl.div_rn(code_sum - have * 512.0, tl.maximum(have, 1.0))
        tl.store(e_ptr + b, tl.where(have > 0.5, mean * 0.25, float("-inf")), mask=m)
    ok = tl.load(bad_ptr) == 0
    mismatch = tl.load(mismatch_ptr) != 0
    step = tl.load(step_ptr)
    realigned = tl.load(realigned_ptr)
    tl.store(fields_ptr, tl.where(ok, tl.where(mismatch, 0, step + 1), step))
    tl.store(fields_ptr + 1, tl.where(ok, realigned + mismatch.to(tl.int64), realigned))
    tl.store(fields_ptr + 2, tl.where(ok, tl.load(new_saturated_ptr), tl.load(saturated_ptr)))
    tl.store(ok_ptr, ok)


@triton.jit
def _decode(payload_ptr, ranges_ptr, diag_ptr, h_ptr, count_ptr, bad_ptr, mismatch_ptr, inferred_ptr,
            out_ptr, W, grid_step, inv_n, half_top,
            N: tl.constexpr, OP: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr,
            OFFSET: tl.constexpr, S: tl.constexpr):
    # OP: 0 Average, 1 Sum, 2 unknown (the count word's inference decides).
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
    tl.store(out_ptr + c, back * tl.load(diag_ptr + c))


# Options of every launch: no FMA contraction (the reference rounds each product and sum).
_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def _on(t):
    """A context that makes ``t``'s CUDA device current (Triton launches on the current device
    and its current stream); nothing for a CPU tensor (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
    lay = plan.stats
    words = -(-2 * nb // lay.lanes) if lay is not None else 0
    stats = torch.empty(words, dtype=torch.int32, device=x.device)
    ok = torch.empty((), dtype=torch.bool, device=x.device)
    with _on(x):
        _scales[(1,)](wanted, finite.contiguous(), stats, ok, nb, words, *_MANTISSAS,
                      LANES=lay.lanes if lay else 1, WIDTH=lay.width if lay else 1, GUARD=lay.guard if lay else 0,
                      STATS=lay is not None, T=SMALL, **_OPTIONS)
    return y, held, wanted, stats, ok


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
        saturated = torch.empty((), dtype=torch.int64, device=y.device)
        _tail[(1,)](payload, stats_words.contiguous(), fingerprint.contiguous(), finite.contiguous(), partial,
                    saturated, w, stats, programs, GUARD=lay.guard, T=SMALL, **_OPTIONS)
    return payload, residual, saturated


def decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred):
    """Fused ``_decode_kernel`` (steps 6-7).

    Args:
        payload: int32 [w + S + 4], all-reduced; ranges: float32 [nb]; diag: float32 [P];
        hmat: float32 [32, 32]; count, bad: int64 0-d; mismatch, inferred: bool 0-d.

    Returns:
        float32 [P]: the rotated-back sum (or average) of the contributors, as the reference's.
    """
    payload, ranges, diag, hmat = payload.contiguous(), ranges.contiguous(), diag.contiguous(), hmat.contiguous()
    lay, n = plan.levels, plan.world_size
    padded = diag.shape[0]
    out = torch.empty(padded, dtype=torch.float32, device=diag.device)
    op = _op_code(plan)
    with _on(diag):
        _decode[(padded // BLOCK,)](payload, ranges, diag, hmat, count, bad, mismatch, inferred, out,
                                    -(-padded // lay.lanes), core._grid(lay.top), 1.0 / n,
                                    0.5 * core._top_level(lay.top), N=n, OP=op, WIDTH=lay.width,
                                    GUARD=lay.guard, OFFSET=lay.offset, S=SIDE, **_OPTIONS)
    return out


def noise(plan, key, ranges):
    """Fused ``_noise_kernel`` (step 3's random bits), one launch: ``(rows int32 [nb], cols
    int32 [B])`` for ``key`` (int64 0-d, read in the kernel), the reference's bit for bit."""
    nb, total = ranges.shape[0], ranges.shape[0] + plan.block
    rows = torch.empty(nb, dtype=torch.int32, device=ranges.device)
    cols = torch.empty(plan.block, dtype=torch.int32, device=ranges.device)
    with _on(ranges):
        _noise[(-(-total // NOISE_TILE),)](key.contiguous(), rows, cols, nb, total, TILE_N=NOISE_TILE, **_OPTIONS)
    return rows, cols


def receive(plan, payload):
    """Fused ``_receive_kernel`` (step 6's control words), one launch: ``(count, bad)`` int64
    0-d and ``(mismatch, inferred)`` bool 0-d, views of two small tensors; the reference's
    values exactly (integer arithmetic)."""
    tail = payload[payload.shape[0] - core._CONTROL:].contiguous()
    counts = torch.empty(2, dtype=torch.int64, device=payload.device)
    flags = torch.empty(2, dtype=torch.bool, device=payload.device)
    with _on(payload):
        _receive[(1,)](tail, counts, flags, N=plan.world_size, OP=_op_code(plan), GUARD=plan.levels.guard,
                       **_OPTIONS)
    return counts[0], counts[1], flags[0], flags[1]


def finish(plan, payload, ranges, step, realigned, saturated, new_saturated, bad, mismatch, inferred):
    """Fused ``_finish_kernel`` (step 8's small fields): one launch for the agreed ranges' log2
    and the counters, then ``exp2`` and the choice by ``ok`` as the reference's PyTorch
    operations (two launches), so the ranges are the reference's bit for bit."""
    nb, lay = ranges.shape[0], plan.stats
    stop = payload.shape[0] - core._CONTROL
    words = -(-2 * nb // lay.lanes)
    e = torch.empty(nb, dtype=torch.float32, device=ranges.device)
    fields = torch.empty(3, dtype=torch.int64, device=ranges.device)
    ok = torch.empty((), dtype=torch.bool, device=ranges.device)
    small = [t.contiguous() for t in (inferred, step, realigned, saturated, new_saturated, bad, mismatch)]
    with _on(ranges):
        _finish[(1,)](payload[stop - words:stop].contiguous(), e, *small, fields, ok, nb, words,
                      N=plan.world_size, OP=_op_code(plan), LANES=lay.lanes, WIDTH=lay.width, GUARD=lay.guard,
                      T=SMALL, **_OPTIONS)
    return torch.where(ok, torch.exp2(e), ranges), fields[0], fields[1], fields[2], ok


def _op_code(plan) -> int:
    """0 Average, 1 Sum, 2 unknown (the count word's inference decides), as the kernels take it."""
    return {"average": 0, "sum": 1}.get(plan.op, 2)


def _accepts_stats(plan) -> bool:
    """:func:`accepts`, with the statistics words of ``range="previous"`` (the default)."""
    return accepts(plan) and plan.stats is not None


register(core._rotate_kernel, "cuda", accepts, rotate, "triton_thc.rotate")
register(core._noise_kernel, "cuda", accepts, noise, "triton_thc.noise")
register(core._receive_kernel, "cuda", accepts, receive, "triton_thc.receive")
register(core._finish_kernel, "cuda", _accepts_stats, finish, "triton_thc.finish")
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
               "out_ptr": "*fp32", "W": "i32", "grid_step": "fp32", "inv_n": "fp32", "half_top": "fp32",
               "N": "constexpr", "OP": "constexpr", "WIDTH": "constexpr", "GUARD": "constexpr",
               "OFFSET": "constexpr", "S": "constexpr"}

_NOISE_SIG = {"key_ptr": "*i64", "rows_ptr": "*i32", "cols_ptr": "*i32", "NB": "i32", "TOTAL": "i32",
              "TILE_N": "constexpr"}
_SCALES_SIG = {"wanted_ptr": "*fp32", "finite_ptr": "*i1", "words_ptr": "*i32", "ok_ptr": "*i1", "NB": "i32",
               "W": "i32", "c1": "i32", "c2": "i32", "c3": "i32", "c4": "i32", "LANES": "constexpr",
               "WIDTH": "constexpr", "GUARD": "constexpr", "STATS": "constexpr", "T": "constexpr"}
_TAIL_SIG = {"payload_ptr": "*i32", "stats_ptr": "*i32", "fp_ptr": "*i64", "finite_ptr": "*i1",
             "partial_ptr": "*i32", "sat_ptr": "*i64", "W": "i32", "S": "i32", "PROGRAMS": "i32",
             "GUARD": "constexpr", "T": "constexpr"}
_RECEIVE_SIG = {"tail_ptr": "*i32", "counts_ptr": "*i64", "flags_ptr": "*i1", "N": "constexpr", "OP": "constexpr",
                "GUARD": "constexpr"}
_FINISH_SIG = {"words_ptr": "*i32", "e_ptr": "*fp32", "inferred_ptr": "*i1", "step_ptr": "*i64",
               "realigned_ptr": "*i64", "saturated_ptr": "*i64", "new_saturated_ptr": "*i64", "bad_ptr": "*i64",
               "mismatch_ptr": "*i1", "fields_ptr": "*i64", "ok_ptr": "*i1", "NB": "i32", "W": "i32",
               "N": "constexpr", "OP": "constexpr", "LANES": "constexpr", "WIDTH": "constexpr",
               "GUARD": "constexpr", "T": "constexpr"}


def _aot():
    """The variants compiled for sm_90 by the tests: the rotation in each of its six
    (error feedback, flush bound, saturation) combinations; the quantiser and decoder at THC's default layouts
    for 8 ranks under Average (guard bits, offset) and 2 ranks under Sum (no guard bits), and
    the decoder with the op unknown; the statistics, tail, receive and finish programs at the
    same three layouts, the statistics without words (``range="current"``), and the noise."""
    from hvd_gradcomp.lanes import lane_layout, stats_layout
    out = [(f"rotate[ef={ef},flush={flush},saturation={sat}]", _rotate, _ROTATE_SIG,
            {"EF": ef, "FLUSH": flush, "SATURATION": sat, "S": SIDE})
           for ef, flush in ((True, True), (True, False), (False, False)) for sat in (True, False)]
    for n, op, ef, flush in ((8, "average", True, True), (2, "sum", False, False), (3, None, True, False)):
        lay = lane_layout(4, n, 8, op)
        out.append((f"quantize[n={n},op={op},ef={ef},flush={flush}]", _quantize, _QUANTIZE_SIG,
                    {"LANES": lay.lanes, "WIDTH": lay.width, "GUARD": lay.guard, "OFFSET": lay.offset,
                     "EF": ef, "FLUSH": flush, "B": BLOCK, "TILE_W": TILE}))
        out.append((f"decode[n={n},op={op}]", _decode, _DECODE_SIG,
                    {"N": n, "OP": {"average": 0, "sum": 1}.get(op, 2), "WIDTH": lay.width, "GUARD": lay.guard,
                     "OFFSET": lay.offset, "S": SIDE}))
        stats = stats_layout(n, lay.guard)
        code = {"average": 0, "sum": 1}.get(op, 2)
        out.append((f"scales[n={n},op={op}]", _scales, _SCALES_SIG,
                    {"LANES": stats.lanes, "WIDTH": stats.width, "GUARD": stats.guard, "STATS": True, "T": SMALL}))
        out.append((f"tail[n={n},op={op}]", _tail, _TAIL_SIG, {"GUARD": lay.guard, "T": SMALL}))
        out.append((f"receive[n={n},op={op}]", _receive, _RECEIVE_SIG, {"N": n, "OP": code, "GUARD": lay.guard}))
        out.append((f"finish[n={n},op={op}]", _finish, _FINISH_SIG,
                    {"N": n, "OP": code, "LANES": stats.lanes, "WIDTH": stats.width, "GUARD": stats.guard,
                     "T": SMALL}))
    out.append(("scales[range=current]", _scales, _SCALES_SIG,
                {"LANES": 1, "WIDTH": 1, "GUARD": 0, "STATS": False, "T": SMALL}))
    out.append(("noise", _noise, _NOISE_SIG, {"TILE_N": NOISE_TILE}))
    return out


AOT = _aot()
