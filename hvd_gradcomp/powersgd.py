"""PowerSGD: rank-r compression with error feedback, one all-reduce per tensor per step.

A gradient is viewed as a matrix ``M`` (``n x m``, output channels as rows: :func:`matrix_view`);
the scheme accepts (:meth:`PowerSGDScheme.accepts`) only the matrices rank ``r`` shrinks by
``min_compression_rate``; the routing sends the others (vectors, scalars, small matrices)
uncompressed: float16 pre-scaled (``fp16``), or as float32 (``none:dtype=float32``) with
``uncompressed_dtype=float32``. ``variant="alternating"`` (default; ACP-SGD, Zhang, Shi,
Li et al., ICDCS 2023) sends ``M_i Q^`` on even steps and ``M_i^T P^`` on odd ones, projected on
the previous step's shared orthonormal basis, in one non-blocking all-reduce of
``r max(n, m) + 6`` floats that also carries parity and basis fingerprints: ranks that disagree
(a checkpoint loaded on one rank, a rank back from ``hvd.join()``) get 0 and realign.
``error_feedback="ef21"`` (alternating only; Richtarik et al., NeurIPS 2021) compresses
``G_i - h_i`` and delivers the agreed estimate ``H``. ``variant="two_round"`` (Vogels et al.,
Algorithm 1) is ``blocking``: a side all-reduce of ``P`` inside ``compress``, then ``Q``.
A non-finite payload leaves the state as it was on every rank. The numbered steps of the
code's comments, the wire bytes and the state format: docs/powersgd.md.

Reference: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (https://github.com/epfml/powersgd).
"""
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from . import composite
from .base import Scheme, TensorInfo, WireBytes, commit, payload_finite, poison
from .options import error_feedback_option, option, seed_option, validate, wire_dtype_option
from .lowrank import matrix_view, minus_outer, outer, pad, times_left, times_right, transposed
from .orthogonalize import DEPENDENT_TOL, basis_rows, orthogonalize
from .rng import normal, step_key, stream_key, uniform

__all__ = ["PowerSGDConfig", "PowerSGDState", "PowerSGDEF21State", "PowerSGDScheme", "STATE_VERSION", "CONTROL",
           "matrix_view", "agree_tolerance"]

# Format of PowerSGDState; 1 was (residual, q, step) with TensorFlow kernels as h x (w in out).
STATE_VERSION = 2
# Control values at the end of the alternating payload (step 5).
CONTROL = 6
# Smallest column norm treated as non-zero when the two-round Q is normalised; below it
# (an all-zero gradient, or entries under ~1e-35 after the max-abs scaling) the old column stays.
_TINY = 1e-30
_VARIANTS = ("alternating", "two_round")


