"""Triton programs of THC's small per-tensor steps, which the block kernels of
:mod:`torch_backend.kernels.triton_thc` (the "cuda" provider, which registers every form) call
around their own: the finite flag and the statistics words after the rotation (:func:`scales`),
the payload's tail after the quantiser (:func:`tail`), the noise (:func:`noise`), and the
control and statistics words after the all-reduce (:func:`receive`, :func:`finish`).

Each is one launch whatever the tensor's size, most of them a single program looping over the
``nb`` blocks or words (``nb`` is the number of 1024-coordinate blocks, small next to the
tensor), so that THC's launches per call do not grow with the small steps it has
(docs/gpu.md, "Launches per THC call").

- :func:`scales` (end of ``_rotate_kernel``): ``finite`` narrowed to finite ranges, and
  :func:`hvd_gradcomp.lanes.pack_scales`'s words; the log code ``round(4 log2 s) + 512`` comes
  from each range's exponent and its mantissa against four thresholds, not from a ``log2``
  instruction (equal to the reference's unless a range sits within a rounding of a code's
  half-way point).
- :func:`noise` (``_noise_kernel``): the ``nb + B`` hashed counters of
  :func:`hvd_gradcomp.rng.bits32` in int64 arithmetic (the products' low 32 bits kept), the key
  read in the kernel.
- :func:`tail` (end of ``_quantize_kernel``): the quantise programs' saturation counts summed
  in int64, the statistics words and the four control words
  (:func:`hvd_gradcomp.lanes.control_words`) written after the level words.
- :func:`receive` (``_receive_kernel``) and :func:`finish` (``_finish_kernel``): the exact sums
  of the control words (:func:`hvd_gradcomp.lanes.exact_words`, :func:`_exact`, which the
  decoder uses too), and the agreed ranges up to their ``exp2``, which stays PyTorch's so that
  the ranges are the reference's bit for bit on every rank.

Integer outputs equal the reference's bit for bit (tested in Triton's interpreter,
``tests/core/triton_checks.py``; compiled for sm_90 from :data:`AOT`).
"""
import math

import torch
import triton
import triton.language as tl

from hvd_gradcomp import thc_kernels as core

__all__ = ["scales", "tail", "noise", "receive", "finish", "op_code", "AOT"]

SMALL = 256  # elements per loop step of the one-program kernels (statistics, tail, finish)
NOISE_TILE = 1024  # counters per noise program


def _mantissa_threshold(k: int) -> int:
    """The smallest float32 mantissa (23 bits) of ``m`` in [1, 2) with ``round(4 log2 m) >=
    k``: ``ceil((2**((2k - 1) / 8) - 1) 2**23)``."""
    return math.ceil((2.0 ** ((2 * k - 1) / 8) - 1.0) * 2 ** 23)


# lanes.pack_scales' log code from a float32's bits: one more quarter octave per threshold passed
_MANTISSAS = tuple(_mantissa_threshold(k) for k in range(1, 5))
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


def op_code(op) -> int:
    """0 Average, 1 Sum, 2 unknown (the count word's inference decides), as the kernels take ``op``."""
    return {"average": 0, "sum": 1}.get(op, 2)


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
def _scale_lane(s, k, usable, c1, c2, c3, c4):
    """Lane value ``k`` of lanes.pack_scales for a block's scale ``s`` (float32): value ``2b``
    the code ``round(4 log2 s) + 512`` clamped to [1, 1023], from the exponent and the mantissa
    against ``c1..c4`` (the float32 mantissas of ``2**(1/8), 2**(3/8), 2**(5/8), 2**(7/8)``: no
    log2 instruction); value ``2b + 1`` 1 ("has data"); 0 where not ``usable``. Shared by THC's
    and signSGD's statistics kernels."""
    raw = s.to(tl.int32, bitcast=True)
    mant = raw & 0x7FFFFF
    quarter = (tl.where(mant >= c1, 1, 0) + tl.where(mant >= c2, 1, 0) + tl.where(mant >= c3, 1, 0)
               + tl.where(mant >= c4, 1, 0))
    code = 4 * (((raw >> 23) & 0xFF) - 127) + quarter + 512
    code = tl.minimum(tl.maximum(code, 1), 1023)
    return tl.where(usable, tl.where((k & 1) == 1, 1, code), 0)


@triton.jit
def _scales(wanted_ptr, finite_ptr, words_ptr, ok_ptr, NB, W, c1, c2, c3, c4,
            LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr, STATS: tl.constexpr,
            T: tl.constexpr, FINITE: tl.constexpr):
    """One program: ``ok = finite and every wanted range finite`` (``FINITE`` false: no
    ``finite`` flag, the ranges alone); with ``STATS``, the ``W``
    words of lanes.pack_scales (value ``k`` in lane ``k // W`` of word ``k % W``; pair ``b`` is
    values ``2b`` (log code) and ``2b + 1`` (has data)). The code ``round(4 log2 s) + 512``
    is taken from the exponent and the mantissa against ``c1..c4``, the float32 mantissas of
    ``2**(1/8), 2**(3/8), 2**(5/8), 2**(7/8)`` (no log2 instruction)."""
    bad = tl.zeros((T,), dtype=tl.int32)
    for start in range(0, NB, T):
        b = start + tl.arange(0, T)
        s = tl.load(wanted_ptr + b, mask=b < NB, other=0.0)
        bad += tl.where((s != s) | (tl.abs(s) == float("inf")), 1, 0)
    ok = tl.sum(bad, 0) == 0
    if FINITE:
        ok = ok & (tl.load(finite_ptr) != 0)
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
                word += _scale_lane(s, k, usable, c1, c2, c3, c4) << (GUARD + j * WIDTH)
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


