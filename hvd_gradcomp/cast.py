"""Baselines: FP32 (no compression), FP16 and BF16 casts.

Steps (fp16):
    1. Pre-scale by 1/world_size, so the fp16 sum of n ranks stays within the fp16 range
       (|x| <= 65504 per rank suffices), as PyTorch DDP's ``fp16_compress_hook`` does.
    2. Cast to float16: the payload, d elements, 2 bytes each.
    3. Horovod all-reduces it (Sum or Average).
    4. Decompress casts to float32 and multiplies by world_size: the sum under ``op=Sum``,
       the mean under ``op=Average`` (the scaling is linear, so it commutes with either op).

On Horovod's NCCL all-reduce under ``op=Average`` (``ncclAvg``), NCCL itself multiplies each
rank's float16 payload by 1/n before summing; steps 1 and 4 then use 1.0 instead of 1/n and n
(:attr:`~hvd_gradcomp.base.TensorInfo.prescale`), or the payload would travel as x/n^2.

Tiny values: after the 1/n pre-scale a value below 6.1e-5 * n falls in fp16's subnormal range,
where the spacing is 2**-24 (5.96e-8); the absolute error per coordinate of the result is then
at most n * 2**-24 * n / 2 (half a spacing per rank, times n for the post-scale). Plain fp16
without the pre-scale has the same spacing there and overflows above 65504 / n.

BF16: Horovod's collectives have no bfloat16 dtype (PyTorch refuses it, TensorFlow has no such
Horovod type). ``bf16`` therefore rounds each value to bfloat16 (round to nearest even) and
carries it in a **float32** payload: the numerics of a BF16 gradient exchange, at FP32's
4 bytes per coordinate. It saves no bandwidth under Horovod; it exists to measure the accuracy
effect of BF16 rounding side by side with the other schemes.
"""
from dataclasses import dataclass
from typing import ClassVar

from .base import Scheme, TensorInfo, WireBytes
from .options import option, validate
from .primitives import itemsize

__all__ = ["NoneConfig", "Fp16Config", "Bf16Config", "NoneScheme", "Fp16Scheme", "Bf16Scheme"]


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

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(info.numel * (4 if self.float32 else itemsize(info.dtype)))

    def payload_dtype(self, info: TensorInfo) -> str:
        return "float32" if self.float32 else info.dtype


class Fp16Scheme(Scheme):
    """float16 payload pre-scaled by 1/world_size (module docstring, steps 1-4)."""

    name = "fp16"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    guards_nonfinite = False  # NaN/inf survive the cast and the sum on their own
    linear = True  # Min/Max/Adasum and Horovod's scale factors keep their meaning

    def __init__(self, config: Fp16Config = Fp16Config()):
        self.config = config

    def compress(self, ops, x, state, info, finite):
        # Step 1-2: 1/n keeps the n-rank fp16 sum from overflowing (DDP's fp16 hook does the
        # same); 1.0 where NCCL's Average divides by n itself (TensorInfo.prescale).
        return ops.scaled_cast(x, info.prescale, "float16"), None

    def decompress(self, ops, payload, ctx, info):
        # Step 4: undo the pre-scale; linear, so right under Sum and Average alike.
        out = ops.cast(payload, "float32")
        return out if info.unscale == 1.0 else out * info.unscale

    def decode_factor(self, info: TensorInfo) -> float:
        return info.unscale

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

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(4 * info.numel)
