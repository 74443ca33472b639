"""signSGD with error feedback on one all-reduce of integer lanes.

EF-SignSGD (Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019, Algorithm 1) sends ``Delta = (||p||_1 / d) sign(p)``
for ``p = g + e`` and keeps ``e' = p - Delta``. Here every rank sends only the signs, one bit
each in int32 lanes wide enough for the sum over all ranks (:mod:`hvd_gradcomp.lanes`), and
the ranks agree on one scale ``S`` per block of coordinates and step, carried as log codes in
the same payload, so the sum of the ranks' contributions ``S sign(p_i)`` is ``S`` times the
summed signs: one all-reduce, no side collective, no state the ranks must agree on between
steps. Scales per block, as in Zheng, Huang, Kwok, "Communication-Efficient Distributed
Blockwise Momentum SGD with Error-Feedback", NeurIPS 2019, follow coordinates of different
sizes within a tensor.

Notation: ``d`` coordinates, world size ``n``, blocks of ``B`` coordinates (``block``; the
last may be short), ``nb = ceil(d / B)``, ``P = nb B``; ``g`` guard bits (0 under a known
Sum, else ``bit_length(n)``); sign lanes of ``w = bit_length(n)`` bits, ``lanes`` a word: as
many as keep the sum of ``n`` words below ``2**31`` (:func:`~hvd_gradcomp.lanes.lane_layout`
with 1-bit levels, ``centred=False``: no offset, so the ``P`` lane sums unpack in int32, at
the cost of at most one lane a word).

Steps of ``compress`` (no collective):
    1. ``p = g + e`` (float32 [d]; ``e`` step 6's residual, 0 without error feedback), zero-padded
       to ``P``. This rank's gradient counts as not finite if ``sum |p|`` is not (a NaN/inf,
       or finite values summing beyond float32): that sum is the only check
       (``guards_nonfinite`` is off, no separate pass over ``g``).
    2. Per block, this rank's scale ``s = ||p_block||_1 / size`` (the paper's, per block) as a
       log code ``clamp(round(4 log2 s) + 512, 1, 1023)`` (quarter octaves over float32's
       range) and a flag "has data" (code and flag 0 when ``s <= 1e-30`` or not finite;
       :func:`~hvd_gradcomp.lanes.pack_scales`).
    3. Bits ``b = [p >= 0]`` (a NaN gives 0: never a carry), packed planar into the lanes
       (:func:`~hvd_gradcomp.lanes.pack`); the (code, flag) pairs in lanes of
       ``bit_length(1023 n)`` bits above the same guard bits; two control words
       (:func:`~hvd_gradcomp.lanes.control_words`): 1 (contributes), 1 if not finite.

Horovod all-reduces the int32 words with Sum or Average.

Steps of ``decompress`` / ``finish``:
    4. Exact sums of the control words and lanes (:func:`~hvd_gradcomp.lanes.read_control`,
       :func:`~hvd_gradcomp.lanes.exact_words`: Average's truncated words are recovered
       exactly). ``c`` contributing ranks, ``V`` per coordinate the ranks with ``p >= 0``, so
       the summed signs are ``2 V - c``. When the op is unknown (a hand-made call) the count
       word tells Sum from Average (full participation assumed).
    5. Per block the agreed scale ``S = 2**((mean code - 512) / 4)`` over the ranks with data
       (a geometric mean of their ``s``; 0 if none had data), the same on every rank. Output
       ``S (2 V - c)``, divided by ``n`` under Average; NaN everywhere if some rank was not
       finite.
    6. ``finish``: ``e' = p - S sign(p)`` (``sign(0) = +1``), what this rank contributed
       taken off; when some rank was not finite the state stays as it was. The state keeps
       ``p`` and ``S`` (:class:`SignSGDState`), and the next step's encode forms ``e'`` from
       them as it reads them, the same float32 operations (``pending``): no pass over the
       coordinates of its own after the all-reduce.

Why agreed scales: the paper's scale is per worker, but a sum of integer signs can carry only
one per coordinate. The scales of this very step (from the codes in the payload) are used,
not the previous step's, so nothing is stale and nothing needs agreeing between steps.
Data-parallel ranks' ``s`` are close (the same model, batches from one distribution); where a
rank's ``s`` differs from ``S``, error feedback keeps the difference and sends it later, as it
does for the paper's own scale (its Theorem II holds for any compressor with
``||C(p) - p||**2 <= (1 - delta) ||p||**2``; this one is such a compressor while ``S < 2 s``).

Wire per tensor and step, in the one all-reduce: ``4 (ceil(P / lanes) + ceil(2 nb /
lanes_s) + 2)`` bytes of int32, ``lanes_s = (31 - g) // bit_length(1023 n)``. The signs take
``32 / lanes`` bits a coordinate (2.13 under Sum and 2.29 under Average at 2 ranks, 5.33
under Average at 8); the scales ``32 / (B lanes_s / 2)`` more (0.03 at ``B = 1024``, 2 ranks).
Integer payload: Horovod's prescale/postscale factors must stay 1 and the op must be Sum or
Average (the adapters refuse the rest, before any collective).

Kernels: steps 6 (of the last step) and 1-3, 4-5's small words, and 4-5 (with an engine's
``1 / n`` folded in, written into its bucket: :func:`~hvd_gradcomp.composite.decompress_into`)
are the kernels of :mod:`hvd_gradcomp.signsgd_kernels` (compositions of the primitives: the
reference), called through ``ops.fuse``, so a backend may run a fused form: PyTorch's CPU runs
one C loop each (``torch_backend/kernels/cpu_signsgd.py``), CUDA Triton programs
(``torch_backend/kernels/triton_signsgd.py``); both equal the reference bit for bit but for a
scale's log code where ``4 log2 s`` lies within float32 rounding of a half-integer (their block
sums add up in another order).

Errors: ValueError for a world size above 1024 (:data:`~hvd_gradcomp.lanes.MAX_WORLD_SIZE`),
at ``init``, before any collective. Measured: ``docs/signsgd.md``.
"""
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

