"""THC's compress in two Triton launches per unit (a DDP bucket's THC group, or one tensor):
the fused form of ``_encode_kernel`` (steps 1-5 with the agreed ranges), registered here for
"cuda" beside :mod:`torch_backend.kernels.triton_thc`'s forms (:mod:`torch_backend.kernels`
states the contract).

Before, a compress ran five launches (``triton_thc.rotate`` and its statistics program, the
noise, ``triton_thc.quantize`` and its tail program). Now:

1. ``triton_thc._rotate`` (unchanged): one program per 1024-coordinate block: ``y``, the held
   residual, the block's wanted range.
2. :func:`_words` (this module): one program per ``TILE`` level words, the quantiser of
   ``triton_thc._quantize`` with step 3's random bits hashed in the program
   (``triton_thc_words._noise``'s counters: row ``b`` is counter ``b``, column ``c`` counter
   ``nb + c``, the key read in the kernel), so no noise tensors exist. The last program to
   finish (an atomic ticket, :func:`_last`) writes what needs every program's or every block's
   result: the finite flag, the statistics words (``triton_thc_words._scales``' math), the
   saturation count summed in int64 and the four control words (``triton_thc_words._tail``'s);
   it then resets the ticket to 0 for the next launch.

The arithmetic is the forms' it replaces, expression for expression, so the payload, residual
and saturation count equal theirs bit for bit (and, given equal ``y``, the reference's:
``tests/core/triton_fused_checks.py``). The ticket: int32 [1], one per device and stream (a
stream runs its launches in turn, so two launches never share one), made zero once and left
zero by every launch. On a GPU each program's stores are ordered before its ticket by a
barrier and the ticket's release (``sem="acq_rel"``, the GPU's scope); the last program reads
the partial counts after its acquire, bypassing L1 (``.cg``). Counted in Triton's interpreter
(programs run one after another) and compiled for sm_90; not yet run on a GPU.
"""
import torch
import triton
import triton.language as tl

from hvd_gradcomp import thc_kernels as core

from .forms import register
from .triton_thc import accepts, quantize_lane, rotate_blocks
from .triton_thc_words import _MANTISSAS, _OPTIONS, SMALL, _lowbias32, _on, _scale_lane

__all__ = ["encode", "ticket", "AOT", "TILE"]

TILE = 256  # level words per program (triton_thc.TILE)

_TICKETS = {}  # (device, stream) -> int32 [1], zero between launches


