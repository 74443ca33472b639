"""Orthonormalise the columns of a tall matrix: Gram-Schmidt, twice, guarded.

Used by PowerSGD (``powersgd.py``): on the all-reduced factor (float32 [len, r], r small) that
becomes the next step's projection basis.

Steps of :func:`orthogonalize`, for each column j = 0 .. r-1 in order (a Python loop over the
r columns; r is static):
    1. Scale the column by 1 / max|column| (exact for the direction; keeps the squares below
       from underflowing for tiny gradients or overflowing for huge ones).
    2. Subtract its projection on the columns already produced, twice ("twice is enough":
       Giraud, Langou, Rozloznik, "The loss of orthogonality in the Gram-Schmidt process",
       Comput. Math. Appl. 2005). One pass in float32 leaves a dependent column's remainder
       with components along the earlier columns as large as the remainder itself; the
       second pass makes what survives orthogonal to working precision.
    3. Keep the column, scaled to unit norm, if its remaining norm exceeds ``rel_tol`` times
       its norm after step 1; otherwise it is (numerically) zero or a combination of earlier
       columns and becomes exactly zero.

Guards (no try/except: tensors never raise, they give inf/NaN):
    - a zero column gives exact zeros (0 > 0 is False, and 0 * 0 = 0), never 0/0 = NaN;
    - a dependent column gives exact zeros (below ``rel_tol``);
    - a column holding NaN/inf stays non-finite (it is multiplied, never replaced), so a
      non-finite gradient on any rank still reaches every rank's output.

Output: float32 [n, r] whose non-zero columns are orthonormal (to float32 precision).

:func:`basis` is the variant for a projection basis, which must keep r usable directions:
an exactly zero input column (an all-zero gradient, or a column that came out zero from the
previous step's basis) is replaced by the matching column of a fill matrix that every rank
holds (PowerSGD's shared random matrix) before orthogonalising.
"""

__all__ = ["orthogonalize", "basis", "basis_rows", "orthogonalize_batched", "basis_rows_batched", "DEPENDENT_TOL"]

# A column whose part orthogonal to the earlier columns is below this fraction of its own
# norm is treated as dependent. After two projection passes an exactly dependent float32
# column keeps about eps * sqrt(n) of its norm (eps = 1.2e-7: ~1e-5 for n = 10^4); 1e-4
# stays above that while dropping only directions 10^4 times weaker than the column.
DEPENDENT_TOL = 1e-4
# Smallest divisor: keeps 1/x finite for a zero column (the mask then zeroes it anyway).
_TINY = 1e-30


def orthogonalize(ops, p, rel_tol: float = DEPENDENT_TOL):
    """Columns of ``p`` made orthonormal in order; zero/dependent columns become zeros.

    Args:
        ops: the backend's :class:`~hvd_gradcomp.primitives.Primitives`.
        p: float32 [n, r] (static shape).
        rel_tol: relative threshold of step 3, in (0, 1); default :data:`DEPENDENT_TOL`.

    Returns:
        float32 [n, r]: the span of the first j columns of ``p`` equals that of the first
        j non-zero output columns, for every j (up to the dropped dependent parts).
    """
    n, r = ops.shape(p)
    # Step 1 for all columns at once (a few operations instead of a few per column): 1/max|v|
    # changes the lengths only; max(., tiny) keeps 1/0 out of a zero column.
    p = p * (1.0 / ops.maximum(ops.reshape(ops.max(ops.abs(p), 0), (1, r)), _TINY))
    norms0 = ops.norm(p, 0)
    cols = []
    for j in range(r):
        v, norm0 = p[:, j:j + 1], norms0[j]
        # Step 2: project out the earlier (orthonormal or zero) columns, twice.
        if cols:
            basis_ = ops.concat(cols, 1) if len(cols) > 1 else cols[0]
            basis_t = ops.transpose(basis_, (1, 0))
            for _ in range(2):
                v = v - ops.matmul(basis_, ops.matmul(basis_t, v))
        # Step 3: normalise, or zero a zero/dependent column. NaN > x is False, but NaN * 0 is
        # still NaN, so a non-finite column is not turned into zeros.
        norm = ops.norm(v, None)
        keep = norm > norm0 * rel_tol
        cols.append(v * ops.where(keep, 1.0 / ops.maximum(norm, _TINY), 0.0))
    return ops.concat(cols, 1) if r > 1 else cols[0]


