"""Triton fused form of TopKC's ``_correct_kernel`` (CUDA; the "cuda" provider of
:mod:`torch_backend.kernels`, whose docstring is the contract).

The math is :func:`hvd_gradcomp.topkc._correct_kernel` (steps 1 and 5 of
:mod:`hvd_gradcomp.topkc`): ``c = g + beta e`` zero-padded to ``m`` chunks, the guess
``beta c + g`` (``c`` itself when ``blocking``) scored, not kept: per-chunk scores, its squared norms
(the norm squared, as the reference: ``sqrt`` rounded, then squared; non-finite as 0 when
``blocking``). One program handles ``ROWS`` chunks as a [ROWS, next_pow2(chunk)] tile: it
loads ``g`` and ``e`` (zero past ``d``), stores ``c`` into the [m, chunk] output (the padding as
zeros) and the row scores. Float operations are the reference's, in its order,
rounded once each (``tl.sqrt_rn``, compiled with ``enable_fp_fusion=False``): ``c`` equals the reference's bit for bit; the scores differ by the order of the row sums
(float32 rounding).

``_scatter_kernel`` (the decode): :func:`scatter`, the output's zeros and one program per
received chunk (two launches where the composition made about six; its values the reference's
bit for bit: one cast and one product each).

TopKC's other steps stay with the reference on CUDA: the selection is a stable argsort of the
``m`` agreed scores (small; torch's sort), and ``_pack_kernel`` (gather, saturating cast and
packing of the selected chunks, residual update, rescoring, vote) has no Triton form yet (its
CPU form: :mod:`torch_backend.kernels.cpu_topkc`).

Plans covered (:func:`accepts`): every ``(chunk, error_feedback, blocking, beta)`` with
``chunk <= MAX_CHUNK``. Launch path: no host read, grid from the static shapes, the current
stream of the tensors' device; inputs made contiguous. Tested in Triton's interpreter on CPU
tensors and compiled ahead of time for sm_90 (:data:`AOT`); not yet run on a GPU.
"""
import torch
import triton
import triton.language as tl

from hvd_gradcomp import topkc as core

from .forms import register
from .triton_thc import _OPTIONS, _on

__all__ = ["accepts", "correct", "accepts_scatter", "scatter", "AOT", "MAX_CHUNK"]

MAX_CHUNK = 16384  # a chunk is one row of a program's tile
_TILE = 4096  # elements per program (rows of next_pow2(chunk))


def accepts(plan) -> bool:
    """True for a TopKC ``_correct_kernel`` plan ``(chunk, error_feedback, blocking, beta)``
    with ``1 <= chunk <= MAX_CHUNK``."""
    return (isinstance(plan, tuple) and len(plan) == 4 and isinstance(plan[0], int)
            and 1 <= plan[0] <= MAX_CHUNK)


@triton.jit
def _correct(g_ptr, e_ptr, c_ptr, scores_ptr, d, m, decay,
             CHUNK: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, EF: tl.constexpr,
             BLOCKING: tl.constexpr, DECAY: tl.constexpr):
    # DECAY: beta != 1 (the reference multiplies only then)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, COLS)
    at = row[:, None] * CHUNK + col[None, :]
    inside = (row[:, None] < m) & (col[None, :] < CHUNK)
    real = inside & (at < d)
    g = tl.load(g_ptr + at, mask=real, other=0.0)
    if EF:
        e = tl.load(e_ptr + at, mask=real, other=0.0)
        if DECAY:
            e = e * decay
        c = g + e
    else:
        c = g
    tl.store(c_ptr + at, c, mask=inside)
    if BLOCKING:
        guess = c
    else:
        if DECAY:
            guess = c * decay + g
        else:
            guess = c + g
    norm = tl.sqrt_rn(tl.sum(guess * guess, 1))
    score = norm * norm
    if BLOCKING:
        score = tl.where(score < float("inf"), score, 0.0)  # non-finite (inf, NaN) as 0
    tl.store(scores_ptr + row, score, mask=row < m)


