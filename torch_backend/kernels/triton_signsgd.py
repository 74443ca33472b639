"""Triton fused forms of signSGD's kernels (CUDA; the "cuda" provider of
:mod:`torch_backend.kernels`, whose docstring is the contract).

The math is :mod:`hvd_gradcomp.signsgd_kernels` (steps 1-6 of :mod:`hvd_gradcomp.signsgd`):

- :func:`encode` (``_encode_kernel``, steps 1-3), three launches: ``_blocks``, one program per
  scale block (``B`` coordinates, in chunks of up to 1024), forms ``e = (p' + S') - [p' >= 0]
  (S' 2)`` of the kept ``p'`` and ``S'`` (step 6 of the last step) and ``p = g + e`` (zeros
  past ``d``), stores it and the block's ``sum |p|``; ``_pack``, one program per tile of
  :data:`TILE` sign words, visits lane by lane the tile's contiguous coordinates (word ``i``
  holds coordinates ``j W + i``, :func:`hvd_gradcomp.lanes.pack`) and shifts ``[p >= 0]`` into
  its lane; ``_stats``, one program, the finite flag (``sum`` of the sums finite, and the
  caller's flag), the (code, has data) pairs in their lanes and the two control words. The
  log code ``round(4 log2 s) + 512`` comes from ``s``'s exponent and mantissa against four
  thresholds (no ``log2`` instruction, as :mod:`~torch_backend.kernels.triton_thc_words`).
- :func:`receive` (``_receive_kernel``), one program: the control words' exact sums
  (:func:`~torch_backend.kernels.triton_thc_words._exact`) and the agreed scales up to their
  ``exp2``, which stays PyTorch's (one more launch) so that the scales are the reference's bit
  for bit on every rank.
- :func:`decode` (``_decode_kernel``), one program per tile of sign words: each coordinate's
  exact lane sum ``V`` and ``V (f 2) - f c`` with its block's factor ``f``.

Exactness: every float operation is the reference's, in its order, rounded once in float32
(compiled with ``enable_fp_fusion=False``: no FMA), so ``p``, the sign and control words, the
receive's outputs and the decoded values equal the reference's bit for bit. The
block sums add up in another order than PyTorch's ``sum``: a scale's code may differ by one
where ``4 log2 s`` lies within float32 rounding of a half-integer, and the finite flag where
the sum of the sums lies within rounding of float32's largest value (tested in Triton's
interpreter, ``tests/core/triton_checks.py``).

Plans covered (:func:`accepts`): blocks of up to :data:`MAX_BLOCK` coordinates (the default
1024, and ``block=none`` on tensors up to that size); larger blocks keep the reference (one
program per block would serialise them). Launch path: no host read, grid from the static shapes,
the current stream of the tensors' device; inputs made contiguous. Tested in Triton's
interpreter on CPU tensors and compiled ahead of time for sm_90 (:data:`AOT`); not yet run on a
GPU.
"""
import torch
import triton
import triton.language as tl

from hvd_gradcomp.signsgd_kernels import CONTROL, _Plan, _decode_kernel, _encode_kernel, _receive_kernel

from .forms import register, writable
from .triton_thc_words import _MANTISSAS, _OPTIONS, _exact, _on, _scale_lane, op_code

__all__ = ["accepts", "encode", "receive", "decode", "AOT", "MAX_BLOCK", "TILE"]

MAX_BLOCK = 1 << 16
TILE = 256  # sign words a pack or decode program
CHUNK = 1024  # coordinates a step of a block program
SMALL = 256  # elements a loop step of the one-program kernels


def accepts(plan) -> bool:
    """True for signSGD plans whose block is at most :data:`MAX_BLOCK` coordinates."""
    return isinstance(plan, _Plan) and 1 <= plan.block <= MAX_BLOCK


def _chunk(block: int) -> int:
    """Coordinates a step of a block program: ``min(CHUNK, next_pow2(B))``."""
    return min(CHUNK, 1 << max(0, (block - 1).bit_length()))