def basis(ops, p, fill, rel_tol: float = DEPENDENT_TOL):
    """:func:`orthogonalize` of ``p`` after its all-zero columns are replaced by ``fill``'s.

    Args:
        p: float32 [n, r].
        fill: float32 [n, r], the same on every rank (a shared random matrix); its columns
            are used only where ``p``'s column is exactly zero. Rows that must stay zero
            (padding) must be zero in ``fill`` too.

    Returns:
        float32 [n, r]: orthonormal columns. The span of ``p``'s non-zero columns is kept. A
        column dependent on earlier ones still comes out zero (it is not known to be
        dependent before the projection); the caller's next use of the basis then gives an
        exactly zero column, which the next call fills. A NaN/inf column stays non-finite.
    """
    n, r = ops.shape(p)
    top = ops.reshape(ops.max(ops.abs(p), 0), (1, r))
    # Zero column: top == 0 (finite and not > 0); NaN columns keep their NaN.
    zero = ops.logical_and(ops.isfinite(top), ops.where(top > 0.0, False, True))
    return orthogonalize(ops, ops.where(zero, fill, p), rel_tol)


def basis_rows(ops, rel_tol, pt, fillt):
    """:func:`basis` for factors held transposed, as a kernel (``ops.fuse(basis_rows,
    rel_tol)``; the CPU's fused form is one C loop, ``torch_backend/kernels/cpu_powersgd.py``):
    ``pt``, ``fillt`` float32 [r, n]; returns float32 [r, n], the basis' columns as rows."""
    return ops.transpose(basis(ops, ops.transpose(pt, (1, 0)), ops.transpose(fillt, (1, 0)), rel_tol), (1, 0))


# ---- the same on a batch of factors (PowerSGD batched: hvd_gradcomp/powersgd_batched.py) ----
def orthogonalize_batched(ops, p, rel_tol: float = DEPENDENT_TOL):
    """:func:`orthogonalize` of each matrix of a batch, in one set of operations for the batch
    (the same steps and guards, the column loop over the r columns; no loop over the batch).

    Args:
        p: float32 [B, n, r] (static shape).

    Returns:
        float32 [B, n, r]: ``out[b]`` equals ``orthogonalize(ops, p[b])`` within float32
        rounding (the same operations in the same order per matrix; a batched product may sum
        in another order than a single one).
    """
    b, n, r = ops.shape(p)
    p = p * (1.0 / ops.maximum(ops.reshape(ops.max(ops.abs(p), 1), (b, 1, r)), _TINY))
    norms0 = ops.norm(p, 1)  # [B, r]
    cols = []
    for j in range(r):
        v, norm0 = p[:, :, j:j + 1], norms0[:, j:j + 1]  # [B, n, 1], [B, 1]
        if cols:
            basis_ = ops.concat(cols, 2) if len(cols) > 1 else cols[0]  # [B, n, j]
            basis_t = ops.transpose(basis_, (0, 2, 1))
            for _ in range(2):
                v = v - ops.matmul(basis_, ops.matmul(basis_t, v))
        norm = ops.norm(v, 1)  # [B, 1]
        keep = norm > norm0 * rel_tol
        scale = ops.where(keep, 1.0 / ops.maximum(norm, _TINY), 0.0)
        cols.append(v * ops.reshape(scale, (b, 1, 1)))
    return ops.concat(cols, 2) if r > 1 else cols[0]


def basis_rows_batched(ops, rel_tol, pt, fillt):
    """:func:`basis_rows` of each matrix of a batch (as a kernel: ``ops.fuse(basis_rows_batched,
    rel_tol)``): ``pt``, ``fillt`` float32 [B, r, n]; returns float32 [B, r, n], each basis'
    columns as rows. A row of ``pt`` that is exactly zero is replaced by ``fillt``'s first."""
    b, r, n = ops.shape(pt)
    top = ops.reshape(ops.max(ops.abs(pt), 2), (b, r, 1))
    zero = ops.logical_and(ops.isfinite(top), ops.where(top > 0.0, False, True))
    p = ops.transpose(ops.where(zero, fillt, pt), (0, 2, 1))
    return ops.transpose(orthogonalize_batched(ops, p, rel_tol), (0, 2, 1))
