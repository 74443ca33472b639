"""TopKC: chunked Top-K whose chunks every rank agrees on, one all-reduce per tensor.

Steps of ``compress`` (``selection="previous"``, the default; ``d`` coordinates, world size
``n``, ``m = ceil(d / chunk)`` chunks, ``k = max(1, ceil(ratio * m))`` of them sent):
    1. Error feedback: ``c = g + beta e`` (flat float32 [d]; ``beta`` is ``residual_decay``,
       default 1: plain error feedback, ``c = g + e``), zero-padded to ``m * chunk`` and
       viewed as ``m`` chunks of ``chunk`` coordinates.
    2. Select the ``k`` chunks of highest *agreed* score, ties by lower chunk index (a stable
       descending sort). The agreed scores are the all-reduced scores of the previous step
       (step 6), which every rank received in the same payload and kept in its state, so
       every rank selects the same chunks without any collective inside ``compress``. Before
       the first step all scores are 0 and the first ``k`` chunks go.
    3. Payload values: the selected chunks packed densely, ``k * chunk`` values pre-scaled by
       1/n (so n ranks' float16 sum stays in range, as in ``fp16``; not where NCCL's Average
       divides by n itself, :attr:`~hvd_gradcomp.base.TensorInfo.prescale`) and cast to
       ``payload_dtype`` with saturation at the largest float16 <= 65504 / n, so that no
       finite gradient makes the n-rank sum inf (the excess stays in error feedback).
    4. Residual: ``e' = c`` with the sent values (as decoded) subtracted from the selected
       chunks: unsent chunks, fp16 rounding and anything the saturation cut.
    5. Scores for the next step: the squared L2 norm of each chunk of ``g + beta e'``, the best
       guess this rank has of next step's corrected gradient (next ``c`` is next ``g`` plus
       ``beta e'``): a chunk just sent starts again from its gradient alone, and a chunk left
       unsent keeps what it owes. Measured on the digits TTA workload (2 ranks, ratio 0.1,
       steps to 96 %, seeds 0 and 1): this step's scores (the blocking ``"current"``) 130 and
       145; scores of ``g + e'`` 145 and 150 (+7 %); scores of ``e'`` alone 150 (seed 0);
       scores of ``c`` taken before sending, as the first version did, 205 (+58 %): they
       re-select the chunks the step has just flushed. Normalised by their maximum (non-finite as 0), cast to
       ``payload_dtype``, appended to the payload: ``m`` values.
    6. A vote: 16 values, 1 in the slot of a hash of this rank's selected chunks (in their
       packing order), 0 elsewhere.
       Horovod all-reduces ``[values..., scores..., votes...]`` (Sum or Average; a rank in
       ``hvd.join()`` contributes zeros, so no vote).

If more than one slot holds votes, the ranks selected different chunks (a rank whose state is
not the others': a checkpoint loaded on one rank only, a rank back from ``hvd.join()``):
``decompress`` returns 0 for the tensor (never a wrong sum), ``finish`` gives every rank back
what it sent (its residual becomes all of ``c``), the scores realign to the all-reduced ones
on every rank, and ``metrics()["realigned"]`` counts the step. Two different selections go
unseen only when their hashes share a slot (1 in 16); the next step realigns them anyway,
since every rank then holds the same scores.

Residual decay (``residual_decay`` = ``beta`` < 1): what a chunk owes is carried at ``beta``
times its value each step, so it is at most about ``1 / (1 - beta)`` steps of its gradient (20
at 0.95) instead of everything since the chunk was last sent. Why: at a small ratio each chunk
is sent about every ``1 / ratio`` steps (every 60-100 steps at 0.01 on a small MLP), and plain
error feedback then delivers those steps' gradient as one burst, applied at once and carried
on by SGD momentum: the coordinates take one step ``1 / ratio`` times too large, long after the
gradient that asked for it, and training oscillates or diverges. Measured (2 ranks, SGD with
momentum 0.9; details in ``docs/bench.md``): ``examples/pytorch_digits.py`` after 10 epochs,
ratio 0.01: 94.2 % test accuracy, 97.2 % with ``residual_decay=0.95`` (ratio 0.1 and FP16:
97.5 %); the TTA digits workload at ratio 0.01 never reached 96 % (it fell to 25 % and 13 %
after 440 steps, seeds 0 and 1) and reached it in 185 and 205 steps with 0.95; at ratio 0.1
0.95 changed the steps to 96 % from 125 to 145 and 115 (seeds 0, 1). The price: a chunk that
stays unsent loses part of its gradient (the compressor is then biased, as GRACE's residual
memory with ``beta`` < 1, Xu et al., ICDCS 2021). Under Adam, whose per-coordinate steps
already tame the bursts, it did not help at 0.01 (the TTA language model ended at perplexity
11.74 against 10.94), which is why the default stays 1. Nothing on the wire changes, and
nothing needs agreeing: the residual is this rank's own. DGC's answers to the same staleness
(Lin et al., ICLR 2018: a warm-up of the ratio, momentum correction with factor masking) are
not implemented: a warm-up changes the payload's size with the step (one TensorFlow trace per
size, and a rank back from ``hvd.join()`` would disagree on it), momentum correction needs
the optimizer's momentum turned off; ``docs/bench.md`` ("TopKC") compares them.

``decompress``: cast, undo the pre-scale, scatter the chunks into zeros, drop the padding.
``finish``: if the all-reduced payload is finite, the residual becomes ``e'`` and the agreed
scores become the payload's score part; otherwise (some rank's gradient held a NaN/inf, which
:func:`~hvd_gradcomp.base.poison` spread to every rank's payload) both stay as they were, on
every rank.

Wire: one all-reduce of ``(k * chunk + m + 16) * itemsize(payload_dtype)`` bytes; nothing else.

``selection="current"`` is the paper's two-round form (blocking): step 2 ranks chunks by this
step's scores of ``c``, summed across ranks by a synchronous side all-reduce inside
``compress`` (``4 m`` bytes, one latency per tensor per step); the payload is the values only.
It needs every rank to compress every tensor in the same order: an unused parameter, a
rank-dependent graph or ``hvd.join()`` makes it fail (PyTorch: after
``HVD_GRADCOMP_SIDE_TIMEOUT`` seconds on every rank; immediately on a rank whose gradient
Horovod fills in), where the default completes.

The scheme compresses every tensor it is given, whatever its size: which tensors reach it is
the routing's decision (:mod:`hvd_gradcomp.routing`; a plain ``topkc`` compressor sends
tensors below ``min_numel``, default 1024, as FP16 instead: their chunk scores and selection
would cost more than they save).

Reference: the TopKC scheme of Han et al., "Beyond Throughput and Compression Ratios: Towards
High End-to-end Utility of Gradient Compression", HotNets 2024 (reconstructed; see
``shared/reference/algorithms.md``); error feedback after Stich et al., NeurIPS 2018.
"""
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import EmptyState, Scheme, TensorInfo, WireBytes, payload_finite, poison, saturating_cast
from .primitives import itemsize
from .options import error_feedback_option, option, ratio_option, validate, wire_dtype_option
from .topk import num_selected