@dataclass(frozen=True)
class PowerSGDConfig:
    """Options of :class:`PowerSGDScheme`, each declared once below (kind, range, default,
    which way compresses harder, doc: :mod:`hvd_gradcomp.options`; ``python -m hvd_gradcomp
    --list`` lists them).

    Tuning ``rank`` (Vogels et al.): start at rank 1 with error feedback and warm start; double
    it while the loss trails the FP16 run's; 1 to 4 suits most vision models, language models
    may need up to 32 (bytes per matrix: docs/powersgd.md). Without ``error_feedback``
    PowerSGD is biased and usually trains worse. ``start_step > 0`` and ``warm_start=False``
    need ``variant="two_round"`` (docs/powersgd.md). ``uncompressed_dtype``: how the routing
    sends the tensors the scheme does not accept: float16 pre-scaled by 1/world_size (``fp16``),
    or float32 (``none:dtype=float32``: float16/bfloat16 gradients are cast). Every rank: the same ``seed``.

    Raises:
        ValueError: an option of the wrong kind or outside its range (one wording for every
            scheme), e.g. "powersgd: rank must be an integer >= 1, got 0", or a combination
            the variant cannot do.
    """

    SCHEME: ClassVar[str] = "powersgd"
    PRIMARY: ClassVar[str] = "rank"  # the option a bare first value sets ("powersgd:VALUE")
    rank: int = option(1, kind="integer", lo=1, harder="down",
                       doc="rank r of the low-rank approximation")
    min_compression_rate: float = option(2.0, kind="number", lo=1.0, harder="down",
                                         doc="a matrix is compressed only if n m >= rate * r (n + m); "
                                             "larger sends more matrices uncompressed")
    start_step: int = option(0, kind="integer", lo=0, harder="down",
                             doc="initial steps sent uncompressed (warm-up; two_round only)")
    error_feedback: object = error_feedback_option(
        "keep what the approximation misses and add it next step (ef21: approximate the change "
        "of a running estimate; the output is dense; alternating only)", variants=("ef21",))
    warm_start: bool = option(True, kind="boolean",
                              doc="reuse last step's factor (false: a fresh random Q each step; "
                                  "two_round only)")
    seed: int = seed_option("key of the shared generator for the random start; equal on all "
                            "ranks")
    uncompressed_dtype: str = wire_dtype_option("dtype of the vectors and matrices sent "
                                                "uncompressed")
    variant: str = option("alternating", kind="choice", choices=_VARIANTS, harder="alternating",
                          doc="P and Q on alternate steps, one all-reduce (alternating) or the "
                              "original: a blocking P side all-reduce, then Q (two_round)")

    def __post_init__(self):
        validate(self)
        if self.error_feedback == "ef21" and self.variant != "alternating":
            raise ValueError(
                "powersgd: error_feedback='ef21' needs variant='alternating': EF21's estimate is "
                "agreed between the ranks and must realign when a rank's state differs (after "
                "hvd.join(), a checkpoint loaded on one rank), which the alternating variant "
                "detects in its payload and the two-round variant does not")
        if self.variant == "alternating":
            if self.start_step:
                raise ValueError(
                    f"powersgd: start_step={self.start_step} needs variant='two_round': the "
                    f"alternating variant's payload has a fixed size of rank * max(n, m) + "
                    f"{CONTROL} floats, too small for an uncompressed warm-up step, which would "
                    f"need a blocking side collective inside compress")
            if not self.warm_start:
                raise ValueError(
                    "powersgd: warm_start=False needs variant='two_round': the alternating "
                    "variant's projection basis is the previous step's all-reduced factor")


class PowerSGDState(NamedTuple):
    # float32 E in the tensor's plain 2-D reshape ([n, m]; TF ndim >= 3: [m, n]); [0] without EF
    residual: object
    # float32 [r, n]: P^ transposed, orthonormal rows (alternating; 0 after a realignment); [0] two-round
    p: object
    q: object  # float32 [r, m]: Q^ transposed (alternating: orthonormal rows; two-round: unit rows)
    # int64 []: steps since the start or the last realignment; its parity says which factor travels
    step: object
    fill: object  # float32 [r, K]: U (step 3), the same on every rank (alternating; [0] two-round)
    realigned: object  # int64 []: steps whose ranks disagreed (step 8), output 0 (diagnostic)
    version: object  # int64 []: STATE_VERSION


class PowerSGDEF21State(NamedTuple):
    """``error_feedback="ef21"`` (alternating only): ``residual`` gives way to ``local`` (h_i) and
    ``estimate`` (H), both float32 in the plain 2-D layout; the rest as :class:`PowerSGDState`."""
    local: object  # h_i, this rank's running estimate of its gradient (rank-local)
    estimate: object  # H: the all-reduced estimate (sum or mean of the h_i), the output
    p: object
    q: object
    step: object
    fill: object
    realigned: object
    version: object


class _AltCtx(NamedTuple):
    even: object  # bool []: P travels (the state's step is even)
    matrix: object  # M_i in the plain layout (None without error feedback)
    local: object  # float32 [r, K]: this rank's travelling factor, transposed, zero-padded
    p: object  # the state's P^ [r, n]
    q: object  # the state's Q^ [r, m]
    # Set by receive (step 8), from the all-reduced payload:
    keep: object = None  # float32 []: 1.0 if the ranks agreed (or the payload is NaN), else 0.0
    ok: object = None  # bool []: the all-reduced payload is finite
    estimate: object = None  # EF21: the state's H
    new: object = None  # EF21: H' = (H + the decoded aggregate) * keep, set by receive


class _TwoCtx(NamedTuple):
    warm: object  # None (start_step = 0) or bool []: this is a warm-up step
    p: object  # float32 [r, n]: P^ transposed ([1, 1] placeholder during warm-up)
    full: object  # None or the summed matrix of a warm-up step ([1, 1] placeholder otherwise)
    residual: object  # the residual candidate (None without error feedback)
    ok: object = None  # bool []: the all-reduced payload is finite (set by receive)