def ticket(device):
    """The zeroed int32 [1] ticket of ``device``'s current stream (made once; every launch that
    takes it leaves it zero)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


@triton.jit
def _hash_bits(counter, k, offset):
    """rng.bits32's 23 kept bits of ``counter`` (int64, in [0, 2**32)) for key ``k``
    (triton_thc_words._noise's arithmetic)."""
    return _lowbias32(_lowbias32((counter + offset) & 0xFFFFFFFF) ^ k) >> 9


@triton.jit
def _last(ticket_ptr, PROGRAMS):
    """True in the program that takes the last ticket: every other program's stores before its
    ticket are visible to it (the barrier orders this program's threads' stores before the
    ticket; ``acq_rel`` at the GPU's scope)."""
    tl.debug_barrier()
    taken = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    return taken == PROGRAMS - 1


@triton.jit
def _words(y_ptr, held_ptr, ranges_ptr, key_ptr, fp_ptr, finite_ptr, wanted_ptr, payload_ptr, res_ptr,
           partial_ptr, ticket_ptr, sat_ptr,
           P, W, NB, S, PROGRAMS, grid_step, tiny, centre, upper, below, above, c1, c2, c3, c4,
           LANES: tl.constexpr, WIDTH: tl.constexpr, GUARD: tl.constexpr, OFFSET: tl.constexpr,
           EF: tl.constexpr, FLUSH: tl.constexpr, B: tl.constexpr, TILE_W: tl.constexpr,
           S_LANES: tl.constexpr, S_WIDTH: tl.constexpr, S_GUARD: tl.constexpr, STATS: tl.constexpr,
           FINITE: tl.constexpr, T: tl.constexpr):
    pid = tl.program_id(0)
    k = tl.load(key_ptr) & 0xFFFFFFFF
    offset = (k * 0x9E3779B9) & 0xFFFFFFFF
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
        row = (_hash_bits(blk, k, offset) | 0x3F800000).to(tl.int32)
        col = _hash_bits(NB + (c % B), k, offset).to(tl.int32)
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
    tl.store(partial_ptr + pid, tl.sum(saturated, 0))
    if _last(ticket_ptr, PROGRAMS):
        # the finite flag: the caller's (FINITE) and every wanted range finite
        bad = tl.zeros((T,), dtype=tl.int32)
        for start in range(0, NB, T):
            b = start + tl.arange(0, T)
            s = tl.load(wanted_ptr + b, mask=b < NB, other=0.0)
            bad += tl.where((s != s) | (tl.abs(s) == float("inf")), 1, 0)
        ok = tl.sum(bad, 0) == 0
        if FINITE:
            ok = ok & (tl.load(finite_ptr) != 0)
        if STATS:  # the statistics words after the level words
            for start in range(0, S, T):
                w = start + tl.arange(0, T)
                sword = tl.zeros((T,), dtype=tl.int32)
                for j in tl.static_range(S_LANES):
                    v = j * S + w
                    m = (w < S) & (v < 2 * NB)
                    s = tl.load(wanted_ptr + v // 2, mask=m, other=0.0)
                    usable = m & ok & (s > 1e-30)
                    sword += _scale_lane(s, v, usable, c1, c2, c3, c4) << (S_GUARD + j * S_WIDTH)
                tl.store(payload_ptr + W + w, sword, mask=w < S)
        total = tl.zeros((T,), dtype=tl.int64)
        for start in range(0, PROGRAMS, T):
            p = start + tl.arange(0, T)
            total += tl.load(partial_ptr + p, mask=p < PROGRAMS, other=0, cache_modifier=".cg").to(tl.int64)
        tl.store(sat_ptr, tl.sum(total, 0))
        f = tl.load(fp_ptr)
        flag = tl.where(ok, 0, 1).to(tl.int64)
        at = payload_ptr + W + S
        tl.store(at, (tl.full((), 1, tl.int64) << GUARD).to(tl.int32))
        tl.store(at + 1, (flag << GUARD).to(tl.int32))
        tl.store(at + 2, (f << GUARD).to(tl.int32))
        tl.store(at + 3, ((f * f) << GUARD).to(tl.int32))
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


def words(plan, y, held, ranges, key, fingerprint, finite, wanted):
    """Steps 3-5 and the statistics in one launch (module docstring, 2).

    Args:
        y: float32 [P]; held: float32 [P] (flush bound) else unused; ranges: float32 [nb] (the
        agreed ranges); key: int64 0-d (the rounding key); fingerprint: int64 0-d; finite: bool
        0-d or None (the ranges alone decide); wanted: float32 [nb] (this step's wanted ranges).

    Returns:
        (payload int32 [w + S + 4], residual float32 [P] with error feedback else [0],
        saturated int64 0-d), as ``_quantize_kernel`` after ``_rotate_kernel``'s statistics.
    """
    y, ranges, wanted = y.contiguous(), ranges.contiguous(), wanted.contiguous()
    lay, stats_lay, padded = plan.levels, plan.stats, y.shape[0]
    nb = ranges.shape[0]
    w = -(-padded // lay.lanes)
    stats = -(-2 * nb // stats_lay.lanes) if stats_lay is not None else 0
    flush = plan.error_feedback and plan.flush is not None
    payload = torch.empty(w + stats + core._CONTROL, dtype=torch.int32, device=y.device)
    residual = torch.empty(padded if plan.error_feedback else 0, dtype=torch.float32, device=y.device)
    programs = -(-w // TILE)
    partial = torch.empty(programs, dtype=torch.int32, device=y.device)
    saturated = torch.empty((), dtype=torch.int64, device=y.device)
    top_level = core._top_level(lay.top)
    margin = top_level * 2.0 ** -21
    with _on(y):
        _words[(programs,)](y, held.contiguous() if flush else y, ranges, key.contiguous(), fingerprint.contiguous(),
                            wanted if finite is None else finite.contiguous(), wanted, payload,
                            residual if plan.error_feedback else y, partial, ticket(y.device), saturated,
                            padded, w, nb, stats, programs,
                            core._grid(lay.top), core._TINY_RANGE, 0.5 * top_level - 1.0, top_level - 1.0,
                            -1.0 - margin, top_level - 1.0 + margin, *_MANTISSAS,
                            LANES=lay.lanes, WIDTH=lay.width, GUARD=lay.guard, OFFSET=lay.offset,
                            EF=bool(plan.error_feedback), FLUSH=flush, B=plan.block, TILE_W=TILE,
                            S_LANES=stats_lay.lanes if stats_lay else 1, S_WIDTH=stats_lay.width if stats_lay else 1,
                            S_GUARD=stats_lay.guard if stats_lay else 0, STATS=stats_lay is not None,
                            FINITE=finite is not None, T=SMALL, **_OPTIONS)
    return payload, residual, saturated


def encode(plan, x, residual, diag, hmat, ranges, key, fingerprint, finite):
    """Fused ``_encode_kernel`` (steps 1-5 with the agreed ranges) in two launches:
    ``triton_thc``'s rotation, then :func:`words`. Outputs as the reference's: ``(payload,
    residual, y (float32 [P] with error feedback, else [0]), held, saturated)``."""
    y, held, wanted = rotate_blocks(plan, x, residual, diag, hmat)
    payload, residual, saturated = words(plan, y, held, ranges, key, fingerprint, finite, wanted)
    return payload, residual, y if plan.error_feedback else y[:0], held, saturated


register(core._encode_kernel, "cuda", accepts, encode, "triton_thc_fused.encode")


# ---- ahead-of-time compile (tests): (name, kernel, signature, constexprs) ----
_WORDS_SIG = {"y_ptr": "*fp32", "held_ptr": "*fp32", "ranges_ptr": "*fp32", "key_ptr": "*i64", "fp_ptr": "*i64",
              "finite_ptr": "*i1", "wanted_ptr": "*fp32", "payload_ptr": "*i32", "res_ptr": "*fp32",
              "partial_ptr": "*i32", "ticket_ptr": "*i32", "sat_ptr": "*i64", "P": "i32", "W": "i32", "NB": "i32",
              "S": "i32", "PROGRAMS": "i32", "grid_step": "fp32", "tiny": "fp32", "centre": "fp32",
              "upper": "fp32", "below": "fp32", "above": "fp32", "c1": "i32", "c2": "i32", "c3": "i32",
              "c4": "i32", "LANES": "constexpr", "WIDTH": "constexpr", "GUARD": "constexpr", "OFFSET": "constexpr",
              "EF": "constexpr", "FLUSH": "constexpr", "B": "constexpr", "TILE_W": "constexpr",
              "S_LANES": "constexpr", "S_WIDTH": "constexpr", "S_GUARD": "constexpr", "STATS": "constexpr",
              "FINITE": "constexpr", "T": "constexpr"}


def _aot():
    """The variants compiled for sm_90 by the tests: THC's default layouts for 8 ranks under
    Average (flush bound), 2 under Sum (no error feedback) and 3 with the op unknown, and a
    caller's finite flag at 8 ranks."""
    from hvd_gradcomp.lanes import lane_layout, stats_layout
    out = []
    for n, op, ef, flush, finite in ((8, "average", True, True, False), (2, "sum", False, False, False),
                                     (3, None, True, False, False), (8, "average", True, True, True)):
        lay = lane_layout(4, n, 8, op)
        stats = stats_layout(n, lay.guard)
        out.append((f"words[n={n},op={op},ef={ef},flush={flush},finite={finite}]", _words, _WORDS_SIG,
                    {"LANES": lay.lanes, "WIDTH": lay.width, "GUARD": lay.guard, "OFFSET": lay.offset, "EF": ef,
                     "FLUSH": flush, "B": 1024, "TILE_W": TILE, "S_LANES": stats.lanes, "S_WIDTH": stats.width,
                     "S_GUARD": stats.guard, "STATS": True, "FINITE": finite, "T": SMALL}))
    return out


AOT = _aot()
