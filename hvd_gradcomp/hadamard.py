"""Randomized Hadamard rotation (RHT) of a flat vector, full or in blocks, with tensor ops only.

The rotation of THC (Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor
Homomorphic Compression", NSDI 2024) and of DRIVE/EDEN before it: multiply by a random +-1
diagonal ``D``, then by the Walsh-Hadamard matrix ``H_B`` of size ``B = 2**k``, normalised so
that the map is orthonormal. Coordinates of the result are close to N(0, ||x||**2 / B) for
almost any input, which is what lets a few bits per coordinate cover them.

Steps of :func:`rht` (``x`` float32 [P], ``P`` a multiple of the block size ``B``):
    1. ``x * diag`` where ``diag`` is ``+-1/sqrt(B)`` (:func:`rademacher`): the random signs and
       the normalisation in one multiplication.
    2. Walsh-Hadamard transform of each contiguous block of ``B`` coordinates (:func:`wht`),
       with +-1 entries (Sylvester order).
:func:`irht` is the inverse: step 2, then step 1 (``H_B`` is symmetric and ``H_B H_B = B I``,
so ``irht(rht(x)) == x`` up to float32 rounding; exactly when every sum is exact).

Full and partial rotation (:func:`block_size`):
    * full: one block of ``next_pow2(d)`` coordinates; every output mixes every input, padding
      up to ``2x`` the tensor.
    * partial, ``k`` stages: independent blocks of ``2**k`` coordinates, i.e. the first ``k``
      butterfly stages of the full transform; padding only to a multiple of ``2**k``.

How the transform is computed (:func:`wht`). ``H_B`` in Sylvester order is a Kronecker product
``H_{s1} (x) H_{s2} (x) ... (x) H_{sr}`` of small Sylvester matrices (``s1 * ... * sr = B``,
each ``s <= MAX_FACTOR``). Viewing a block as an array of shape ``(s1, ..., sr)`` in row-major
order, the factor ``H_{si}`` acts on axis ``i`` alone. So the transform is ``r`` dense matrix
products on reshaped views, with a Python loop over the ``r`` factors only (never over
elements), and no transposes:

    * the last factor: ``x.reshape(-1, sr) @ H_sr``;
    * any other factor ``si``: ``H_si @ x.reshape(-1, si, suffix)`` (a batched product with
      ``suffix = s(i+1) * ... * sr`` columns).

Cost: ``sum(s_i)`` multiply-adds per coordinate in ``r`` passes over memory; a butterfly loop
needs ``log2(B)`` passes of one add each, and on CPU and GPU the matrix units make the few
dense passes far cheaper than the many elementwise ones (compiled as one loop per block in
cache, a butterfly is cheaper still: PyTorch's CPU fused form of THC's kernels,
``torch_backend/kernels/csrc/thc.c``). ``MAX_FACTOR = 32`` (``B = 1024`` is
``32 x 32``; ``2**22`` is ``32 x 32 x 16 x 16 x 16``): a larger cap costs more flops per
coordinate, a smaller one more passes and factors of 8; the timings behind the choice are in
docs/bench.md ("THC").

Randomness: the signs come from :mod:`hvd_gradcomp.rng` (counter-based, identical on every
rank and in both frameworks). One 32-bit draw gives 32 signs (:func:`rademacher`), so the hash
runs over ``P / 32`` counters instead of ``P``.
"""
__all__ = ["MAX_FACTOR", "next_pow2", "block_size", "padded_size", "factor_sizes", "sylvester",
           "hadamard_factors", "nested_factors", "wht", "rademacher", "rht", "irht"]

from . import rng

# Largest dense Sylvester factor (module docstring; measured in docs/bench.md, "THC").
MAX_FACTOR = 32


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def block_size(d: int, stages=None) -> int:
    """Rotation block ``B`` for a tensor of ``d`` coordinates.

    Args:
        d: number of coordinates (>= 1).
        stages: ``None`` for the full rotation (``B = next_pow2(d)``), else ``k >= 1`` butterfly
            stages: ``B = min(2**k, next_pow2(d))`` (a block never exceeds the padded tensor).
    """
    full = next_pow2(d)
    return full if stages is None else min(1 << stages, full)