def agree_tolerance(world_size: int) -> float:
    """Step 8's relative tolerance on the fingerprints' ``S2 c - S1^2`` (float32 rounding of the
    ranks' sums), shared by :func:`_agree_kernel` and its fused forms."""
    return (8 * world_size + 16) * 2.0 ** -24


def _agree_kernel(ops, world_size, payload):
    """Step 8 as a kernel (``ops.fuse(_agree_kernel, world_size)``; the CPU's fused form is one
    C call, ``torch_backend/kernels/cpu_powersgd.py``): ``(keep float32 0-d, ok bool 0-d)`` from
    the all-reduced alternating payload (its last :data:`CONTROL` values: parities and basis
    fingerprints). ``keep`` is 1.0 where the ranks agreed (or a value is NaN: the NaN reaches the
    output anyway), else 0.0; ``ok``: the payload is finite (:func:`payload_finite`)."""
    c = payload[ops.shape(payload)[0] - CONTROL:]
    ce, co = c[0], c[1]
    s1, s2 = c[2::2], c[3::2]  # (S1, S2) of each fingerprint
    tol = agree_tolerance(world_size)
    # > 0 where the ranks differ: parities (c_e c_o), fingerprints (S2 c (1 - tol) - S1^2).
    spread = s2 * ((ce + co) * (1.0 - tol)) - s1 * s1
    bad = ops.max(ops.concat([ops.reshape(ce * co, (1,)), spread], 0), None) > 0.0
    return 1.0 - ops.cast(bad, "float32"), payload_finite(ops, payload)