def _shape(chunk: int):
    """(COLS, ROWS): the tile's columns (next power of two of ``chunk``) and rows."""
    cols = 1 << max(0, (chunk - 1).bit_length())
    return cols, max(1, _TILE // cols)


def correct(plan, flat, residual):
    """Fused ``_correct_kernel``.

    Args:
        plan: ``(chunk, error_feedback, blocking, beta)``.
        flat: float32 [d], the gradient; residual: float32 [d] (unused without error feedback).

    Returns:
        (chunks float32 [m, chunk]: ``c`` zero-padded; scores float32 [m]), as the reference's.
    """
    chunk, error_feedback, blocking, decay = plan
    flat = flat.contiguous()
    residual = residual.contiguous() if error_feedback else flat
    d = flat.shape[0]
    m = -(-d // chunk)
    chunks = torch.empty((m, chunk), dtype=torch.float32, device=flat.device)
    scores = torch.empty(m, dtype=torch.float32, device=flat.device)
    cols, rows = _shape(chunk)
    with _on(flat):
        _correct[(-(-m // rows),)](flat, residual, chunks, scores, d, m, float(decay),
                                   CHUNK=chunk, COLS=cols, ROWS=rows, EF=bool(error_feedback),
                                   BLOCKING=bool(blocking), DECAY=decay != 1.0, **_OPTIONS)
    return chunks, scores


@triton.jit
def _scatter(payload_ptr, idx_ptr, split_ptr, out_ptr, d, unscale,
             CHUNK: tl.constexpr, COLS: tl.constexpr, SPLIT: tl.constexpr):
    # one program per received chunk (row r of the payload): its values cast to float32, times
    # the scale, at chunk idx[r] of the output; past d (the padding) dropped
    r = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, COLS)
    at = tl.load(idx_ptr + r) * CHUNK + col
    v = tl.load(payload_ptr + r * CHUNK + col, mask=col < CHUNK, other=0.0).to(tl.float32)
    if SPLIT:
        scale = tl.where(tl.load(split_ptr) != 0, 0.0, unscale)
    else:
        scale = unscale
    tl.store(out_ptr + at, v * scale, mask=(col < CHUNK) & (at < d))


def accepts_scatter(plan) -> bool:
    """True for a TopKC ``_scatter_kernel`` plan ``(chunk, d, unscale, payload_dtype)`` with
    ``1 <= chunk <= MAX_CHUNK``."""
    return (isinstance(plan, tuple) and len(plan) == 4 and isinstance(plan[0], int)
            and 1 <= plan[0] <= MAX_CHUNK)


def scatter(plan, payload, idx, *split):
    """Fused ``_scatter_kernel`` (the decode) in two launches, the output's zeros and one
    program per received chunk.

    Args:
        plan: ``(chunk, d, unscale, payload_dtype)``.
        payload: the all-reduced payload (float16, bfloat16 or float32, its first ``k chunk``
            values the chunks); idx: int64 [k], distinct chunk indices below ``ceil(d / chunk)``;
        split: optional bool 0-d (the ranks' selections differed: times 0, NaN kept).

    Returns:
        float32 [d], the reference's bit for bit (one cast and one product per value).
    """
    chunk, d, unscale, _ = plan
    idx = idx.contiguous()
    k = idx.shape[0]
    out = torch.zeros(d, dtype=torch.float32, device=payload.device)
    if k:
        body = payload[:k * chunk].contiguous()
        with _on(payload):
            _scatter[(k,)](body, idx, split[0].contiguous() if split else idx, out, d, float(unscale),
                           CHUNK=chunk, COLS=_shape(chunk)[0], SPLIT=bool(split), **_OPTIONS)
    return out


register(core._correct_kernel, "cuda", accepts, correct, "triton_topkc.correct")
register(core._scatter_kernel, "cuda", accepts_scatter, scatter, "triton_topkc.scatter")

# Ahead-of-time compile (tests): (name, kernel, signature, constexprs) at the default plan
# (chunk 256, error feedback, selection="previous", beta 1), with residual_decay, the blocking
# form, without error feedback, and at the largest chunk.
_SIGNATURE = {"g_ptr": "*fp32", "e_ptr": "*fp32", "c_ptr": "*fp32", "scores_ptr": "*fp32",
              "d": "i32", "m": "i32", "decay": "fp32", "CHUNK": "constexpr", "COLS": "constexpr",
              "ROWS": "constexpr", "EF": "constexpr", "BLOCKING": "constexpr", "DECAY": "constexpr"}
_SCATTER_SIG = {"payload_ptr": "*fp16", "idx_ptr": "*i64", "split_ptr": "*i1", "out_ptr": "*fp32", "d": "i32",
                "unscale": "fp32", "CHUNK": "constexpr", "COLS": "constexpr", "SPLIT": "constexpr"}
AOT = [
    (f"scatter[chunk={chunk},split={split},{dtype}]", _scatter, dict(_SCATTER_SIG, payload_ptr=dtype),
     {"CHUNK": chunk, "COLS": _shape(chunk)[0], "SPLIT": split})
    for chunk, split, dtype in ((256, True, "*fp16"), (100, False, "*bf16"), (MAX_CHUNK, True, "*fp32"))
] + [
    (f"correct[chunk={chunk},ef={ef},blocking={blocking},decay={decay}]", _correct, _SIGNATURE,
     {"CHUNK": chunk, "COLS": _shape(chunk)[0], "ROWS": _shape(chunk)[1], "EF": ef, "BLOCKING": blocking,
      "DECAY": decay})
    for chunk, ef, blocking, decay in ((256, True, False, False), (100, True, False, True), (256, True, True, False),
                                       (64, False, False, False), (MAX_CHUNK, True, False, False))
]