def scales(plan, wanted, finite):
    """The end of the fused ``_rotate_kernel``, one launch: ``(statistics int32 [ceil(2 nb /
    lanes)], or [0] with range="current"; finite bool 0-d)`` for the blocks' wanted ranges
    (float32 [nb]) and the gradient's ``finite`` (bool 0-d, or None: the ranges alone)."""
    nb, lay = wanted.shape[0], plan.stats
    words = -(-2 * nb // lay.lanes) if lay is not None else 0
    stats = torch.empty(words, dtype=torch.int32, device=wanted.device)
    ok = torch.empty((), dtype=torch.bool, device=wanted.device)
    with _on(wanted):
        _scales[(1,)](wanted, ok if finite is None else finite.contiguous(), stats, ok, nb, words, *_MANTISSAS,
                      LANES=lay.lanes if lay else 1, WIDTH=lay.width if lay else 1, GUARD=lay.guard if lay else 0,
                      STATS=lay is not None, T=SMALL, FINITE=finite is not None, **_OPTIONS)
    return stats, ok


def tail(plan, payload, words, stats_words, fingerprint, finite, partial):
    """The end of the fused ``_quantize_kernel``, one launch: ``payload`` (int32, its ``words``
    level words written) gets the statistics words and the four control words after them;
    returns the saturation count, the int64 0-d sum of ``partial`` (int32, one per program)."""
    saturated = torch.empty((), dtype=torch.int64, device=payload.device)
    with _on(payload):
        _tail[(1,)](payload, stats_words.contiguous(), fingerprint.contiguous(), finite.contiguous(), partial,
                    saturated, words, stats_words.shape[0], partial.shape[0], GUARD=plan.levels.guard, T=SMALL,
                    **_OPTIONS)
    return saturated


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
    control = payload[payload.shape[0] - core._CONTROL:].contiguous()
    counts = torch.empty(2, dtype=torch.int64, device=payload.device)
    flags = torch.empty(2, dtype=torch.bool, device=payload.device)
    with _on(payload):
        _receive[(1,)](control, counts, flags, N=plan.world_size, OP=op_code(plan.op), GUARD=plan.levels.guard,
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
                      N=plan.world_size, OP=op_code(plan.op), LANES=lay.lanes, WIDTH=lay.width, GUARD=lay.guard,
                      T=SMALL, **_OPTIONS)
    return torch.where(ok, torch.exp2(e), ranges), fields[0], fields[1], fields[2], ok


# ---- ahead-of-time compile (tests): (name, kernel, signature, constexprs) ----
_NOISE_SIG = {"key_ptr": "*i64", "rows_ptr": "*i32", "cols_ptr": "*i32", "NB": "i32", "TOTAL": "i32",
              "TILE_N": "constexpr"}
_SCALES_SIG = {"wanted_ptr": "*fp32", "finite_ptr": "*i1", "words_ptr": "*i32", "ok_ptr": "*i1", "NB": "i32",
               "W": "i32", "c1": "i32", "c2": "i32", "c3": "i32", "c4": "i32", "LANES": "constexpr",
               "WIDTH": "constexpr", "GUARD": "constexpr", "STATS": "constexpr", "T": "constexpr",
               "FINITE": "constexpr"}
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
    """The variants compiled for sm_90 by the tests: the statistics, tail, receive and finish
    programs at THC's default layouts for 8 ranks under Average, 2 under Sum and 3 with the op
    unknown; the statistics without words (``range="current"``); the noise."""
    from hvd_gradcomp.lanes import lane_layout, stats_layout
    out = []
    for n, op in ((8, "average"), (2, "sum"), (3, None)):
        lay = lane_layout(4, n, 8, op)
        stats = stats_layout(n, lay.guard)
        out += [(f"scales[n={n},op={op}]", _scales, _SCALES_SIG,
                 {"LANES": stats.lanes, "WIDTH": stats.width, "GUARD": stats.guard, "STATS": True, "T": SMALL,
                  "FINITE": n == 8}),  # THC passes no finite flag; a caller's flag: one variant
                (f"tail[n={n},op={op}]", _tail, _TAIL_SIG, {"GUARD": lay.guard, "T": SMALL}),
                (f"receive[n={n},op={op}]", _receive, _RECEIVE_SIG, {"N": n, "OP": op_code(op), "GUARD": lay.guard}),
                (f"finish[n={n},op={op}]", _finish, _FINISH_SIG,
                 {"N": n, "OP": op_code(op), "LANES": stats.lanes, "WIDTH": stats.width, "GUARD": stats.guard,
                  "T": SMALL})]
    out.append(("scales[range=current]", _scales, _SCALES_SIG,
                {"LANES": 1, "WIDTH": 1, "GUARD": 0, "STATS": False, "T": SMALL, "FINITE": False}))
    out.append(("noise", _noise, _NOISE_SIG, {"TILE_N": NOISE_TILE}))
    return out


AOT = _aot()