# ---- Triton kernels ----
@triton.jit
def _blocks(x_ptr, q_ptr, s_ptr, p_ptr, sums_ptr, d, B, EF: tl.constexpr, STEP: tl.constexpr):
    """Block ``b``: ``p = x + e`` (0 past ``d``) stored at ``p_ptr``, ``sum |p|`` at ``sums[b]``;
    ``e = (q + S) - [q >= 0] (S 2)``, step 6's residual of the kept ``q`` and the block's kept
    ``S = s[b]`` (as ``signsgd_kernels.pending``)."""
    b = tl.program_id(0).to(tl.int64)
    base = b * B
    acc = tl.zeros((STEP,), dtype=tl.float32)
    if EF:
        s = tl.load(s_ptr + b)
        s2 = s * 2.0
    for start in range(0, B, STEP):
        j = start + tl.arange(0, STEP)
        k = base + j
        inside = j < B
        real = inside & (k < d)
        v = tl.load(x_ptr + k, mask=real, other=0.0)
        if EF:
            q = tl.load(q_ptr + k, mask=real, other=0.0)
            bit = (q >= 0.0).to(tl.float32)
            v = tl.where(real, v + ((q + s) - bit * s2), v)
        tl.store(p_ptr + k, v, mask=inside)
        acc += tl.abs(v)
    tl.store(sums_ptr + b, tl.sum(acc, 0))


@triton.jit
def _pack(p_ptr, words_ptr, P, W, LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr,
          TILE_W: tl.constexpr):
    """Sign words ``i`` of the tile: lane ``j`` holds ``[p >= 0]`` of coordinate ``j W + i``
    (a NaN gives 0)."""
    i = tl.program_id(0).to(tl.int64) * TILE_W + tl.arange(0, TILE_W)
    word = tl.zeros((TILE_W,), dtype=tl.int32)
    for j in tl.static_range(LANES):
        k = j * W + i
        v = tl.load(p_ptr + k, mask=(i < W) & (k < P), other=-1.0)
        word += tl.where(v >= 0.0, 1, 0) << (GUARD + j * WIDTH)
    tl.store(words_ptr + i, word, mask=i < W)


@triton.jit
def _stats(sums_ptr, finite_ptr, payload_ptr, NB, W, WS, inv_block, inv_last, c1, c2, c3, c4,
           LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr, FINITE: tl.constexpr,
           T: tl.constexpr):
    """One program: ``ok`` (the sum of the block sums finite, and ``finite`` with ``FINITE``),
    the ``WS`` words of lanes.pack_scales at ``payload[W:]`` (pair ``b`` = values ``2b`` and
    ``2b + 1``: the code of ``s = sums[b] / size`` and "has data"), then the control words
    ``1 << GUARD`` and ``(not ok) << GUARD``."""
    total = tl.zeros((T,), dtype=tl.float32)
    for start in range(0, NB, T):
        b = start + tl.arange(0, T)
        total += tl.load(sums_ptr + b, mask=b < NB, other=0.0)
    t = tl.sum(total, 0)
    ok = tl.where(t == t, 1, 0) * tl.where(tl.abs(t) != float("inf"), 1, 0)  # int32: 1 finite
    if FINITE:
        ok = ok * tl.where(tl.load(finite_ptr) != 0, 1, 0)
    for start in range(0, WS, T):
        i = start + tl.arange(0, T)
        word = tl.zeros((T,), dtype=tl.int32)
        for j in tl.static_range(LANES):
            k = j * WS + i
            m = (i < WS) & (k < 2 * NB)
            b = k // 2
            s = tl.load(sums_ptr + b, mask=m, other=0.0) * tl.where(b == NB - 1, inv_last, inv_block)
            usable = m & (s > 1e-30) & (ok != 0)
            word += _scale_lane(s, k, usable, c1, c2, c3, c4) << (GUARD + j * WIDTH)
        tl.store(payload_ptr + W + i, word, mask=i < WS)
    tl.store(payload_ptr + W + WS, (tl.full((), 1, tl.int32) << GUARD))
    tl.store(payload_ptr + W + WS + 1, (1 - ok).to(tl.int32) << GUARD)