__all__ = ["TopKCConfig", "TopKCState", "TopKCScheme"]

# Smallest score norm used as a divisor: an all-zero tensor's max score is 0 (0/0 is NaN).
_TINY = 1e-30
# Vote slots (step 6): a split vote goes unseen only if two selections hash to one slot.
_SLOTS = 16


@dataclass(frozen=True)
class TopKCConfig:
    """Options of :class:`TopKCScheme`, each declared once below (kind, range, default, which
    way compresses harder, doc: :mod:`hvd_gradcomp.options`; ``python -m hvd_gradcomp --list``
    lists them).

    Tuning ``ratio``: start at 0.1 with error feedback; lower it while the loss keeps up with
    the FP16 run. With SGD and momentum at ratios of 0.01 and below, set
    ``residual_decay=0.95`` (module docstring: plain error feedback then delivers bursts of
    ~1/ratio steps' gradient; measured 94.2 % -> 97.2 % on the PyTorch example). ``chunk``: larger chunks cost fewer score values on the wire (one per chunk)
    and select less precisely, so it moves the bytes both ways. ``payload_dtype`` is the dtype
    of the compressed payload (PowerSGD's ``uncompressed_dtype`` is the dtype of the tensors
    it leaves uncompressed). ``selection="current"`` is the paper's blocking two-round form
    (module docstring).

    The size threshold below which tensors go as FP16 (``min_numel``) is a routing option,
    not one of these (:mod:`hvd_gradcomp.routing`).

    Raises:
        ValueError: an option of the wrong kind or outside its range, naming the scheme and the
            option (one wording for every scheme), e.g. ``"topkc: chunk must be an integer
            >= 1, got 0"``.
    """

    SCHEME: ClassVar[str] = "topkc"
    ratio: float = ratio_option(0.01, doc="fraction of chunks sent per tensor and step")
    chunk: int = option(256, kind="integer", lo=1,
                        doc="coordinates per chunk (larger: fewer scores, coarser selection)")
    error_feedback: bool = error_feedback_option()
    payload_dtype: str = wire_dtype_option("dtype of the packed chunks and scores on the wire")
    selection: str = option("previous", kind="choice", choices=("previous", "current"),
                            harder="previous",
                            doc="chunks chosen by the previous step's agreed scores (one "
                                "all-reduce) or this step's (blocking side all-reduce)")
    residual_decay: float = option(1.0, kind="number", lo=0.0, hi=1.0, lo_open=True,
                                   doc="factor on the carried residual each step (1: plain error "
                                       "feedback; < 1 bounds what a rarely sent chunk owes)")

    def __post_init__(self):
        validate(self)
        if self.residual_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"topkc: residual_decay={self.residual_decay} needs error_feedback=True "
                             "(it decays the error feedback's residual)")