from . import composite
from .base import EmptyState, Scheme, TensorInfo, WireBytes, commit
from .lanes import LaneLayout, lane_layout, stats_layout
from .options import error_feedback_option, option, validate
from .signsgd_kernels import CONTROL as _CONTROL, _Plan, _decode_kernel, _encode_kernel, _receive_kernel, pending

__all__ = ["SignSGDConfig", "SignSGDState", "SignSGDScheme"]


@dataclass(frozen=True)
class SignSGDConfig:
    """Options of :class:`SignSGDScheme` (:mod:`hvd_gradcomp.options`; ``python -m
    hvd_gradcomp --list`` lists them).

    Raises:
        ValueError: an option of the wrong kind or outside its range, e.g. ``"signsgd:
            error_feedback must be True or False, got 'maybe'"``.
    """

    SCHEME: ClassVar[str] = "signsgd"
    error_feedback: bool = error_feedback_option("keep g + e - S sign(g + e) for the next step "
                                                 "(EF-SignSGD); false: plain scaled signSGD")
    block: Optional[int] = option(1024, kind="integer", lo=1, optional=True,
                                  doc="coordinates that share one scale (the last block may be "
                                      "short); none: one scale for the whole tensor")

    def __post_init__(self):
        validate(self)


class SignSGDState(NamedTuple):
    """This rank's error feedback ``e = (p + S) - [p >= 0] (2 S)`` per block, kept as the ``p``
    and ``S`` of the last step that committed (zeros at first: ``e = 0``; ``S = 0``: ``e = p``),
    so that step 6 is computed by the next encode as it reads them (``pending``)."""

    corrected: object  # float32 [d]: p = g + e of the last committed step
    scale: object  # float32 [nb]: that step's agreed S per block


class Layout(NamedTuple):
    """Static sizes of one tensor's payload."""

    block: int  # B
    blocks: int  # nb = ceil(d / B)
    signs: LaneLayout  # 1-bit lanes
    words: int  # int32 words of signs: ceil(nb B / lanes)
    stats: LaneLayout  # lanes of the (code, has data) pairs
    stats_words: int  # ceil(2 nb / stats lanes)


class _SignCtx(NamedTuple):
    corrected: object  # float32 [P]: p = g + e, zero-padded
    count: object = None  # int64 []: contributing ranks c (receive)
    bad: object = None  # int64 []: ranks whose gradient was not finite
    scale: object = None  # float32 [nb]: the agreed S per block
    inferred: object = None  # bool []: the count word says Horovod applied Sum (op unknown)


