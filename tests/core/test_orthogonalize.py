"""Orthogonalisation for PowerSGD (hvd_gradcomp/orthogonalize.py), one process, in each
backend: Gram-Schmidt keeps the span, zero and dependent columns come out zero, extreme scales
and non-finite values are handled, and ``basis`` fills zero columns only. PowerSGD itself is
tested in tests/core/test_powersgd.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.orthogonalize import basis, orthogonalize
from tests.backends import BACKENDS, as_float64, backend_ops, backend_tensor

_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


def _orth(backend, a):
    return _np(orthogonalize(backend_ops(backend), _tensor(backend, a)))


def _assert_orthonormal_or_zero(out, nonzero):
    assert np.isfinite(out).all()
    norms = np.linalg.norm(out, axis=0)
    for j, keep in enumerate(nonzero):
        if keep:
            assert abs(norms[j] - 1.0) < 1e-5, (j, norms)
        else:
            assert (out[:, j] == 0).all(), j
    kept = out[:, list(np.flatnonzero(nonzero))]
    np.testing.assert_allclose(kept.T @ kept, np.eye(kept.shape[1]), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonalize_random_keeps_span(backend):
    a = np.random.default_rng(0).standard_normal((50, 4))
    out = _orth(backend, a)
    _assert_orthonormal_or_zero(out, [True] * 4)
    np.testing.assert_allclose(out @ (out.T @ a), a, atol=1e-5)  # same column space
    # Gram-Schmidt order: the first output column is the first input column, normalised.
    np.testing.assert_allclose(out[:, 0], a[:, 0] / np.linalg.norm(a[:, 0]), atol=1e-6)
    one = _orth(backend, a[:, :1])  # r = 1
    np.testing.assert_allclose(one[:, 0], out[:, 0], atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonalize_zero_and_dependent_columns(backend):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((40, 6))
    a[:, 1] = 0.0  # zero column
    a[:, 2] = 3.0 * a[:, 0]  # dependent
    a[:, 4] = a[:, 0] - 2.0 * a[:, 3]  # dependent on two earlier columns
    _assert_orthonormal_or_zero(_orth(backend, a), [True, False, False, True, False, True])
    zeros = _orth(backend, np.zeros((40, 3)))
    assert (zeros == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_orthogonalize_scale_and_nonfinite(backend):
    a = np.random.default_rng(2).standard_normal((30, 2))
    for scale in (1e-25, 1e25):  # squares would underflow / overflow without the max-abs scaling
        out = _orth(backend, a * scale)
        _assert_orthonormal_or_zero(out, [True, True])
        np.testing.assert_allclose(out, _orth(backend, a), atol=1e-6)
    bad = a.copy()
    bad[3, 0] = np.nan
    assert np.isnan(_orth(backend, bad)).all()  # NaN is never masked into zeros
    bad = a.copy()
    bad[5, 1] = np.inf
    out = _orth(backend, bad)
    assert np.isfinite(out[:, 0]).all() and not np.isfinite(out[:, 1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_basis_fills_zero_columns_only(backend):
    ops = backend_ops(backend)
    rng = np.random.default_rng(3)
    a, fill = rng.standard_normal((20, 3)), rng.standard_normal((20, 3))
    a[:, 1] = 0.0
    out = _np(basis(ops, _tensor(backend, a), _tensor(backend, fill)))
    _assert_orthonormal_or_zero(out, [True, True, True])
    want = a.copy()
    want[:, 1] = fill[:, 1]
    np.testing.assert_allclose(out, _orth(backend, want), atol=1e-6)
    np.testing.assert_allclose(out[:, 0], a[:, 0] / np.linalg.norm(a[:, 0]), atol=1e-6)
    # No zero column: exactly orthogonalize(a); a NaN column is not filled.
    b = rng.standard_normal((20, 3))
    np.testing.assert_array_equal(_np(basis(ops, _tensor(backend, b), _tensor(backend, fill))), _orth(backend, b))
    b[4, 2] = np.nan
    assert np.isnan(_np(basis(ops, _tensor(backend, b), _tensor(backend, fill)))[:, 2]).all()
