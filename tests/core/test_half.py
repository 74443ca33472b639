"""Half-precision gradients and large carried residuals, two ranks simulated in one process
(each rank its own scheme object; payloads summed by hand as Sum, halved as Average), both
backends. Real Horovod runs of the same cases: tests/parallel/test_auto_reliability.py (its part 1).

1. float16/bfloat16 gradients of 2e4 per coordinate on each of 2 ranks (the sum, 4e4, fits
   float16): every step's output is finite and at most 65504, and the ranks' outputs plus
   their pending error feedback sum to the float64 sum of the gradients (nothing lost).
2. ``auto`` on TopKC with one coordinate of 1e6 on one rank, sent to fp16 at its
   first probe: the carry goes out 65504 a step, every step finite but the one a rank's NaN
   poisons, and the whole 1e6 is delivered.
"""
import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from tests.backends import BACKENDS, backend_tensor, one_rank_ops, scheme_of

SHAPE = (64, 64)
SPECS = ("fp16", "topkc:0.1", "thc:4", "powersgd:2",
         "auto:candidates=fp16|topkc:0.1,bandwidth_gbit=0.0001,latency_ms=0.1,warmup=3,every=4")


def _run(backend, spec, op, dtype, grads, steps):
    """``steps`` steps of two ranks; returns outputs as sums (float64), whether each was
    finite, and the ranks' pending error feedback summed after the last (float64)."""
    ops = one_rank_ops(backend)
    schemes = [scheme_of(spec).bind(ops) for _ in range(2)]
    infos = [TensorInfo("w", SHAPE, dtype, 2, r, op) for r in range(2)]
    like = backend_tensor(backend, [0.0])
    states = [s.init(ops, i, like) for s, i in zip(schemes, infos)]
    outs, sent = [], np.zeros(SHAPE)
    for t in range(steps):
        xs = [backend_tensor(backend, grads(r, t), dtype) for r in range(2)]
        for x in xs:
            sent += np.asarray(ops.to_host(ops.cast(x, "float32")), dtype=np.float64)
        pcs = [compress_tensor(schemes[r], ops, xs[r], states[r], infos[r]) for r in range(2)]
        summed = pcs[0][0] + pcs[1][0]
        if op == "average":  # Horovod's Average: integer payloads divide with truncation
            summed = summed // 2 if ops.dtype(summed) == "int32" else summed / 2
        got = []
        for r in range(2):
            out, states[r] = finish_tensor(schemes[r], ops, summed, pcs[r][1], states[r], infos[r])
            assert ops.dtype(out) == dtype
            got.append(np.asarray(ops.to_host(ops.cast(out, "float32")), dtype=np.float64))
        np.testing.assert_array_equal(got[0], got[1])
        outs.append(got[0] * (2 if op == "average" else 1))
    pending = np.zeros(SHAPE)
    for r in range(2):
        res = composite.residual_of(schemes[r], ops, states[r], infos[r])
        if res is not None:
            pending += np.asarray(ops.to_host(res), dtype=np.float64).reshape(SHAPE)
    return outs, sent, pending


def _large(r, t):
    return 2e4 * (1.0 + 0.01 * np.random.default_rng([r, t]).standard_normal(SHAPE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("spec", SPECS)
def test_half_gradients_stay_finite_and_lose_nothing(backend, spec, op, dtype):
    outs, sent, pending = _run(backend, spec, op, dtype, _large, 5)
    for t, out in enumerate(outs):
        assert np.isfinite(out).all(), t
        if dtype == "float16":  # outs are sums: an Average's mean times 2
            assert float(np.abs(out).max()) <= 65504.0 * (1 if op == "sum" else 2), t
    # fp16 payloads (and bfloat16's 8 bits) round each step: 5 steps of 2e4 * 2 ranks
    tol = 1e-2 if dtype == "bfloat16" else 2e-3
    assert np.linalg.norm(sum(outs) + pending - sent) <= tol * np.linalg.norm(sent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_carry_of_a_large_residual_saturates_and_is_delivered(backend):
    """After the sync step (step 0, exact), TopKC keeps the 1e6 of step 1 it cannot send (its
    payload saturates); the step gate
    sends the tensor to fp16 at the probe (step 2), the residual becomes the carry, which
    goes out at most 65504 a step: all finite, rank 1's NaN at step 8 fails that step only,
    and after 24 steps the 1e6 is delivered (nothing pending)."""
    def grads(r, t):
        g = 0.01 * np.random.default_rng([r, t]).standard_normal(SHAPE)
        if t == 1 and r == 0:
            g[3, 5] = 1e6
        if t == 8 and r == 1:
            g[0, 0] = np.nan
        return g
    spec = ("auto:candidates=fp16|topkc:0.1,bandwidth_gbit=0.0001,latency_ms=0.1,warmup=3,every=4,"
            "step_penalty=1000000")
    outs, sent, pending = _run(backend, spec, "sum", "float32", grads, 24)
    assert [int(not np.isfinite(o).all()) for o in outs] == [0] * 8 + [1] + [0] * 15
    good = [o for t, o in enumerate(outs) if t != 8]
    assert max(np.abs(o).max() for o in good) <= 65504.0
    expected = sum(grads(0, t) + grads(1, t) for t in range(24) if t != 8)
    np.testing.assert_allclose(sum(good)[3, 5], 1e6, rtol=1e-3)
    assert np.abs(pending).max() == 0.0
    assert np.linalg.norm(sum(good) - expected) <= 1e-3 * np.linalg.norm(expected)
