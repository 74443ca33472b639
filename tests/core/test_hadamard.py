"""Walsh-Hadamard transform and randomized Hadamard rotation (hvd_gradcomp/hadamard.py), one process.

Checked in each backend against float64 references: the Sylvester matrices against SciPy's,
the factored transform against the float64 Walsh-Hadamard transform of tests/reference.py, and
the rotation (full and every partial block size) for orthonormality, invertibility and the +-1
diagonal. How THC keeps its diagonal per tensor is in tests/core/test_thc.py; both frameworks giving
the same results is in tests/parity/.
"""
import math

import numpy as np
import pytest

from hvd_gradcomp import hadamard
from tests.backends import BACKENDS, as_float64, backend_ops, backend_tensor
from tests.reference import fwht64

_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


@pytest.mark.parametrize("backend", BACKENDS)
def test_hadamard_matches_sylvester(backend):
    import scipy.linalg
    ops = backend_ops(backend)
    for size in [1, 2, 4, 8, 16, 32, 64]:
        np.testing.assert_array_equal(_np(hadamard.sylvester(ops, size, None)), scipy.linalg.hadamard(size))
    rng = np.random.default_rng(0)
    for block in [1, 2, 8, 64, 128, 2048, 2 ** 13]:
        assert math.prod(hadamard.factor_sizes(block)) == block
        assert max(hadamard.factor_sizes(block)) <= hadamard.MAX_FACTOR
        x = rng.standard_normal(3 * block).astype(np.float32)
        got = _np(hadamard.wht(ops, _tensor(backend, x), hadamard.hadamard_factors(ops, block, None)))
        np.testing.assert_allclose(got, fwht64(x, block), rtol=0, atol=1e-4 * math.sqrt(block))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [1000, 1024, 3000, 4097])
def test_rotation_orthonormal_and_invertible(backend, d):
    """inverse(forward(x)) == x to float32 precision and ||forward(x)|| == ||x||, every k."""
    ops = backend_ops(backend)
    rng = np.random.default_rng(d)
    x = rng.standard_normal(d).astype(np.float32)
    for stages in list(range(1, (d - 1).bit_length() + 1)) + [None]:
        block = hadamard.block_size(d, stages)
        padded = hadamard.padded_size(d, block)
        assert padded % block == 0 and padded - d < block
        xp = _tensor(backend, np.concatenate([x, np.zeros(padded - d, np.float32)]))
        diag = hadamard.rademacher(ops, 1234 + d, padded, xp, 1.0 / math.sqrt(block))
        factors = hadamard.hadamard_factors(ops, block, xp)
        y = hadamard.rht(ops, xp, diag, factors)
        back = _np(hadamard.irht(ops, y, diag, factors))[:d]
        assert abs(np.linalg.norm(_np(y).astype(np.float64)) / np.linalg.norm(x) - 1) < 1e-5, stages
        np.testing.assert_allclose(back, x, rtol=0, atol=2e-6 * np.abs(x).max() * max(1, math.log2(block)))
        # The +-1 diagonal: exactly +-1/sqrt(B), about half of each sign.
        signs = _np(diag) * math.sqrt(block)
        assert np.allclose(np.abs(signs), 1, atol=1e-6) and abs((signs > 0).mean() - 0.5) < 0.1


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_exact_on_integers(backend):
    """With even log2(B) (1/sqrt(B) a power of two) and small integers every step is exact."""
    ops = backend_ops(backend)
    x = np.random.default_rng(5).integers(-8, 9, 4096).astype(np.float32)
    for block in [4, 16, 1024, 4096]:
        xt = _tensor(backend, x)
        diag = hadamard.rademacher(ops, 99, 4096, xt, 1.0 / math.sqrt(block))
        factors = hadamard.hadamard_factors(ops, block, xt)
        np.testing.assert_array_equal(_np(hadamard.irht(ops, hadamard.rht(ops, xt, diag, factors), diag, factors)), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [8, 1024, 2 ** 13, 2 ** 22])
def test_nested_factors_are_sylvester_corners(backend, block):
    """One Sylvester matrix of the largest factor size gives every factor as its top-left
    corner: the factor sizes, each the Sylvester matrix of its own size (built on its own),
    and the same transform."""
    ops = backend_ops(backend)
    like = backend_tensor(backend, np.zeros(1))
    sizes = hadamard.factor_sizes(block)
    nested = hadamard.nested_factors(block, hadamard.sylvester(ops, max(sizes), like))
    assert [s for s, _ in nested] == [s for s, _ in hadamard.hadamard_factors(ops, block, like)] == sizes
    for s, a in nested:
        np.testing.assert_array_equal(as_float64(a), as_float64(hadamard.sylvester(ops, s, like)))
    if block <= 2 ** 13:
        x = np.random.default_rng(block).standard_normal(2 * block)
        np.testing.assert_allclose(as_float64(hadamard.wht(ops, backend_tensor(backend, x), nested)),
                                   fwht64(x, block), rtol=1e-5, atol=1e-4 * math.sqrt(block))
