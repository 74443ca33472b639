"""Baselines: FP32 (no compression), FP16 and BF16 casts.

Steps (fp16):
    1. Pre-scale by ``s``: 1/world_size, so the fp16 sum of n ranks stays within the fp16
       range (|x| <= 65504 per rank suffices), as PyTorch DDP's ``fp16_compress_hook`` does;
       from :data:`SCALED_FROM` ranks on, after a tensor's first step, the agreed power of
       two of step 5 instead.
    2. Cast to float16: the payload, d elements, 2 bytes each.
    3. Horovod all-reduces it (Sum or Average).
    4. Decompress casts to float32 and multiplies by ``1/s``: the sum under ``op=Sum``, the
       mean under ``op=Average`` (the scaling is linear, so it commutes with either op).
    5. (From :data:`SCALED_FROM` ranks on, under Sum or Gloo/MPI's Average.) ``finish`` sets
       next step's ``s`` from this step's all-reduced payload, which every rank holds bit for
       bit, so the ranks agree on it with no collective, no host read and nothing added to
       the wire: ``S`` = the largest |value| of the ranks' scaled sum (the payload's, times n
       where Horovod averaged: Average or an unknown op), ``R = S / s`` in gradient units, and
       ``s' = 2**floor(log2(65504 / (2**HEADROOM_BITS * n * R)))``, clipped to
       ``[2**-60, 2**60]``. Every partial sum of the ranks' scaled values is then at most
       ``65504 / 2**HEADROOM_BITS`` while no rank's |x| grows past ``2**HEADROOM_BITS *
       R_prev`` (n times the previous sum's peak covers the ranks' |x| however they cancel),
       and the values sit high in float16's normal range instead of in its subnormals, where
       ``1/n`` at many ranks puts them (and Gloo/MPI's Average, which multiplies the float16
       sum by ``1/n`` once more). An all-zero payload keeps ``s``; a non-finite one (a NaN/inf
       gradient, or a sum that overflowed after a growth beyond the headroom) sets ``s`` back
       to ``1/n`` for the next step, the safe choice; a tensor's first step, and every step
       of a tensor without a key (``hvd.allreduce`` without ``name=``, no state to keep), use
       ``1/n``. The scale is state (``Fp16State``); a checkpoint loaded on another number of
       ranks restarts it at ``1/n`` (the field ``fp16_scale`` is reset as the rank-local ones are).

On Horovod's NCCL all-reduce under ``op=Average`` (``ncclAvg``), NCCL itself multiplies each
rank's float16 payload by 1/n before summing; steps 1 and 4 then use 1.0 instead of 1/n and n
(:attr:`~hvd_gradcomp.base.TensorInfo.prescale`), or the payload would travel as x/n^2.

Tiny values: after the 1/n pre-scale a value below 6.1e-5 * n falls in fp16's subnormal range,
where the spacing is 2**-24 (5.96e-8); the absolute error per coordinate of the result is then
at most n * 2**-24 * n / 2 (half a spacing per rank, times n for the post-scale). Plain fp16
without the pre-scale has the same spacing there and overflows above 65504 / n. Step 5's scale
moves the subnormal range to ``6.1e-5 / s``, about ``1e-6 n R`` (``R`` the peak of the sum):
relative errors at or below Horovod's own fp16 from the second step on, emulated at 8, 32
and 128 ranks in tests/core/test_nccl_average.py. Below :data:`SCALED_FROM` ranks fp16 is
stateless and bit for bit what it was.

BF16: Horovod's collectives have no bfloat16 dtype (PyTorch refuses it, TensorFlow has no such
Horovod type). ``bf16`` therefore rounds each value to bfloat16 (round to nearest even) and
carries it in a **float32** payload: the numerics of a BF16 gradient exchange, at FP32's
4 bytes per coordinate. It saves no bandwidth under Horovod; it exists to measure the accuracy
effect of BF16 rounding side by side with the other schemes.
"""
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import FP16_MAX, EmptyState, Scheme, TensorInfo, WireBytes
from .options import option, validate
from .primitives import itemsize

__all__ = ["NoneConfig", "Fp16Config", "Bf16Config", "NoneScheme", "Fp16Scheme", "Fp16State", "Bf16Scheme",
           "SCALED_FROM", "HEADROOM_BITS"]

# fp16 sends with an agreed power-of-two scale (module docstring, step 5) from this many ranks on;
# below, the 1/n pre-scale leaves values normal enough (and fp16 stays stateless, as it was).
SCALED_FROM = 8
# Bits of headroom the agreed scale leaves: the ranks' scaled sums stay below 65504 / 2**10
# unless a tensor's gradient grows more than 1024x in one step (beyond n times the last sum's peak).
HEADROOM_BITS = 10
_EXP_LIMIT = 60  # the agreed scale stays in [2**-60, 2**60]