def padded_size(d: int, block: int) -> int:
    """``d`` rounded up to a multiple of ``block`` (the rotated vector's length ``P``)."""
    return -(-d // block) * block


def factor_sizes(block: int) -> list:
    """Powers of two ``<= MAX_FACTOR`` whose product is ``block``, as equal as possible.

    ``factor_sizes(1024) == [32, 32]``, ``factor_sizes(2**22) == [32, 32, 16, 16, 16]``,
    ``factor_sizes(8) == [8]``.

    Raises:
        ValueError: ``block`` is not a power of two >= 1.
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"hadamard: block must be a power of two, got {block}")
    log_b, log_f = block.bit_length() - 1, MAX_FACTOR.bit_length() - 1
    count = max(1, -(-log_b // log_f))
    base, extra = divmod(log_b, count)
    return [1 << (base + (1 if i < extra else 0)) for i in range(count)]


def sylvester(ops, size: int, like):
    """The +-1 Walsh-Hadamard matrix of ``size`` (a power of two), Sylvester order.

    ``H[i, j] = (-1) ** popcount(i & j)``, built with integer ops (no host-side list).

    Returns:
        float32 [size, size], symmetric, ``H @ H == size * I``.
    """
    idx = ops.arange(size, "int32", like)
    a = ops.bitwise_and(ops.reshape(idx, (size, 1)), ops.reshape(idx, (1, size)))
    shift = 16
    while shift:  # fold the bits of a (< 2**31) onto bit 0 to get the parity of popcount
        if size > (1 << shift):
            a = ops.bitwise_xor(a, ops.right_shift(a, shift))
        shift //= 2
    parity = ops.bitwise_and(a, 1)
    return 1.0 - 2.0 * ops.cast(parity, "float32")


def hadamard_factors(ops, block: int, like):
    """``[(s, H_s), ...]`` for :func:`wht`: the factors of ``block`` with their matrices.

    Build once per call site and reuse for the forward and inverse transforms (one matrix,
    :func:`nested_factors`).
    """
    return nested_factors(block, sylvester(ops, max(factor_sizes(block)), like))


def nested_factors(block: int, matrix):
    """:func:`hadamard_factors` of ``block`` from one Sylvester ``matrix`` of the largest factor
    size (``sylvester(ops, max(factor_sizes(block)), like)``): ``H_s`` is the top-left
    ``s x s`` corner of ``H_S`` for every ``s <= S`` (``H_2n = [[H_n, H_n], [H_n, -H_n]]``), so
    one matrix serves every factor, built once and passed around as a tensor."""
    sizes = factor_sizes(block)
    top = max(sizes)
    return [(s, matrix if s == top else matrix[:s, :s]) for s in sizes]


def wht(ops, x, factors):
    """Unnormalised Walsh-Hadamard transform of each block of a flat vector.

    Args:
        x: float32 [P], ``P`` a multiple of the block ``B = prod(s)``.
        factors: :func:`hadamard_factors` of ``B``.

    Returns:
        float32 [P]: block ``b`` of the result is ``H_B @ x[b*B:(b+1)*B]``.
    """
    (p,) = ops.shape(x)
    suffix = 1
    for s, _ in factors:
        suffix *= s
    for s, h in factors:
        suffix //= s
        if suffix == 1:
            x = ops.matmul(ops.reshape(x, (p // s, s)), h)  # H symmetric: rows @ H = H @ columns
        else:
            x = ops.matmul(h, ops.reshape(x, (p // (s * suffix), s, suffix)))
    return ops.reshape(x, (p,))


# Byte -> its 8 bits as +-1 (bit j of byte b is entry [b, j]), for rademacher().
def _byte_signs(ops, like):
    byte = ops.reshape(ops.arange(256, "int32", like), (256, 1))
    bit = ops.reshape(ops.arange(8, "int32", like), (1, 8))
    return 1.0 - 2.0 * ops.cast(ops.bitwise_and(ops.right_shift(byte, bit), 1), "float32")


def rademacher(ops, key, n: int, like, scale: float = 1.0):
    """``n`` independent random signs times ``scale``: float32 [n] of ``+-scale``.

    Every bit of :func:`rng.bits32` is used: ``ceil(n / 32)`` draws, each split into 4 bytes,
    each byte looked up in a 256 x 8 table of signs. Same key -> same signs on every rank and in
    both frameworks.

    Args:
        key: Python int or int64 0-d tensor (e.g. :func:`rng.step_key`).
        n: number of signs (static).
        like: tensor whose device the result lives on.
        scale: magnitude (Python float), e.g. ``1/sqrt(B)`` to make the rotation orthonormal.
    """
    words = -(-n // 32)
    draws = ops.reshape(rng.bits32(ops, key, words, like), (words, 1))
    shifts = ops.arange(4, "int64", like) * 8  # 0, 8, 16, 24, on the device
    byte = ops.bitwise_and(ops.right_shift(draws, shifts), 255)
    table = _byte_signs(ops, like) * scale
    signs = ops.reshape(ops.gather(table, ops.reshape(byte, (4 * words,))), (32 * words,))
    return signs[:n] if 32 * words != n else signs


def rht(ops, x, diag, factors):
    """Randomized Hadamard rotation: ``wht(x * diag)`` blockwise.

    Args:
        x: float32 [P].
        diag: float32 [P] of ``+-1/sqrt(B)`` (:func:`rademacher`) for an orthonormal map.
        factors: :func:`hadamard_factors` of ``B``.
    """
    return wht(ops, x * diag, factors)


def irht(ops, y, diag, factors):
    """Inverse of :func:`rht` with the same ``diag`` and ``factors``: ``wht(y) * diag``."""
    return wht(ops, y, factors) * diag