class TopKCState(NamedTuple):
    residual: object  # float32 [d]: error feedback ([0] when error_feedback=False)
    scores: object  # float32 [m]: agreed chunk scores from the last step ("previous"; else [0])
    realigned: object  # int64 []: steps whose output was 0 because ranks selected differently


class _Ctx(NamedTuple):
    idx: object  # int64 [k]: the selected chunks
    left: object  # float32 [m * chunk]: e' padded (None without error feedback)
    sent: object  # float32 [k, chunk]: what this rank sent, decoded (None without error feedback)
    # Set by receive, from the all-reduced payload:
    split: object = None  # bool []: the ranks voted for more than one selection ("previous" only)
    ok: object = None  # bool []: the all-reduced payload is finite


def _correct_kernel(ops, plan, flat, residual):
    """Steps 1 and 5 in one pass: ``c = g + beta e`` zero-padded and viewed as chunks (float32
    [m, chunk]), the guess ``g + beta c`` as chunks (float32 [m, chunk]; step 5's ``g + beta
    e'`` for every chunk not sent this step; ``c`` itself when ``blocking``), and per-chunk
    scores (float32 [m]): the guess's squared norms, non-finite as 0 when ``blocking``.
    ``plan`` = (chunk, error_feedback, blocking, beta), beta the ``residual_decay`` (1.0: no
    multiplication at all); without error feedback ``residual`` is unused."""
    chunk, error_feedback, blocking, decay = plan
    d = ops.shape(flat)[0]
    m = -(-d // chunk)
    if error_feedback:
        c = flat + (residual * decay if decay != 1.0 else residual)
    else:
        c = flat
    guess = c if blocking else (c * decay if decay != 1.0 else c) + flat
    if m * chunk > d:
        tail = ops.zeros((m * chunk - d,), "float32", flat)
        c, guess = ops.concat([c, tail], 0), ops.concat([guess, tail], 0)
    chunks, guess = ops.reshape(c, (m, chunk)), ops.reshape(guess, (m, chunk))
    norms = ops.norm(guess, 1)
    scores = norms * norms
    if blocking:
        scores = ops.where(ops.isfinite(scores), scores, 0.0)
    return chunks, guess, scores


class TopKCScheme(Scheme):
    """Chunked TopK with rank-agreed chunks (module docstring)."""

    name = "topkc"

    def __init__(self, config: TopKCConfig = TopKCConfig()):
        self.config = config
        self.blocking = config.selection == "current"

    # Static sizes: m chunks, k selected, padding.
    def _sizes(self, info: TensorInfo):
        c = self.config.chunk
        m = -(-info.numel // c)
        return m, num_selected(self.config.ratio, m), m * c - info.numel

    def init(self, ops, info: TensorInfo, like):
        cfg = self.config
        if not cfg.error_feedback and self.blocking:
            return EmptyState()
        m, _, _ = self._sizes(info)
        return TopKCState(ops.zeros((info.numel if cfg.error_feedback else 0,), "float32", like),
                          ops.zeros((0 if self.blocking else m,), "float32", like),
                          ops.zeros((), "int64", like))

    def _side_name(self, info):
        return f"hvd_gradcomp.topkc.scores.{info.key}"

    def compress(self, ops, x, state, info, finite):
        cfg = self.config
        m, k, pad = self._sizes(info)
        flat = ops.reshape(x, (info.numel,))
        plan = (cfg.chunk, cfg.error_feedback, self.blocking, cfg.residual_decay)
        if not self.blocking:  # step 2 first: the selection is known before the pass over c
            idx = ops.argsort(state.scores)[:k]
        # Step 1 (and the scores, step 5 or the blocking step 2) in one fused kernel.
        chunks, guess, scores = ops.fuse(_correct_kernel, plan)(flat, state.residual if cfg.error_feedback else flat)
        if self.blocking:
            ranking = ops.allreduce(scores, "sum", self._side_name(info), info.group)
            idx = ops.argsort(ranking)[:k]
        # Step 3.
        picked = ops.gather(chunks, idx)
        wire = saturating_cast(ops, picked * info.prescale, cfg.payload_dtype, limit=info.fp16_limit)
        payload = ops.reshape(wire, (k * cfg.chunk,))
        left = sent = None
        if cfg.error_feedback:
            # Step 4: subtract what was sent (as decoded) from the selected chunks only; the
            # chunks are a temporary here (c = g + e is a new tensor), updated in place.
            sent = ops.cast(wire, "float32") * info.unscale
            left = ops.reshape(ops.index_add(chunks, idx, sent * -1.0), (m * cfg.chunk,))
        if not self.blocking:
            # Step 5: the kernel scored g + beta c, which is g + beta e' for every chunk not
            # sent; a sent chunk's e' is c - sent, so its guess is the kernel's minus beta sent
            # (an O(k chunk) fix-up; without error feedback nothing is owed and the kernel's
            # g + g scores every chunk alike, 4 ||g||^2).
            if cfg.error_feedback:
                owed = sent * cfg.residual_decay if cfg.residual_decay != 1.0 else sent
                rows = ops.gather(guess, idx) - owed
                fixed = ops.norm(rows, 1)
                scores = ops.index_add(scores, idx, fixed * fixed - ops.gather(scores, idx))
            scores = ops.where(ops.isfinite(scores), scores, 0.0)
            top = ops.maximum(ops.max(scores, None), _TINY)
            # Step 6: this rank's vote for the selection it made.
            payload = ops.concat([payload, ops.cast(scores / top, cfg.payload_dtype),
                                  self._vote(ops, idx, info, x)], 0)
        return poison(ops, payload, finite), _Ctx(idx, left, sent)

    def _vote(self, ops, idx, info, like):
        """float [SLOTS]: 1 in the slot of a fingerprint of the selected chunks, 0 elsewhere.

        Fingerprint ``s = sum_j ((idx_j + 1) w_j mod 2**32)`` with odd weights
        ``w_j = (j * 0x9E3779B1 mod 2**31) | 1`` per position ``j`` (position-dependent: the
        payload packs chunks in selection order, so the same set in another order is another
        selection); slot = the top 4 of the low 32 bits of ``s * 0x9E37``. About 15 tensor ops;
        every intermediate stays below 2**63 (products of values below 2**31 and 2**32).
        """
        _, k, _ = self._sizes(info)
        weights = ops.bitwise_or(ops.bitwise_and(ops.arange(k, "int64", like) * 0x9E3779B1, 0x7FFFFFFF), 1)
        terms = ops.bitwise_and((ops.cast(idx, "int64") + 1) * weights, 0xFFFFFFFF)
        mixed = ops.bitwise_and(ops.bitwise_and(ops.sum(terms, None), 0xFFFFFFFF) * 0x9E37, 0xFFFFFFFF)
        slot = ops.right_shift(mixed, 32 - 4)  # _SLOTS = 16 slots: 4 bits
        return ops.cast(ops.arange(_SLOTS, "int64", like) == slot, self.config.payload_dtype)

    def receive(self, ops, payload, ctx, info):
        """``ctx`` with ``ok`` (the payload is finite) and, ``selection="previous"``, ``split``
        (bool []: the ranks that contributed voted for more than one selection): read once
        from the all-reduced payload for decompress and finish, the same on every rank."""
        if self.blocking:  # without error feedback it keeps no state: nothing to decide
            return ctx._replace(ok=payload_finite(ops, payload)) if self.config.error_feedback else ctx
        voted = ops.cast(payload[self._votes_at(info):], "float32") != 0.0
        return ctx._replace(split=ops.count(voted, None) > 1, ok=payload_finite(ops, payload))

    def _votes_at(self, info):
        m, k, _ = self._sizes(info)
        return k * self.config.chunk + m

    def decompress(self, ops, payload, ctx, info):
        cfg = self.config
        m, k, _ = self._sizes(info)
        rows = ops.reshape(ops.cast(payload[:k * cfg.chunk], "float32"), (k, cfg.chunk))
        scale = info.unscale
        if not self.blocking:  # ranks that selected different chunks: 0, never a wrong sum
            # (times 0, not a plain 0: a NaN from a failed rank must still reach the output)
            scale = ops.where(ctx.split, 0.0, scale)
        dense = ops.scatter(ctx.idx, rows * scale, (m, cfg.chunk))
        return ops.reshape(dense, (m * cfg.chunk,))[:info.numel]

    def finish(self, ops, payload, ctx, state, info):
        """Residual and agreed scores move on iff the all-reduced payload is finite; after a
        split vote each rank keeps all of ``c`` (nothing was applied) and the scores realign."""
        if not len(state):
            return state
        cfg = self.config
        m, k, pad = self._sizes(info)
        ok, split = ctx.ok, ctx.split
        new = state
        if ctx.left is not None:
            left = ctx.left
            if split is not None:  # give back what was sent: an O(k chunk) update
                chunks = ops.reshape(left, (m, cfg.chunk))
                left = ops.reshape(ops.index_add(chunks, ctx.idx, ctx.sent * ops.cast(split, "float32")),
                                   (m * cfg.chunk,))
            left = left[:info.numel] if pad else left
            new = new._replace(residual=ops.select(ok, lambda: left, lambda: state.residual))
        if split is not None:
            scores, realigned = ops.select(
                ok, lambda: (ops.cast(payload[k * cfg.chunk:self._votes_at(info)], "float32"),
                             state.realigned + ops.cast(split, "int64")),
                lambda: (state.scores, state.realigned))
            new = new._replace(scores=scores, realigned=realigned)
        return new

    def metrics(self, state) -> dict:
        """``{"realigned": int64 []}``: steps whose output was 0 because ranks disagreed."""
        return {"realigned": state.realigned} if len(state) else {}

    def payload_dtype(self, info: TensorInfo) -> str:
        return self.config.payload_dtype

    def wire(self, info: TensorInfo) -> WireBytes:
        m, k, _ = self._sizes(info)
        size = itemsize(self.config.payload_dtype)
        if self.blocking:
            return WireBytes(k * self.config.chunk * size, 4 * m, 1)
        return WireBytes((k * self.config.chunk + m + _SLOTS) * size)