# none's payload dtypes: the gradient's own (Horovod's none), or float32.
NONE_DTYPES = ("gradient", "float32")


@dataclass(frozen=True)
class NoneConfig:
    """FP32 baseline: the gradient is all-reduced as it is (``dtype="gradient"``, the
    default: Horovod's own ``none``), or cast to a float32 payload (``dtype="float32"``:
    half-precision gradients travel and are summed in float32; Horovod's PyTorch collectives
    refuse bfloat16 tensors; PowerSGD's ``uncompressed_dtype=float32`` sends the tensors it
    does not accept so).

    Raises:
        ValueError: ``dtype`` not one of :data:`NONE_DTYPES`.
    """

    SCHEME: ClassVar[str] = "none"
    dtype: str = option("gradient", kind="choice", choices=NONE_DTYPES,
                        doc="payload dtype: the gradient's own (as Horovod's none), or float32 "
                            "(half-precision gradients summed in float32; Horovod has no bfloat16)")

    def __post_init__(self):
        validate(self)


@dataclass(frozen=True)
class Fp16Config:
    """FP16 baseline: pre-scaled float16 payload. No options."""


@dataclass(frozen=True)
class Bf16Config:
    """BF16 numerics carried in float32 (see the module docstring). No options."""


class NoneScheme(Scheme):
    """Identity: the payload is the gradient itself, in its own dtype (Horovod's ``none``);
    with ``dtype="float32"`` the gradient as a float32 payload (a cast for float16, bfloat16
    and float64 gradients; nothing for float32 ones), decoded back to the gradient's dtype by
    :func:`~hvd_gradcomp.base.finish_tensor`."""

    name = "none"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    guards_nonfinite = False  # NaN/inf survive the cast and the sum on their own

    def __init__(self, config: NoneConfig = NoneConfig()):
        self.config = config
        self.float32 = config.dtype == "float32"
        # As it is: adapters hand the tensor to Horovod untouched, with no copy. float32: a
        # cast, linear (Min/Max/Adasum and Horovod's scale factors keep their meaning).
        self.identity = not self.float32
        self.linear = self.float32

    def compress(self, ops, x, state, info, finite):
        return x, None  # x: float32 (compress_tensor's cast)

    def decompress(self, ops, payload, ctx, info):
        return payload if not self.float32 else ops.cast(payload, "float32")

    def decode_factor(self, info: TensorInfo) -> float:
        return 1.0

    def scatter_split(self, info: TensorInfo) -> int:
        """All values, nothing agreed (:func:`~hvd_gradcomp.composite.scatter_split`)."""
        return info.numel

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(info.numel * (4 if self.float32 else itemsize(info.dtype)))

    def payload_dtype(self, info: TensorInfo) -> str:
        return "float32" if self.float32 else info.dtype


class Fp16State(NamedTuple):
    # float32 []: the agreed power of two for the next step; 0: none yet (1/n). Its own name:
    # a checkpoint's elastic reset goes by field name over every scheme of a routing.
    fp16_scale: object


def scaled(info: TensorInfo) -> bool:
    """True where fp16 keeps an agreed scale (module docstring, step 5): from
    :data:`SCALED_FROM` ranks on, unless the all-reduce divides by n itself (NCCL's Average,
    :attr:`TensorInfo.backend_divides`: its prescale 1.0 already keeps the values normal)."""
    return info.world_size >= SCALED_FROM and not info.backend_divides