@triton.jit
def _receive(payload_ptr, counts_ptr, inferred_ptr, e_ptr, NB, W, WS, N: tl.constexpr, OP: tl.constexpr,
             WIDTH: tl.constexpr, GUARD: tl.constexpr, T: tl.constexpr):
    """One program: ``counts`` (int64 [2]: contributors, ranks not finite) and ``inferred``
    from the two control words; ``e[b] = ((code sum - have 512) / max(have, 1)) / 4`` in
    float32 from the statistics words (value ``k`` in lane ``k // WS`` of word ``k % WS``), -inf
    where no rank had data."""
    r = tl.arange(0, 2)
    words = tl.load(payload_ptr + W + WS + r).to(tl.int64)
    inferred = tl.sum(tl.where(r == 0, words, 0), 0) > (1 << GUARD)
    tl.store(counts_ptr + r, _exact(words, inferred, N, OP, GUARD) >> GUARD)
    tl.store(inferred_ptr, inferred)
    mask: tl.constexpr = (1 << WIDTH) - 1
    for start in range(0, NB, T):
        b = start + tl.arange(0, T)
        m = b < NB
        k = 2 * b
        w0 = tl.load(payload_ptr + W + k % WS, mask=m, other=0).to(tl.int64)
        w1 = tl.load(payload_ptr + W + (k + 1) % WS, mask=m, other=0).to(tl.int64)
        code_sum = (_exact(w0, inferred, N, OP, GUARD) >> (GUARD + (k // WS) * WIDTH).to(tl.int64)) & mask
        have = (_exact(w1, inferred, N, OP, GUARD) >> (GUARD + ((k + 1) // WS) * WIDTH).to(tl.int64)) & mask
        code_sum, have = code_sum.to(tl.float32), have.to(tl.float32)
        mean = tl.div_rn(code_sum - have * 512.0, tl.maximum(have, 1.0))
        tl.store(e_ptr + b, tl.where(have > 0.5, mean * 0.25, float("-inf")), mask=m)


@triton.jit
def _decode(payload_ptr, scale_ptr, count_ptr, bad_ptr, inferred_ptr, out_ptr, D, W, B, inv_n, factor,
            N: tl.constexpr, OP: tl.constexpr, LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr,
            FACTOR: tl.constexpr, TILE_W: tl.constexpr):
    """Coordinates ``j W + i < D`` of the tile's words ``i``: ``V`` the exact lane sum, ``f`` the
    block's ``S`` (times ``inv_n`` under Average) plus NaN when a rank failed, out ``V (f 2) - f c``
    (times ``factor``, rounded after it, when ``FACTOR``)."""
    i = tl.program_id(0).to(tl.int64) * TILE_W + tl.arange(0, TILE_W)
    inside = i < W
    inferred = tl.load(inferred_ptr) != 0
    exact = _exact(tl.load(payload_ptr + i, mask=inside, other=0).to(tl.int64), inferred, N, OP, GUARD)
    count = tl.load(count_ptr).to(tl.float32)
    poison = tl.where(tl.load(bad_ptr) > 0, float("nan"), 0.0)
    mask: tl.constexpr = (1 << WIDTH) - 1
    for j in tl.static_range(LANES):
        k = j * W + i
        m = inside & (k < D)
        v = ((exact >> (GUARD + j * WIDTH)) & mask).to(tl.float32)
        s = tl.load(scale_ptr + k // B, mask=m, other=0.0)
        if OP == 1:
            f = s
        elif OP == 0:
            f = s * inv_n
        else:
            f = tl.where(inferred, s, s * inv_n)
        f = f + poison
        value = v * (f * 2.0) - f * count
        if FACTOR:
            value = value * factor
        tl.store(out_ptr + k, value, mask=m)


# ---- launches ----
def _sizes(plan, padded: int):
    """(nb, W, WS): blocks, sign words, statistics words of ``padded`` coordinates."""
    nb = padded // plan.block
    return nb, -(-padded // plan.signs.lanes), -(-2 * nb // plan.stats.lanes)


def encode(plan, x, kept, scale, finite):
    """Fused ``_encode_kernel`` (steps 1-3, from the kept ``p'`` and ``S'``), three launches:
    ``(payload int32, corrected float32 [P])`` (module docstring: bit for bit but for a code or
    the finite flag at a rounding boundary of the block sums); ``finite`` None: the sum alone
    decides."""
    d, B = x.shape[0], plan.block
    nb = -(-d // B)
    _, words, stats = _sizes(plan, nb * B)
    x = x.contiguous()
    kept, scale = (kept.contiguous(), scale.contiguous()) if plan.error_feedback else (x, x)
    corrected = torch.empty(nb * B, dtype=torch.float32, device=x.device)
    sums = torch.empty(nb, dtype=torch.float32, device=x.device)
    payload = torch.empty(words + stats + CONTROL, dtype=torch.int32, device=x.device)
    lay, slay = plan.signs, plan.stats
    last = d - (nb - 1) * B
    with _on(x):
        _blocks[(nb,)](x, kept, scale, corrected, sums, d, B, EF=plan.error_feedback, STEP=_chunk(B), **_OPTIONS)
        _pack[(-(-words // TILE),)](corrected, payload, nb * B, words, LANES=lay.lanes, WIDTH=lay.width,
                                     GUARD=lay.guard, TILE_W=TILE, **_OPTIONS)
        _stats[(1,)](sums, sums if finite is None else finite.contiguous(), payload, nb, words, stats, 1.0 / B,
                     1.0 / last, *_MANTISSAS, LANES=slay.lanes, WIDTH=slay.width, GUARD=slay.guard,
                     FINITE=finite is not None, T=SMALL, **_OPTIONS)
    return payload, corrected


def receive(plan, payload, corrected):
    """Fused ``_receive_kernel``, one launch and PyTorch's ``exp2``: ``(count, bad)`` int64 0-d,
    the agreed scales float32 [nb] and ``inferred`` bool 0-d, the reference's bit for bit."""
    nb, words, stats = _sizes(plan, corrected.shape[0])
    payload = payload.contiguous()
    counts = torch.empty(2, dtype=torch.int64, device=payload.device)
    inferred = torch.empty((), dtype=torch.bool, device=payload.device)
    e = torch.empty(nb, dtype=torch.float32, device=payload.device)
    with _on(payload):
        _receive[(1,)](payload, counts, inferred, e, nb, words, stats, N=plan.world_size, OP=op_code(plan.op),
                       WIDTH=plan.stats.width, GUARD=plan.stats.guard, T=SMALL, **_OPTIONS)
    return counts[0], counts[1], torch.exp2(e), inferred


def decode(plan, payload, count, bad, scale, inferred, into=None):
    """Fused ``_decode_kernel`` (steps 4-5, times ``plan.factor``), one launch: the reference's
    values bit for bit, written into ``into`` (its [d] coordinates, returned) when it is a
    contiguous float32 tensor on the payload's device of at most P values, else a new float32 [P]."""
    padded = scale.shape[0] * plan.block
    _, words, _ = _sizes(plan, padded)
    payload, scale = payload.contiguous(), scale.contiguous()
    out = into if writable(into, padded, payload.device) else torch.empty(padded, dtype=torch.float32,
                                                                          device=payload.device)
    lay = plan.signs
    with _on(payload):
        _decode[(-(-words // TILE),)](payload, scale, count.contiguous(), bad.contiguous(), inferred.contiguous(),
                                      out, out.shape[0], words, plan.block, 1.0 / plan.world_size, plan.factor,
                                      N=plan.world_size, OP=op_code(plan.op), LANES=lay.lanes, WIDTH=lay.width,
                                      GUARD=lay.guard, FACTOR=plan.factor != 1.0, TILE_W=TILE, **_OPTIONS)
    return out


register(_encode_kernel, "cuda", accepts, encode, "triton_signsgd.encode")
register(_receive_kernel, "cuda", accepts, receive, "triton_signsgd.receive")
register(_decode_kernel, "cuda", accepts, decode, "triton_signsgd.decode")


# ---- ahead-of-time compile (tests): (name, kernel, signature, constexprs) ----
_BLOCKS_SIG = {"x_ptr": "*fp32", "q_ptr": "*fp32", "s_ptr": "*fp32", "p_ptr": "*fp32", "sums_ptr": "*fp32",
               "d": "i32", "B": "i32",
               "EF": "constexpr", "STEP": "constexpr"}
_PACK_SIG = {"p_ptr": "*fp32", "words_ptr": "*i32", "P": "i32", "W": "i32", "LANES": "constexpr",
             "WIDTH": "constexpr", "GUARD": "constexpr", "TILE_W": "constexpr"}
_STATS_SIG = {"sums_ptr": "*fp32", "finite_ptr": "*i1", "payload_ptr": "*i32", "NB": "i32", "W": "i32",
              "WS": "i32", "inv_block": "fp32", "inv_last": "fp32", "c1": "i32", "c2": "i32", "c3": "i32",
              "c4": "i32", "LANES": "constexpr", "WIDTH": "constexpr", "GUARD": "constexpr", "FINITE": "constexpr",
              "T": "constexpr"}
_RECEIVE_SIG = {"payload_ptr": "*i32", "counts_ptr": "*i64", "inferred_ptr": "*i1", "e_ptr": "*fp32", "NB": "i32",
                "W": "i32", "WS": "i32", "N": "constexpr", "OP": "constexpr", "WIDTH": "constexpr",
                "GUARD": "constexpr", "T": "constexpr"}
_DECODE_SIG = {"payload_ptr": "*i32", "scale_ptr": "*fp32", "count_ptr": "*i64", "bad_ptr": "*i64",
               "inferred_ptr": "*i1", "out_ptr": "*fp32", "D": "i32", "W": "i32", "B": "i32", "inv_n": "fp32",
               "factor": "fp32", "N": "constexpr", "OP": "constexpr", "LANES": "constexpr", "WIDTH": "constexpr",
               "GUARD": "constexpr", "FACTOR": "constexpr", "TILE_W": "constexpr"}


def _aot():
    """The variants compiled for sm_90 by the tests: every program at the default plan (block
    1024) for 2 ranks under Average, 2 under Sum and 3 with the op unknown; the block program
    without error feedback and with a small block; the statistics with a caller's finite flag."""
    from hvd_gradcomp.lanes import lane_layout, stats_layout
    out = [("blocks[ef=False,step=1024]", _blocks, _BLOCKS_SIG, {"EF": False, "STEP": CHUNK}),
           ("blocks[ef=True,step=16]", _blocks, _BLOCKS_SIG, {"EF": True, "STEP": 16})]
    for n, op in ((2, "average"), (2, "sum"), (3, None)):
        lay = lane_layout(1, n, None, op, scheme="signsgd", centred=False)
        slay = stats_layout(n, lay.guard)
        tag = f"n={n},op={op}"
        out += [(f"blocks[{tag}]", _blocks, _BLOCKS_SIG, {"EF": True, "STEP": CHUNK}),
                (f"pack[{tag}]", _pack, _PACK_SIG,
                 {"LANES": lay.lanes, "WIDTH": lay.width, "GUARD": lay.guard, "TILE_W": TILE}),
                (f"stats[{tag}]", _stats, _STATS_SIG,
                 {"LANES": slay.lanes, "WIDTH": slay.width, "GUARD": slay.guard, "FINITE": n == 3, "T": SMALL}),
                (f"receive[{tag}]", _receive, _RECEIVE_SIG,
                 {"N": n, "OP": op_code(op), "WIDTH": slay.width, "GUARD": slay.guard, "T": SMALL}),
                (f"decode[{tag}]", _decode, _DECODE_SIG,
                 {"N": n, "OP": op_code(op), "LANES": lay.lanes, "WIDTH": lay.width, "GUARD": lay.guard,
                  "FACTOR": n == 2, "TILE_W": TILE})]
    return out


AOT = _aot()
