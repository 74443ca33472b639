"""PowerSGD: rank-r compression by one step of subspace iteration, with error feedback.

Steps, per gradient tensor and step:
    1. Policy (static, from the shape only): the gradient is viewed as a matrix of
       ``n = shape[0]`` rows and ``m = prod(shape[1:])`` columns (conv kernels included). It is
       compressed only if it has >= 2 dimensions, is not empty, and
       ``rank * (n + m) * min_compression_rate <= n * m``. Every other tensor (vectors, scalars,
       small or square-ish matrices) is sent uncompressed: float16 pre-scaled by
       1/world_size (:class:`~hvd_gradcomp.cast.Fp16Scheme`), or float32 as it is.
       Conv kernels follow their framework's layout: PyTorch's (out, in, h, w) becomes
       out x (in h w); TensorFlow's (h, w, in, out) becomes h x (w in out), a matrix with few
       rows, which rank r captures less of.
    2. Error feedback: ``M = G + E`` (float32 [n, m]; E = 0 without error feedback).
    3. Q (float32 [m, r], kept transposed as ``[r, m]``): with ``warm_start`` the state's Q
       (the previous step's aggregated Q, unit columns); otherwise a fresh one each step. The
       first Q (and every fresh one) comes from :func:`hvd_gradcomp.rng.normal`, keyed by
       ``(seed, tensor key)`` (and the step counter without warm start): identical on every
       rank, the framework's global RNG untouched.
    4. ``P = M Q`` (float32 [n, r]).
    5. Side collective: all-reduce (Sum) of P, named ``hvd_gradcomp.powersgd.p.<key>``, so
       every rank holds ``sum_i M_i Q`` (Q is the same on all ranks). Sum rather than mean:
       step 6 does not depend on the scale.
    6. Orthonormalise P (:func:`~hvd_gradcomp.orthogonalize.orthogonalize`): zero and
       dependent columns become exact zeros, never NaN.
    7. ``Q_i = M^T P``; the payload is ``Q_i^T`` flattened, float32 [r * m], made all NaN if
       the gradient holds a NaN/inf (:func:`~hvd_gradcomp.base.poison`).
    8. Residual ``E' = M - P Q_i^T``: each rank keeps what its *local* decompression misses,
       before aggregation, as in Vogels et al. (Algorithm 1 with the error feedback of their
       Algorithm 2) and their reference code (epfml/powersgd). (PyTorch DDP's
       ``powerSGD_hook`` instead subtracts the aggregated ``P Q^T``.) If the all-reduced P is
       not finite, some rank had a NaN/inf: the step is lost on every rank, so each keeps
       its old residual (the adapter masks the rank that had it; this covers the others).
    9. Horovod all-reduces the payload with Sum or Average.
    10. Decompress: ``P Q_agg^T`` in the gradient's shape. It is linear in the payload, so
        it is ``sum_i P Q_i^T`` under Sum and their mean under Average, without knowing which.
    11. Absorb (after the all-reduce, see :meth:`Scheme.absorb`): with warm start the state's
        Q becomes the aggregated Q with each column scaled to unit length. Only Q's columns'
        directions matter for the next ``P = M Q`` (P is orthonormalised anyway), and the
        scale removes the Sum/Average factor and the gradient's size, so P neither grows nor
        shrinks over the steps. A zero or non-finite column (an all-zero gradient, a skipped
        NaN step) keeps the previous Q column, so Q is never poisoned. The step counter
        (int64) advances on every call, identically on every rank.

Warm-up (``start_step > 0``): while the step counter is below ``start_step`` the tensor is
sent uncompressed. Horovod all-reduces one payload per tensor, whose shape cannot change
between steps in TensorFlow (compress is traced once) and which must stay the r*m floats of
Q after warm-up for the bytes to be honest; the uncompressed matrix (n*m values) does not fit
in it. So the step chooses between two branches with :func:`Primitives.cond` (``tf.cond``;
in PyTorch a Python branch on the step's value), and only the chosen branch's collectives run:
    W1. the full matrix ``M`` goes through a *side* all-reduce (Sum), float16 pre-scaled by
        1/world_size, named ``hvd_gradcomp.powersgd.full.<key>``; the residual becomes zero
        (M is sent whole; its fp16 rounding is not fed back, as in the fp16 baseline);
    W2. the Q-shaped payload carries the constant 1/world_size in each coordinate: after
        Horovod's Sum it reads 1, after Average 1/world_size, and decompress multiplies the
        summed matrix by it, so warm-up steps also give the sum or the mean as Horovod asked.
    Trade-off: a warm-up step costs ``2 n m + 4 r m`` bytes in two collectives instead of
    ``2 n m`` in one; after warm-up nothing extra is sent. PyTorch reads the step counter on
    the host at each compress and decompress (a device sync on GPU) for the whole run when
    ``start_step > 0``; with ``start_step = 0`` (the default) the choice is static and no
    conditional exists. Q, P and the residual are untouched during warm-up.

Wire, per compressed tensor and step: payload ``4 r m`` bytes (Q, float32), one side
collective of ``4 n r`` bytes (P, float32). Uncompressed tensors: ``2 d`` bytes (float16) or
``4 d`` (float32), no side collective. :meth:`PowerSGDScheme.wire` reports the bytes after
warm-up.

State (per tensor, :class:`PowerSGDState`): residual, Q and the step counter; saved and
restored by the adapters' ``state_dict()`` / ``load_state_dict()``.

Reference: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (https://github.com/epfml/powersgd).
"""
from dataclasses import dataclass
from typing import NamedTuple