class Fp16Scheme(Scheme):
    """float16 payload pre-scaled by 1/world_size, or from :data:`SCALED_FROM` ranks on by an
    agreed power of two (module docstring, steps 1-5)."""

    name = "fp16"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    guards_nonfinite = False  # NaN/inf survive the cast and the sum on their own
    linear = True  # Min/Max/Adasum and Horovod's scale factors keep their meaning
    # The scale is agreed, not rank-local; listed so that a checkpoint loaded on another number
    # of ranks resets it (0: 1/n at the next step), since it was derived for the old world size.
    rank_local_fields = ("fp16_scale",)
    # A tensor without a key (no state) is sent with 1/n (adapters: no key needed).
    state_optional = True

    def __init__(self, config: Fp16Config = Fp16Config()):
        self.config = config

    def init(self, ops, info, like):
        if not scaled(info):
            return EmptyState()
        return Fp16State(ops.zeros((), "float32", like))

    def init_like(self, ops, info, like, loaded):
        """A loaded state's fields: a scale saved at 8 ranks or more is taken (and ignored
        below :data:`SCALED_FROM`, where no scale is used), so elastic loads across the
        threshold still load."""
        if "fp16_scale" in getattr(loaded, "_fields", ()):
            return Fp16State(ops.zeros((), "float32", like))
        return self.init(ops, info, like)

    def _scale(self, ops, state, info, like):
        """The pre-scale this step: ``info.prescale``, or the agreed scale where one is kept."""
        if not scaled(info) or not isinstance(state, Fp16State):
            return info.prescale
        return ops.where(state.fp16_scale > 0.0, state.fp16_scale, ops.zeros((), "float32", like) + info.prescale)

    def compress(self, ops, x, state, info, finite):
        # Step 1-2: 1/n keeps the n-rank fp16 sum from overflowing (DDP's fp16 hook does the
        # same); 1.0 where NCCL's Average divides by n itself (TensorInfo.prescale), in one pass
        # (scaled_cast); from SCALED_FROM ranks on, the agreed power of two (step 5).
        s = self._scale(ops, state, info, x)
        if isinstance(s, float):
            return ops.scaled_cast(x, s, "float16"), s
        return ops.cast(x * s, "float16"), s

    def decompress(self, ops, payload, ctx, info):
        # Step 4: undo the pre-scale; linear, so right under Sum and Average alike.
        out = ops.cast(payload, "float32")
        if ctx is None or isinstance(ctx, float):  # the 1/n (or 1.0) pre-scale; ctx None: called
            return out if info.unscale == 1.0 else out * info.unscale  # without compress's ctx
        return out * (1.0 / ctx)  # ctx: the agreed scale s (0-d)

    def decode_factor(self, info: TensorInfo) -> float:
        # Asked only where the tensor keeps no state (adapter.linear_decode): the 1/n pre-scale.
        return info.unscale

    def scatter_split(self, info: TensorInfo) -> int:
        """All values, nothing agreed (:func:`~hvd_gradcomp.composite.scatter_split`). From
        :data:`SCALED_FROM` ranks on the agreed scale of step 5 is read from the whole summed
        payload, which a reduce-scatter hands to one rank only; stepped from the payload with
        its values zeroed (all zeros: no news of the scale), it stays at 0, so a reduce-scattered
        fp16 tensor is sent with the 1/n pre-scale at every step, as below 8 ranks, the same on
        every rank."""
        return info.numel

    def finish(self, ops, payload, ctx, state, info):
        """Step 5: next step's agreed scale, from the all-reduced payload."""
        if not isinstance(state, Fp16State) or not scaled(info):
            return state
        n = info.world_size
        y = ops.abs(ops.cast(payload, "float32"))
        peak = ops.max(y, None) * (1.0 if info.op == "sum" else float(n))  # of the scaled sum
        ok = ops.isfinite(peak)
        safe_peak = ops.where(ok, ops.maximum(peak, 1e-30), 1.0)
        # s' = 2**floor(log2(65504 / (2**H * n * peak / s))), s a power of two (or 1/n).
        e = ops.floor(math.log2(FP16_MAX) - HEADROOM_BITS - math.log2(n) - ops.log2(safe_peak) + ops.log2(ctx))
        new = ops.exp2(ops.clip(e, -float(_EXP_LIMIT), float(_EXP_LIMIT)))
        keep = ops.where(peak > 0.0, new, state.fp16_scale)  # all zeros: no news of the scale
        return Fp16State(ops.where(ok, keep, ops.zeros((), "float32", y)))  # non-finite: 1/n next

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(2 * info.numel)

    def payload_dtype(self, info: TensorInfo) -> str:
        return "float16"


class Bf16Scheme(Scheme):
    """Values rounded to bfloat16, carried in a float32 payload (Horovod has no bf16 dtype)."""

    name = "bf16"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    guards_nonfinite = False
    linear = True

    def __init__(self, config: Bf16Config = Bf16Config()):
        self.config = config

    def compress(self, ops, x, state, info, finite):
        return ops.cast(ops.cast(x, "bfloat16"), "float32"), None

    def decompress(self, ops, payload, ctx, info):
        return payload

    def decode_factor(self, info: TensorInfo) -> float:
        return 1.0

    def scatter_split(self, info: TensorInfo) -> int:
        """All values, nothing agreed (:func:`~hvd_gradcomp.composite.scatter_split`)."""
        return info.numel

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(4 * info.numel)