class SignSGDScheme(Scheme):
    """EF-SignSGD with agreed per-block scales (module docstring, steps 1-6)."""

    name = "signsgd"
    rank_local_fields = ("corrected", "scale")  # e is both: a joined rank keeps both as they were
    residual_fields = ("corrected", "scale")
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    scalable = False  # integer payload: Horovod's scale factors would corrupt it
    # step 1's sum |p| sees every NaN/inf of g (and flags the rank in the payload): no separate
    # pass over g for the finite flag (base.compress_tensor)
    guards_nonfinite = False

    def __init__(self, config: SignSGDConfig = SignSGDConfig()):
        self.config = config

    def layout(self, info: TensorInfo) -> Layout:
        """The payload's sizes; ValueError for a world size above 1024."""
        n, d = info.world_size, max(info.numel, 1)
        block = min(self.config.block or d, d)
        blocks = -(-d // block)
        signs = lane_layout(1, n, None, info.op, scheme=self.name, centred=False)
        stats = stats_layout(n, signs.guard)
        return Layout(block, blocks, signs, -(-blocks * block // signs.lanes), stats,
                      -(-2 * blocks // stats.lanes))

    def init(self, ops, info: TensorInfo, like):
        lay = self.layout(info)  # ValueError now for a world size above 1024
        if not self.config.error_feedback:
            return EmptyState()
        return SignSGDState(ops.zeros((info.numel,), "float32", like), ops.zeros((lay.blocks,), "float32", like))

    def residual_of(self, ops, state, info):
        """The pending error feedback, float32 [numel] (:func:`~hvd_gradcomp.composite.residual_of`):
        step 6's residual of the kept ``p`` and ``S``; None without error feedback."""
        if not isinstance(state, SignSGDState):
            return None
        return pending(ops, self._plan(info, self.layout(info)), state.corrected, state.scale)

    def add_residual(self, ops, state, info, residual):
        """``state`` with ``residual`` (float32 [numel]) added to its error feedback: kept as
        ``p = e + residual`` with ``S = 0`` (whose residual is ``p`` itself)."""
        if not isinstance(state, SignSGDState):
            return None
        left = self.residual_of(ops, state, info) + ops.reshape(residual, (info.numel,))
        return SignSGDState(left, state.scale * 0.0)

    def check_loaded(self, key, loaded):
        """ValueError for a checkpoint's state of the format before the kept ``(corrected,
        scale)``: a field ``residual``, the error feedback itself."""
        if set(composite.loaded_fields(loaded)) == {"residual"}:
            raise ValueError(f"signsgd: the saved state of tensor {key!r} holds the residual e itself, the "
                             f"format before signSGD kept p and S (fields corrected, scale); resume it with "
                             f"the hvd_gradcomp that saved it, or drop its entry to start its error "
                             f"feedback afresh")

    def _plan(self, info: TensorInfo, lay: Layout) -> _Plan:
        return _Plan(lay.block, lay.signs, lay.stats, self.config.error_feedback, info.world_size, info.op)

    def compress(self, ops, x, state, info, finite):
        """Steps 1-3 (one kernel, ``_encode_kernel``: one fused call where the backend has one)."""
        plan = self._plan(info, self.layout(info))
        x = ops.reshape(x, (info.numel,))
        ef = self.config.error_feedback
        payload, corrected = ops.fuse(_encode_kernel, plan)(
            x, state.corrected if ef else x, state.scale if ef else x, finite)
        return payload, _SignCtx(corrected)

    def receive(self, ops, payload, ctx, info):
        """Step 4's control words and step 5's scales, read once for decompress and finish."""
        plan = self._plan(info, self.layout(info))
        count, bad, scale, inferred = ops.fuse(_receive_kernel, plan)(payload, ctx.corrected)
        return ctx._replace(count=count, bad=bad, scale=scale, inferred=inferred)

    def decompress(self, ops, payload, ctx, info):
        """Steps 4-5 (one kernel, ``_decode_kernel``)."""
        return self.decompress_into(ops, payload, ctx, info, 1.0, None)

    def decompress_into(self, ops, payload, ctx, info, factor, into):
        """Steps 4-5 times ``factor``, in the decode's own pass, written into ``into`` where the
        backend's fused form can (:func:`~hvd_gradcomp.composite.decompress_into`): an engine's
        mean lands in its bucket with no multiply or copy after it."""
        plan = self._plan(info, self.layout(info))._replace(factor=factor)
        out = ops.fuse(_decode_kernel, plan)(payload, ctx.count, ctx.bad, ctx.scale, ctx.inferred, into)
        return out[:info.numel] if ops.shape(out)[0] > info.numel else out

    def finish(self, ops, payload, ctx, state, info):
        """Step 6: the state keeps this step's ``p`` and agreed ``S`` (the next encode forms
        ``e' = p - S sign(p)`` from them), only when every rank was finite."""
        if not self.config.error_feedback:
            return state
        corrected = ctx.corrected[:info.numel] if ops.shape(ctx.corrected)[0] > info.numel else ctx.corrected
        return commit(ops, ctx.bad == 0, SignSGDState(corrected, ctx.scale), state)

    def payload_dtype(self, info: TensorInfo) -> str:
        return "int32"

    def scatter_split(self, info: TensorInfo) -> int:
        """The sign words are the values; the scales' (code, flag) lanes and the control words
        (exact int32 sums) are the agreed part, all that steps 4-6 read besides the ctx
        (:func:`~hvd_gradcomp.composite.scatter_split`)."""
        return self.layout(info).words

    def wire(self, info: TensorInfo) -> WireBytes:
        lay = self.layout(info)
        return WireBytes(4 * (lay.words + lay.stats_words + _CONTROL))