from .base import Scheme, TensorInfo, WireBytes, poison
from .cast import Fp16Scheme
from .orthogonalize import orthogonalize
from .rng import normal, step_key, stream_key

__all__ = ["PowerSGDConfig", "PowerSGDState", "PowerSGDScheme"]

# Smallest column norm treated as non-zero when Q is normalised in absorb (step 11); below it
# (an all-zero gradient, or entries under ~1e-35 after the max-abs scaling) the old column stays.
_TINY = 1e-30
# The fp16 baseline (stateless): uncompressed tensors and warm-up steps go through it.
_FP16 = Fp16Scheme()


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"powersgd: {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class PowerSGDConfig:
    """Options of :class:`PowerSGDScheme`.

    Attributes:
        rank: r, the rank of the approximation, an integer >= 1; default 1. Smaller
            compresses harder (bytes per matrix are 4 r (n + m)). Tuning (Vogels et al.):
            start at rank 1 with error feedback and warm start; double it while the loss
            trails the FP16 run's; 1 to 4 suits most vision models, language models may need
            up to 32.
        min_compression_rate: a matrix is compressed only if ``n m >= rate * r (n + m)``; a
            number >= 1, default 2.0. Larger sends more matrices uncompressed.
        start_step: number of initial steps sent uncompressed (warm-up), an integer >= 0;
            default 0. See the module docstring for what warm-up costs.
        error_feedback: keep what the approximation misses and add it next step; default True.
            Without it PowerSGD is biased and usually trains worse.
        warm_start: reuse last step's Q (True, default) instead of a fresh random Q each
            step; one power-iteration step per training step then tracks the top subspace.
        seed: key of the shared generator for the random Q (any integer; default 0). All
            ranks must use the same seed.
        uncompressed_dtype: "float16" (default; pre-scaled by 1/world_size, as the ``fp16``
            scheme) or "float32", for the tensors step 1 leaves uncompressed.

    Raises:
        ValueError: an option outside its range, e.g.
            "powersgd: rank must be an integer >= 1, got 0".
    """

    rank: int = 1
    min_compression_rate: float = 2.0
    start_step: int = 0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    uncompressed_dtype: str = "float16"

    def __post_init__(self):
        _check_int("rank", self.rank, 1)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 1.0:
            raise ValueError(f"powersgd: min_compression_rate must be a number >= 1, got {rate!r}")
        _check_int("start_step", self.start_step, 0)
        for name in ("error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"powersgd: {name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"powersgd: seed must be an integer, got {self.seed!r}")
        if self.uncompressed_dtype not in ("float16", "float32"):
            raise ValueError(f"powersgd: uncompressed_dtype must be 'float16' or 'float32', "
                             f"got {self.uncompressed_dtype!r}")


class PowerSGDState(NamedTuple):
    residual: object  # float32 [n, m]: error feedback E; [0] when uncompressed or error_feedback=False
    q: object  # float32 [r, m]: Q transposed, unit columns (warm start); [0] when uncompressed
    step: object  # int64 []: compress calls so far (drives start_step and fresh Q draws)


class PowerSGDScheme(Scheme):
    """Rank-r PowerSGD with error feedback and warm start (module docstring, steps 1-11)."""

    name = "powersgd"
    # The residual is held back when the all-reduced P is non-finite (any rank); Q and step
    # change only in absorb, guarded there.
    masks_own_state = True

    def __init__(self, config: PowerSGDConfig = PowerSGDConfig()):
        self.config = config
        self._fallback = _FP16 if config.uncompressed_dtype == "float16" else None

    # ---- Step 1: the static policy ----
    def matrix_shape(self, info: TensorInfo):
        """``(n, m)`` if this tensor is compressed, else None (a function of the shape only)."""
        if len(info.shape) < 2 or info.numel == 0:
            return None
        n, m = info.shape[0], info.numel // info.shape[0]
        r = self.config.rank
        if r * (n + m) * self.config.min_compression_rate > n * m:
            return None
        return n, m

    def _seed_key(self, info):
        return stream_key("powersgd", self.config.seed, info.key)

    def _random_q(self, ops, info, m, like, step=None):
        """float32 [r, m] from the shared generator (keyed by the step when given)."""
        r, key = self.config.rank, self._seed_key(info)
        if step is not None:
            key = step_key(ops, key, step)
        return ops.reshape(normal(ops, key, r * m, like), (r, m))

    def init(self, ops, info: TensorInfo, like):
        step = ops.zeros((), "int64", like)
        shape = self.matrix_shape(info)
        if shape is None:
            empty = ops.zeros((0,), "float32", like)
            return PowerSGDState(empty, empty, step)
        n, m = shape
        residual = ops.zeros((n, m) if self.config.error_feedback else (0,), "float32", like)
        return PowerSGDState(residual, self._random_q(ops, info, m, like), step)

    def _side_name(self, what, info):
        return f"hvd_gradcomp.powersgd.{what}.{info.key}"

    # ---- compress ----
    def compress(self, ops, x, state, info, finite):
        """Payload: float32 [r m] (compressed) or the uncompressed tensor; see module steps."""
        shape = self.matrix_shape(info)
        if shape is None:
            payload, ctx = self._uncompressed(ops, x, info)
            return payload, ctx, state
        n, m = shape
        cfg = self.config
        # Step 2.
        matrix = ops.reshape(x, (n, m))
        if cfg.error_feedback:
            matrix = matrix + state.residual
        if cfg.start_step == 0:
            payload, p, residual = self._power_step(ops, matrix, state, info, finite, m)
            return payload, (None, p, None), state._replace(residual=residual)
        # Both branches give (payload, P, summed matrix, residual); the one a branch does not
        # compute is a [1, 1] placeholder (TensorFlow relaxes that output's static shape).
        warm = state.step < cfg.start_step

        def compressed():
            payload, p, residual = self._power_step(ops, matrix, state, info, finite, m)
            return payload, p, ops.zeros((1, 1), "float32", matrix), residual

        payload, p, full, residual = ops.cond(
            warm, lambda: self._warmup_step(ops, matrix, state, info, finite, m), compressed)
        return payload, (warm, p, full), state._replace(residual=residual)

    def _uncompressed(self, ops, x, info):
        if self._fallback is not None:
            payload, ctx, _ = self._fallback.compress(ops, x, (), info, None)
            return payload, ctx
        return x, None

    def _power_step(self, ops, matrix, state, info, finite, m):
        """Steps 3-8: (payload float32 [r m], P [n, r], residual)."""
        cfg = self.config
        # Step 3.
        q_t = state.q if cfg.warm_start else self._random_q(ops, info, m, matrix, state.step)
        # Step 4.
        p = ops.matmul(matrix, ops.transpose(q_t, (1, 0)))
        # Step 5: every rank must issue this, with this name, in the same order.
        p = ops.allreduce(p, "sum", self._side_name("p", info))
        # Step 6.
        p = orthogonalize(ops, p)
        # Step 7: Q_i^T = P^T M, so no n x m transpose is formed.
        q_local_t = ops.matmul(ops.transpose(p, (1, 0)), matrix)
        payload = poison(ops, ops.reshape(q_local_t, (cfg.rank * m,)), finite)
        # Step 8: local decompression; a non-finite P means the step is lost on every rank.
        residual = state.residual
        if cfg.error_feedback:
            p_finite = ops.all(ops.isfinite(p), None)
            residual = ops.where(p_finite, matrix - ops.matmul(p, q_local_t), state.residual)
        return payload, p, residual

    def _warmup_step(self, ops, matrix, state, info, finite, m):
        """Steps W1-W2: (payload float32 [r m], [1, 1] placeholder, summed matrix, zero residual)."""
        r, size = self.config.rank, info.world_size
        # Step W1: the fp16 baseline's pre-scaled cast (overflow-safe sum), as a side all-reduce.
        half, ctx, _ = _FP16.compress(ops, matrix, (), info, None)
        half = ops.allreduce(half, "sum", self._side_name("full", info))
        summed = _FP16.decompress(ops, half, ctx, info)
        # Step W2: 1/size in every coordinate; Horovod's Sum makes it 1, Average 1/size.
        marker = poison(ops, ops.zeros((r * m,), "float32", matrix) + 1.0 / size, finite)
        return marker, ops.zeros((1, 1), "float32", matrix), summed, ops.zeros(
            ops.shape(state.residual), "float32", matrix)

    # ---- decompress ----
    def decompress(self, ops, payload, ctx, info):
        """float32 of the matrix shape (or the tensor's): step 10, or W2 during warm-up."""
        shape = self.matrix_shape(info)
        if shape is None:
            if self._fallback is not None:
                return self._fallback.decompress(ops, payload, ctx, info)
            return payload
        n, m = shape
        warm, p, full = ctx
        q_t = ops.reshape(payload, (self.config.rank, m))
        if warm is None:
            return ops.matmul(p, q_t)
        return ops.cond(warm, lambda: full * payload[0], lambda: ops.matmul(p, q_t))

    # ---- Step 11 ----
    def absorb(self, ops, payload, ctx, state, info):
        """Warm-start Q from the aggregated payload (unit columns) and the step counter + 1."""
        step = state.step + 1
        shape = self.matrix_shape(info)
        if shape is None or not self.config.warm_start:
            return state._replace(step=step)
        n, m = shape
        agg = ops.reshape(payload, (self.config.rank, m))  # row j = column j of Q
        # Scale rows by 1/max|row| first so the squares neither under- nor overflow.
        top = ops.maximum(ops.max(ops.abs(agg), 1), _TINY)
        agg = agg * ops.reshape(1.0 / top, (self.config.rank, 1))
        norms = ops.reshape(ops.sqrt(ops.sum(agg * agg, 1)), (self.config.rank, 1))
        usable = ops.logical_and(ops.isfinite(norms), norms > _TINY)
        q_t = ops.where(usable, agg * (1.0 / ops.maximum(norms, _TINY)), state.q)
        warm = ctx[0]
        if warm is not None:
            q_t = ops.where(warm, state.q, q_t)
        return state._replace(q=q_t, step=step)

    def wire(self, info: TensorInfo) -> WireBytes:
        """Bytes per step after warm-up: Q payload plus the P side collective (module docs)."""
        shape = self.matrix_shape(info)
        if shape is None:
            return WireBytes((2 if self._fallback is not None else 4) * info.numel)
        n, m = shape
        r = self.config.rank
        return WireBytes(4 * r * m, 4 * n * r, 1)
