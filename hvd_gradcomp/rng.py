"""Counter-based random numbers, identical on every rank and in both frameworks.

Ranks that must agree on randomness (THC's +-1 diagonal, PowerSGD's first Q) and ranks that
must not (stochastic rounding) both draw from this generator; it never reads or advances a
framework's global RNG. It is a keyed hash of the element index (a counter-based generator in
the sense of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), built only
from int64 additions, multiplications by 16-bit halves, shifts, ands and xors, which PyTorch and
TensorFlow compute bit for bit alike on CPU and GPU. The mixing function is Chris Wellons'
``lowbias32`` (hash-prospector), applied twice.

All intermediate values stay below 2**49, so int64 never overflows: a 32x32-bit product is
formed from two 32x16-bit products (:func:`_mul32`).

Functions:
    stream_key(*parts) -> Python int: a 32-bit key from ints/strings (host side, crc32-based).
    step_key(ops, key, step) -> int64 0-d tensor mixing a static key with a step tensor.
    hash32(ops, x) -> int64 elementwise hash of int64 values.
    bits32(ops, key, n, like) -> int64 [n] uniformly distributed in [0, 2**32).
    uniform(ops, key, n, like) -> float32 [n] uniform in [0, 1), multiples of 2**-24.
    signs(ops, key, n, like) -> float32 [n] of +-1 with probability 1/2 each.
"""
import zlib

__all__ = ["stream_key", "step_key", "hash32", "bits32", "uniform", "signs", "normal"]

_M32 = 0xFFFFFFFF


def stream_key(*parts) -> int:
    """Deterministic 32-bit key of ``parts`` (ints or strings), the same in every process.

    Python's ``hash()`` is salted per process, so crc32 over the parts' text is used instead.
    """
    text = "\x1f".join(str(p) for p in parts).encode()
    return zlib.crc32(text) & _M32


def _mul32(ops, a, b: int):
    """(a * b) mod 2**32 for int64 ``a`` in [0, 2**32) and a Python int constant ``b``."""
    lo, hi = b & 0xFFFF, b >> 16
    high_part = ops.left_shift(ops.bitwise_and(a * hi, 0xFFFF), 16)
    return ops.bitwise_and(a * lo + high_part, _M32)


def _lowbias32(ops, x):
    x = ops.bitwise_xor(x, ops.right_shift(x, 16))
    x = _mul32(ops, x, 0x7FEB352D)
    x = ops.bitwise_xor(x, ops.right_shift(x, 15))
    x = _mul32(ops, x, 0x846CA68B)
    return ops.bitwise_xor(x, ops.right_shift(x, 16))


def hash32(ops, x):
    """Elementwise 32-bit hash of int64 ``x`` in [0, 2**32) (lowbias32), int64 in [0, 2**32)."""
    return _lowbias32(ops, ops.bitwise_and(x, _M32))


def step_key(ops, key: int, step):
    """Mix a static 32-bit ``key`` with ``step`` (int64 0-d tensor, >= 0) into an int64 0-d key."""
    s = ops.bitwise_and(step, _M32)
    return _lowbias32(ops, ops.bitwise_xor(_lowbias32(ops, s), key & _M32))


def bits32(ops, key, n: int, like):
    """``n`` pseudo-random 32-bit values (int64 [n], in [0, 2**32)) for ``key``.

    Args:
        key: Python int or int64 0-d tensor (e.g. from :func:`step_key`).
        n: number of values (static).
        like: any tensor; the result is created on its device.
    """
    counter = ops.arange(n, "int64", like)
    if isinstance(key, int):
        k = key & _M32
        offset = (k * 0x9E3779B9) & _M32
    else:
        k = ops.bitwise_and(key, _M32)
        offset = _mul32(ops, k, 0x9E3779B9)
    x = ops.bitwise_and(counter + offset, _M32)
    return _lowbias32(ops, ops.bitwise_xor(_lowbias32(ops, x), k))


def uniform(ops, key, n: int, like):
    """float32 [n] uniform on [0, 1): the top 24 bits of :func:`bits32` times 2**-24 (exact)."""
    return ops.cast(ops.right_shift(bits32(ops, key, n, like), 8), "float32") * (2.0 ** -24)


def signs(ops, key, n: int, like):
    """float32 [n] of -1.0 / +1.0, each with probability 1/2 (the top bit of :func:`bits32`)."""
    bit = ops.right_shift(bits32(ops, key, n, like), 31)
    return ops.cast(bit, "float32") * 2.0 - 1.0


def normal(ops, key, n: int, like):
    """float32 [n], approximately standard normal: a sum of 4 uniforms, centred and scaled.

    Used only to initialise PowerSGD's Q (any full-rank random start works there); a sum of
    uniforms avoids log/cos, whose last bits differ between frameworks.
    """
    u = uniform(ops, key, 4 * n, like)
    # Added in a fixed order: a reduction's order is the backend's (and the CPU's) choice, and
    # float32 sums of four 24-bit uniforms round.
    s = ((u[:n] + u[n:2 * n]) + u[2 * n:3 * n]) + u[3 * n:]
    # A sum of 4 U(0,1) has mean 2 and variance 4/12.
    return (s - 2.0) * (3.0 ** 0.5)
