"""The matrix view of a gradient and the products PowerSGD takes with it, in the view's
plain layout (no ``n x m`` transpose is ever materialised); used by :mod:`~hvd_gradcomp.powersgd`.

``M`` is ``n x m`` with output channels as rows; factors are held transposed: ``P^T`` [r, n],
``Q^T`` [r, m], float32.
"""
from typing import NamedTuple

__all__ = ["View", "matrix_view", "transposed", "times_right", "times_left", "outer", "minus_outer", "pad",
           "transposed_batch", "times_right_batch", "times_left_batch", "outer_batch", "pad_batch"]


class View(NamedTuple):
    n: int  # rows of M (output channels)
    m: int  # columns of M
    transposed: bool  # the tensor's plain reshape is M^T [m, n] (TensorFlow kernels, ndim >= 3)

    @property
    def natural(self):
        """Shape of the tensor's plain 2-D reshape."""
        return (self.m, self.n) if self.transposed else (self.n, self.m)


def matrix_view(shape, layout: str):
    """``(n, m, transposed)`` of the matrix view (docs/powersgd.md, step 1), for any ndim >= 2.

    ``layout`` is the backend's ``ops.name``: ``"tensorflow"`` puts ``shape[-1]`` (the output
    channels of a kernel ``(h, w, in, out)``) as rows for ndim >= 3; anything else takes
    ``shape[0]`` (PyTorch's ``(out, in, h, w)``).
    """
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) >= 3 and layout == "tensorflow":
        n = shape[-1]
        return View(n, numel // n if n else 0, True)
    n = shape[0]
    return View(n, numel // n if n else 0, False)


# ---- products with M held in its plain layout (no n x m transpose) ----
def transposed(ops, x):
    """``x`` [a, b] as [b, a] (the small factors only)."""
    return ops.transpose(x, (1, 0))


def times_right(ops, mat, ft, v):
    """``(M F)^T`` [r, n] for ``ft = F^T`` [r, m]."""
    if v.transposed:  # mat = M^T [m, n]
        return ops.matmul(ft, mat)
    return transposed(ops, ops.matmul(mat, transposed(ops, ft)))


def times_left(ops, mat, ft, v):
    """``(M^T F)^T = F^T M`` [r, m] for ``ft = F^T`` [r, n]."""
    if v.transposed:
        return transposed(ops, ops.matmul(mat, transposed(ops, ft)))
    return ops.matmul(ft, mat)


def outer(ops, pt, qt, v):
    """``P Q^T`` in the plain layout, from ``pt = P^T`` [r, n] and ``qt = Q^T`` [r, m]."""
    if v.transposed:
        return ops.matmul(transposed(ops, qt), pt)
    return ops.matmul(transposed(ops, pt), qt)


def minus_outer(ops, mat, pt, qt, v):
    """``mat - P Q^T`` in the plain layout; ``mat`` (a temporary of this step) may be updated
    in place (``ops.addmm``)."""
    if v.transposed:
        return ops.addmm(mat, transposed(ops, qt), pt, -1.0)
    return ops.addmm(mat, transposed(ops, pt), qt, -1.0)


def pad(ops, x, width):
    """[r, w] zero-padded on the right to [r, width]."""
    r, w = ops.shape(x)
    return x if w == width else ops.concat([x, ops.zeros((r, width - w), "float32", x)], 1)


# ---- the same on a batch of equal views (PowerSGD batched: hvd_gradcomp/powersgd_batched.py) ----
# ``mats`` [B, *v.natural], factors [B, r, n] / [B, r, m]; each product is one batched matmul.
def transposed_batch(ops, x):
    """``x`` [B, a, b] as [B, b, a]."""
    return ops.transpose(x, (0, 2, 1))


def times_right_batch(ops, mats, ft, v):
    """``(M_b F_b)^T`` [B, r, n] for ``ft`` = ``F_b^T`` [B, r, m]: :func:`times_right` per matrix."""
    if v.transposed:  # mats = M^T [B, m, n]
        return ops.matmul(ft, mats)
    return ops.matmul(ft, transposed_batch(ops, mats))


def times_left_batch(ops, mats, ft, v):
    """``F_b^T M_b`` [B, r, m] for ``ft`` [B, r, n]: :func:`times_left` per matrix."""
    if v.transposed:
        return ops.matmul(ft, transposed_batch(ops, mats))
    return ops.matmul(ft, mats)


def outer_batch(ops, pt, qt, v):
    """``P_b Q_b^T`` in the plain layout [B, *v.natural]: :func:`outer` per matrix."""
    if v.transposed:
        return ops.matmul(transposed_batch(ops, qt), pt)
    return ops.matmul(transposed_batch(ops, pt), qt)


def pad_batch(ops, x, width):
    """[B, r, w] zero-padded on the right to [B, r, width]."""
    b, r, w = ops.shape(x)
    return x if w == width else ops.concat([x, ops.zeros((b, r, width - w), "float32", x)], 2)