class PowerSGDScheme(Scheme):
    """Rank-r PowerSGD with error feedback and warm start (module docstring; steps: docs/powersgd.md)."""

    name = "powersgd"

    def __init__(self, config: PowerSGDConfig = PowerSGDConfig()):
        self.config = config
        self.ef21 = config.error_feedback == "ef21"
        # Classic: the residual; EF21: h_i and H together (a checkpoint loaded on another
        # number of ranks restarts both at 0, which keeps H the sum/mean of the h_i).
        self.rank_local_fields = ("local", "estimate") if self.ef21 else ("residual",)
        self.blocking = config.variant == "two_round"
        # Where the routing sends the tensors accepts() refuses (hvd_gradcomp.routing).
        self.fallback_spec = "fp16" if config.uncompressed_dtype == "float16" else "none:dtype=float32"
        # ops.name of the backend this scheme last ran with (for wire(), which gets no ops).
        self._layout = None
        self._fingerprint_weights = {}  # tensor key -> (the state's fill, its weights): _weights
        # group key -> the BatchedPowerSGD of a bucket's matrices of one view sent by this scheme
        # (hvd_gradcomp.powersgd_batched; made by the codec's plan_bucket)
        self.batches = {}
        self.batch_clock = 0  # batch steps so far (which batch held a matrix last: _batch_row)

    def bind(self, ops):
        """Remember the backend's kernel layout (``ops.name``) for :meth:`wire`, which gets no
        ops. The adapters should call it when the compressor is created; init/compress/finish
        also record it."""
        self._layout = ops.name
        return self

    # ---- Step 1: the static policy ----
    def matrix_shape(self, info: TensorInfo, layout: str = "torch"):
        """``(n, m)`` if this tensor is compressed under ``layout`` (``ops.name``), else None."""
        v = self._shrinks(info, layout)
        return None if v is None else (v.n, v.m)

    def accepts(self, info: TensorInfo) -> bool:
        """True for a tensor of ndim >= 2 whose matrix view ``n x m`` (under the bound layout,
        :meth:`bind`; default PyTorch's) rank r shrinks: ``r (n + m) min_compression_rate <=
        n m``. The routing sends the others to :attr:`fallback_spec`."""
        return self._shrinks(info, self._layout or "torch") is not None

    def _shrinks(self, info: TensorInfo, layout: str):
        """The matrix view of ``info`` under ``layout`` if rank r shrinks it, else None."""
        if len(info.shape) < 2 or info.numel == 0:
            return None
        v = matrix_view(info.shape, layout)
        r = self.config.rank
        if r * (v.n + v.m) * self.config.min_compression_rate > v.n * v.m:
            return None
        return v

    def _view(self, info: TensorInfo, layout: str):
        """The matrix view; ValueError for a tensor :meth:`accepts` refuses under ``layout``."""
        v = self._shrinks(info, layout)
        if v is None:
            raise ValueError(f"{self.spec()}: tensor {info.key!r} ({info.dtype}{list(info.shape)}) is "
                             f"not a matrix rank {self.config.rank} shrinks (accepts() is False); "
                             f"route it to {self.fallback_spec}, as the compressors' routing does")
        return v

    def _view_of(self, ops, info):
        self._layout = ops.name
        return self._view(info, ops.name)

    # ---- shared randomness ----
    def _key(self, info):
        return stream_key("powersgd", self.config.seed, info.key)

    def _fill(self, ops, info, width, like):
        """U: float32 [r, width], uniform in [-1, 1), keyed by (seed, tensor key)."""
        r = self.config.rank
        return ops.reshape(uniform(ops, self._key(info), r * width, like), (r, width)) * 2.0 - 1.0

    def _random_q(self, ops, info, m, like, step=None):
        """Two-round: float32 [r, m] approximately normal, keyed by (seed, key[, step])."""
        r, key = self.config.rank, self._key(info)
        if step is not None:
            key = step_key(ops, key, step)
        return ops.reshape(normal(ops, key, r * m, like), (r, m))

    # ---- init ----
    def init(self, ops, info: TensorInfo, like):
        v = self._view_of(ops, info)
        cfg, r = self.config, self.config.rank
        zero = ops.zeros((), "int64", like)
        residual = ops.zeros(v.natural if cfg.error_feedback else (0,), "float32", like)
        version = zero + STATE_VERSION
        if cfg.variant == "two_round":
            empty = ops.zeros((0,), "float32", like)
            return PowerSGDState(residual, empty, self._random_q(ops, info, v.m, like), zero, empty, zero,
                                 version)
        held = None if self.ef21 else self._batch_row(info)
        if held is not None:  # a matrix leaving a batch (a rebuilt bucket): its factors as they were
            p, q, step, fill = held
            return PowerSGDState(residual, p, q, step, fill, zero, version)
        fill = self._fill(ops, info, max(v.n, v.m), like)
        q = transposed(ops, orthogonalize(ops, transposed(ops, fill[:, :v.m])))
        if self.ef21:
            return PowerSGDEF21State(residual, ops.zeros(v.natural, "float32", like),
                                     ops.zeros((r, v.n), "float32", like), q, zero, fill, zero, version)
        return PowerSGDState(residual, ops.zeros((r, v.n), "float32", like), q, zero, fill, zero, version)

    def _batch_row(self, info):
        """``(p, q, step, fill)`` of ``info``'s tensor in the batch of this scheme that stepped
        it last (:meth:`~hvd_gradcomp.powersgd_batched.BatchedPowerSGD.row`), or None."""
        held = [b for b in self.batches.values() if info.key in b.keys and b.stepped]
        for batch in sorted(held, key=lambda b: -b.stepped):
            row = batch.row(info.key)
            if row is not None:
                return row
        return None

    # ---- compress ----
    def compress(self, ops, x, state, info, finite):
        v = self._view_of(ops, info)
        matrix = ops.reshape(x, v.natural)
        if self.ef21:  # EF21: approximate g_i - h_i
            matrix = matrix - state.local
        elif self.config.error_feedback:
            matrix = matrix + state.residual
        if self.config.variant == "two_round":
            return self._two_round_compress(ops, matrix, state, info, finite, v)
        return self._alternating_compress(ops, matrix, state, info, finite, v)

    # Steps 2-6 (alternating).
    def _alternating_compress(self, ops, matrix, state, info, finite, v):
        r, width = self.config.rank, max(v.n, v.m)
        even = ops.bitwise_and(state.step, 1) < 1
        # Step 4: P_i^T = (M Q^)^T or Q_i^T = P^^T M, as the parity says (ops.select: only the
        # one needed is formed where the backend reads the parity for free), and step 5's
        # shared basis.
        local, shared = ops.select(
            even, lambda: (pad(ops, times_right(ops, matrix, state.q, v), width), pad(ops, state.q, width)),
            lambda: (pad(ops, times_left(ops, matrix, state.p, v), width), pad(ops, state.p, width)))
        # Step 5: fingerprints of this step's basis.
        f = ops.matmul(self._weights(ops, info, state.fill, r * width), ops.reshape(shared, (r * width, 1)))  # [f1, f2]
        e = ops.reshape(ops.cast(even, "float32"), (1,))
        control = ops.concat([e, 1.0 - e, ops.reshape(ops.concat([f, f * f], 1), (4,))], 0)
        # Step 6.
        payload = poison(ops, ops.concat([ops.reshape(local, (r * width,)), control], 0), finite)
        ctx = _AltCtx(even, matrix if self.config.error_feedback is True else None, local, state.p, state.q,
                      estimate=state.estimate if self.ef21 else None)
        return payload, ctx

    def _weights(self, ops, info, fill, size):
        """Step 5's fingerprint weights, float32 [2, r K]: U and U^2 - 1/3, rows of the state's
        fill. Kept per tensor while the state holds the same fill tensor (a constant of the
        state: built once, not each step), when running eagerly; a backend whose state reads
        give new tensors each step (TensorFlow's) builds them each step, as before."""
        kept = self._fingerprint_weights.get(info.key)
        if kept is not None and kept[0] is fill:
            return kept[1]
        weights = ops.reshape(ops.concat([fill, fill * fill - 1.0 / 3.0], 0), (2, size))
        if ops.eager():  # (a traced graph's tensors are not kept past it)
            self._fingerprint_weights[info.key] = (fill, weights)
        return weights

    # Step 8 (alternating), once per step for decompress and finish.
    def receive(self, ops, payload, ctx, info):
        """``ctx`` with ``ok`` (the payload is finite) and, alternating, ``keep`` (float32 []:
        1.0 if the ranks agreed, else 0.0; 1.0 for a non-finite payload, whose NaN reaches the
        output anyway), read from the all-reduced payload: the same on every rank."""
        if isinstance(ctx, _TwoCtx):
            return ctx._replace(ok=payload_finite(ops, payload))
        v = self._view_of(ops, info)
        keep, ok = ops.fuse(_agree_kernel, info.world_size)(payload)
        ctx = ctx._replace(keep=keep, ok=ok)
        if self.ef21:  # H' once, for decompress (the output) and finish (the state)
            r, width = self.config.rank, max(v.n, v.m)
            agg = ops.reshape(payload[:r * width], (r, width))
            a, b = ops.select(ctx.even, lambda: (agg[:, :v.n], ctx.q), lambda: (ctx.p, agg[:, :v.m]))
            ctx = ctx._replace(new=(ctx.estimate + outer(ops, a, b, v)) * ctx.keep)
        return ctx

    # ---- decompress ----
    def decompress(self, ops, payload, ctx, info):
        """float32 in the tensor's plain 2-D layout (finish_tensor reshapes): step 9."""
        v = self._view_of(ops, info)
        r = self.config.rank
        if self.config.variant == "two_round":
            q_t = ops.reshape(payload, (r, v.m))
            if ctx.warm is None:
                return outer(ops, ctx.p, q_t, v)
            return ops.cond(ctx.warm, lambda: ctx.full * payload[0], lambda: outer(ops, ctx.p, q_t, v))
        if self.ef21:  # H' (receive): H + the decoded aggregate, 0 on disagreement (NaN stays
            return ctx.new * 1.0  # NaN); a copy, so that the output never aliases the state's H
        agg = ops.reshape(payload[:r * max(v.n, v.m)], (r, max(v.n, v.m)))
        a, b = ops.select(ctx.even, lambda: (agg[:, :v.n], ctx.q), lambda: (ctx.p, agg[:, :v.m]))
        return outer(ops, a * ctx.keep, b, v)  # NaN * 0 stays NaN

    # ---- finish ----
    def finish(self, ops, payload, ctx, state, info):
        """The state after the step (step 10; two-round: step 6); unchanged if the payload
        is not finite."""
        v = self._view_of(ops, info)
        if self.config.variant == "two_round":
            return commit(ops, ctx.ok, self._two_round_finish(ops, payload, ctx, state, v), state)
        r, width = self.config.rank, max(v.n, v.m)
        agreed = ctx.keep > 0.5
        agg = ops.reshape(payload[:r * width], (r, width))

        rows = ops.fuse(basis_rows, DEPENDENT_TOL)  # one fused call where the backend has one

        def to_p():  # the n-side factor arrived: P^ := basis(P_agg), Q^ stays
            return rows(agg[:, :v.n], state.fill[:, :v.n]), state.q

        def to_q():  # the m-side factor arrived, or the ranks disagreed (then P^ := 0)
            return state.p * ctx.keep, rows(agg[:, :v.m], state.fill[:, :v.m])

        p, q = ops.select(ops.logical_and(ctx.even, agreed), to_p, to_q)
        step = ops.where(agreed, state.step + 1, state.step * 0)
        realigned = state.realigned + (1 - ops.cast(agreed, "int64"))
        if self.ef21:
            # h_i += this rank's decoded contribution, H += the decoded aggregate; both restart
            # at 0 on disagreement (keep = 0), the same on every rank.
            local_p, local_q = ops.select(ctx.even, lambda: (ctx.local[:, :v.n], state.q),
                                          lambda: (state.p, ctx.local[:, :v.m]))
            local = (state.local + outer(ops, local_p, local_q, v)) * ctx.keep
            new = PowerSGDEF21State(local, ctx.new, p, q, step, state.fill, realigned, state.version)
            return commit(ops, ctx.ok, new, state)
        residual = state.residual
        if self.config.error_feedback:
            # This rank's own decoded contribution; none after a disagreement (E' = M).
            local_p, local_q = ops.select(ctx.even, lambda: (ctx.local[:, :v.n], state.q),
                                          lambda: (state.p, ctx.local[:, :v.m]))
            residual = minus_outer(ops, ctx.matrix, local_p * ctx.keep, local_q, v)
        new = PowerSGDState(residual, p, q, step, state.fill, realigned, state.version)
        return commit(ops, ctx.ok, new, state)

    # ---- two-round ----
    def _side_name(self, what, info):
        return f"hvd_gradcomp.powersgd.{what}.{info.key}"

    def _two_round_compress(self, ops, matrix, state, info, finite, v):
        cfg = self.config
        if cfg.start_step == 0:
            payload, p, residual = self._power_step(ops, matrix, state, info, finite, v)
            return payload, _TwoCtx(None, p, None, residual)
        # Both branches give (payload, P^T, summed matrix, residual); the one a branch does not
        # compute is a [1, 1] placeholder (TensorFlow relaxes that output's static shape).
        warm = state.step < cfg.start_step

        def compressed():
            payload, p, residual = self._power_step(ops, matrix, state, info, finite, v)
            return payload, p, ops.zeros((1, 1), "float32", matrix), self._or_placeholder(ops, residual, matrix)

        def warm_up():
            payload, p, full, residual = self._warmup_step(ops, matrix, state, info, finite, v)
            return payload, p, full, self._or_placeholder(ops, residual, matrix)

        payload, p, full, residual = ops.cond(warm, warm_up, compressed)
        return payload, _TwoCtx(warm, p, full, residual if cfg.error_feedback else None)

    @staticmethod
    def _or_placeholder(ops, residual, like):
        return ops.zeros((1, 1), "float32", like) if residual is None else residual

    def _power_step(self, ops, matrix, state, info, finite, v):
        """Two-round steps 3-5: (payload float32 [r m], P^ transposed [r, n], residual or None)."""
        cfg = self.config
        q_t = state.q if cfg.warm_start else self._random_q(ops, info, v.m, matrix, state.step)
        p_t = times_right(ops, matrix, q_t, v)
        # Every rank must issue this, with this name, in the same order (blocking). Sent flat:
        # a reshape is a contiguous copy of a transposed view (Horovod refuses strided tensors).
        flat = ops.allreduce(ops.reshape(p_t, (cfg.rank * v.n,)), "sum", self._side_name("p", info), info.group)
        p_t = ops.reshape(flat, (cfg.rank, v.n))
        p_t = transposed(ops, orthogonalize(ops, transposed(ops, p_t)))
        q_local_t = times_left(ops, matrix, p_t, v)
        payload = poison(ops, ops.reshape(q_local_t, (cfg.rank * v.m,)), finite)
        residual = minus_outer(ops, matrix, p_t, q_local_t, v) if cfg.error_feedback else None
        return payload, p_t, residual

    def _warmup_step(self, ops, matrix, state, info, finite, v):
        """Two-round warm-up: (marker payload, [1, 1] placeholder, summed matrix, zero residual)."""
        r, size = self.config.rank, info.world_size
        half = ops.cast(matrix * (1.0 / size), "float16")  # nothing is fed back: inf, not clipped
        half = ops.allreduce(half, "sum", self._side_name("full", info), info.group)
        summed = ops.cast(half, "float32") * float(size)
        # 1/size in every coordinate; Horovod's Sum makes it 1, Average 1/size.
        marker = poison(ops, ops.zeros((r * v.m,), "float32", matrix) + 1.0 / size, finite)
        residual = ops.zeros(v.natural, "float32", matrix) if self.config.error_feedback else None
        return marker, ops.zeros((1, 1), "float32", matrix), summed, residual

    def _two_round_finish(self, ops, payload, ctx, state, v):
        new = state._replace(step=state.step + 1)
        if ctx.residual is not None:
            new = new._replace(residual=ctx.residual)
        if not self.config.warm_start:
            return new
        r = self.config.rank
        agg = ops.reshape(payload, (r, v.m))  # row j = column j of Q
        # Scale rows by 1/max|row| first so the squares neither under- nor overflow.
        top = ops.maximum(ops.max(ops.abs(agg), 1), _TINY)
        agg = agg * ops.reshape(1.0 / top, (r, 1))
        norms = ops.reshape(ops.sqrt(ops.sum(agg * agg, 1)), (r, 1))
        usable = ops.logical_and(ops.isfinite(norms), norms > _TINY)
        q_t = ops.where(usable, agg * (1.0 / ops.maximum(norms, _TINY)), state.q)
        if ctx.warm is not None:
            q_t = ops.where(ctx.warm, state.q, q_t)
        return new._replace(q=q_t)

    def hand_over(self, ops, state, own, aggregate, info):
        """After an FP16 warm-up (:mod:`hvd_gradcomp.warmup`): EF21 starts from ``h_i = own``
        and ``H = aggregate`` (plain 2-D layout); otherwise the state is kept (the basis
        starts from U, classic error feedback from 0)."""
        if not self.ef21 or not isinstance(state, PowerSGDEF21State):
            return state
        shape = ops.shape(state.local)
        return state._replace(local=ops.reshape(own, shape), estimate=ops.reshape(aggregate, shape))

    def residual_of(self, ops, state, info):
        """Classic error feedback's residual; EF21 keeps none (H is the estimate itself)."""
        return None if self.ef21 else composite.residual_field(self, ops, state, info)

    # ---- reporting and checkpoints ----
    def wire(self, info: TensorInfo, layout: str = None) -> WireBytes:
        """Bytes per step (after warm-up) under ``layout`` (``ops.name``; default: the backend
        this scheme last ran with, else ``"torch"``); docs/powersgd.md, step 1."""
        v = self._view(info, layout or self._layout or "torch")
        r = self.config.rank
        if self.config.variant == "two_round":
            return WireBytes(4 * r * v.m, 4 * r * v.n, 1)
        return WireBytes(4 * (r * max(v.n, v.m) + CONTROL))

    def metrics(self, state) -> dict:
        """``realigned``: steps of this tensor whose ranks disagreed (output 0; step 8)."""
        return {"realigned": state.realigned} if isinstance(state, (PowerSGDState, PowerSGDEF21State)) else {}

    def check_loaded(self, key, loaded):
        """Raise ValueError naming the change if ``loaded`` (a tensor's state read from a
        checkpoint: a NamedTuple-like with ``_fields``, or a dict) predates this format.

        The adapters' generic checks (fields, shapes) refuse such a state too; this gives the
        reason. Call it before them.
        """
        values = composite.loaded_fields(loaded)
        fields = tuple(values)
        if "version" not in fields:
            if set(fields) == {"residual", "q", "step"}:
                raise ValueError(
                    f"powersgd: the saved state of tensor {key!r} is PowerSGD state format 1 "
                    f"(fields residual, q, step), written by an earlier hvd_gradcomp. Format "
                    f"{STATE_VERSION} views TensorFlow kernels (h, w, in, out) as out x (h w in) "
                    f"instead of h x (w in out), keeps orthonormal factors P and Q and alternates "
                    f"which one travels (variant='alternating'); the old state cannot be "
                    f"converted. Start this compressor afresh (do not load its state_dict; the "
                    f"model and optimizer checkpoints are unaffected)")
            return
        try:
            version = int(values["version"])
        except (TypeError, ValueError):
            version = None
        if version != STATE_VERSION:
            raise ValueError(f"powersgd: the saved state of tensor {key!r} is PowerSGD state "
                             f"format {version}; this hvd_gradcomp reads format {STATE_VERSION} "
                             f"only. Start this compressor afresh (do not load its state_dict)")
