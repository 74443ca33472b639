"""The counter-based random number generator (hvd_gradcomp/rng.py), one process.

Its statistics (uniform mean and variance, balanced signs, uncorrelated neighbouring keys)
and that drawing from it leaves the framework's global RNG as it was. That PyTorch and
TensorFlow draw the same bits is a parity test: tests/parity/test_parity.py.
"""
import numpy as np

from hvd_gradcomp import rng
from tests.backends import as_float64, requires_backend

_np = as_float64  # the shared helper of tests/backends.py


@requires_backend("torch")
def test_rng_statistics_and_global_rng_untouched():
    import torch
    from tests.backends import backend_ops
    pt = backend_ops("torch")
    torch.manual_seed(3)
    before = torch.random.get_rng_state().clone()
    u = _np(rng.uniform(pt, rng.stream_key("stats"), 200_000, torch.zeros(1))).astype(np.float64)
    s = _np(rng.signs(pt, 11, 200_000, torch.zeros(1)))
    assert torch.equal(before, torch.random.get_rng_state())
    assert u.min() >= 0 and u.max() < 1
    # Mean 1/2 and variance 1/12 within 5 standard errors; signs balanced likewise.
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / len(u)) ** 0.5
    assert abs(u.var() - 1 / 12) < 5 * (1 / 180 / len(u)) ** 0.5
    assert set(np.unique(s)) == {-1.0, 1.0} and abs(s.mean()) < 5 / len(s) ** 0.5
    # Neighbouring keys give uncorrelated streams.
    v = _np(rng.uniform(pt, rng.stream_key("stats") + 1, 200_000, torch.zeros(1)))
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.02
