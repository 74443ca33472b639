"""PowerSGD and its orthogonalisation, one process, at the scheme level.

Collectives: a single process never reaches compress through Horovod (Horovod skips
compression at size 1), so these tests call the scheme directly with
``one_rank_ops(backend)``: the backend's primitives with the side all-reduce replaced by the
identity, which is exactly what an all-reduce over one rank does. Everything multi-rank
(real Horovod, 2 ranks) is in tests/parallel/test_powersgd_parallel.py.
"""

import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo, WireBytes, compress_tensor, decompress_tensor
from hvd_gradcomp.cast import Fp16Scheme
from hvd_gradcomp.orthogonalize import orthogonalize
from hvd_gradcomp.powersgd import PowerSGDConfig, PowerSGDScheme, PowerSGDState
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from tests.conftest import BACKENDS, backend_ops, one_rank_ops, scheme_steps


def _tensor(backend, values, dtype="float32"):
    if backend == "torch":
        import torch
        from torch_backend.ops import to_torch_dtype
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(to_torch_dtype(dtype))
    import tensorflow as tf
    return tf.cast(tf.constant(np.asarray(values, dtype=np.float64)), dtype)


def _np(x):
    if hasattr(x, "detach"):
        import torch
        return x.detach().to(torch.float64).numpy()
    import tensorflow as tf
    return np.asarray(tf.cast(x, tf.float64))


def _low_rank(n, m, k, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, k)) @ rng.standard_normal((k, m))


def _steps(backend, scheme, grads, key="w", world_size=1):
    """:func:`tests.conftest.scheme_steps` over ``grads`` (NumPy arrays) on one backend."""
    ops = one_rank_ops(backend)
    xs = [_tensor(backend, g) for g in grads]
    return scheme_steps(ops, scheme, xs, TensorInfo(key, ops.shape(xs[0]), ops.dtype(xs[0]), world_size, 0))


# ---------------------------------------------------------------- configuration and policy
def test_config_defaults_and_errors():
    cfg = PowerSGDConfig()
    assert (cfg.rank, cfg.min_compression_rate, cfg.start_step, cfg.error_feedback,
            cfg.warm_start, cfg.seed, cfg.uncompressed_dtype) == (1, 2.0, 0, True, True, 0, "float16")
    with pytest.raises(ValueError, match=r"^powersgd: rank must be an integer >= 1, got 0$"):
        PowerSGDConfig(rank=0)
    bad = [dict(rank=1.5), dict(rank=True), dict(min_compression_rate=0.5),
           dict(min_compression_rate="2"), dict(start_step=-1), dict(start_step=1.0),
           dict(error_feedback=1), dict(warm_start=None), dict(seed="a"),
           dict(uncompressed_dtype="bfloat16")]
    for options in bad:
        with pytest.raises(ValueError, match=r"^powersgd: "):
            PowerSGDConfig(**options)


def test_spec_roundtrip():
    scheme = make_scheme("powersgd", rank=4, start_step=10)
    assert to_spec(scheme) == "powersgd:rank=4,start_step=10"
    name, options = parse_spec("powersgd:rank=2,warm_start=false,min_compression_rate=3")
    assert name == "powersgd" and options == {"rank": 2, "warm_start": False, "min_compression_rate": 3.0}
    assert make_scheme(name, **options).config == PowerSGDConfig(rank=2, warm_start=False,
                                                                   min_compression_rate=3.0)


@pytest.mark.parametrize("shape,rank,expected", [
    ((), 1, None),  # scalar
    ((7,), 1, None),  # vector (bias)
    ((0, 5), 1, None),  # empty
    ((5, 0), 1, None),
    ((3, 3), 1, None),  # 1 * 6 * 2 = 12 > 9
    ((4, 4), 1, (4, 4)),  # 1 * 8 * 2 = 16 <= 16: the boundary is compressed
    ((64, 48), 1, (64, 48)),
    ((8, 4, 3, 3), 1, (8, 36)),  # conv kernel: first dimension by the rest
    ((10, 64), 4, (10, 64)),  # 4 * 74 * 2 = 592 <= 640
    ((10, 64), 5, None),  # 5 * 74 * 2 = 740 > 640
    ((1, 1000), 1, None),
])
def test_policy_and_wire(shape, rank, expected):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=rank))
    info = TensorInfo("t", shape, "float32", 4, 0)
    assert scheme.matrix_shape(info) == expected
    if expected is None:
        assert scheme.wire(info) == WireBytes(2 * info.numel)
        wide = PowerSGDScheme(PowerSGDConfig(rank=rank, uncompressed_dtype="float32"))
        assert wide.wire(info) == WireBytes(4 * info.numel)
    else:
        n, m = expected
        assert scheme.wire(info) == WireBytes(4 * rank * m, 4 * rank * n, 1)


def test_min_compression_rate_moves_the_boundary():
    info = TensorInfo("t", (16, 16), "float32", 2, 0)
    assert PowerSGDScheme(PowerSGDConfig(rank=2, min_compression_rate=4.0)).matrix_shape(info) == (16, 16)
    assert PowerSGDScheme(PowerSGDConfig(rank=2, min_compression_rate=4.1)).matrix_shape(info) is None


# ---------------------------------------------------------------- orthogonalize
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


# ---------------------------------------------------------------- the scheme's math
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("warm_start", [True, False])
def test_exact_low_rank_recovered_at_first_step(backend, rank, warm_start):
    """A matrix of rank <= r is reproduced to float32 precision, residual ~ 0, from step 1."""
    scheme = PowerSGDScheme(PowerSGDConfig(rank=rank, warm_start=warm_start))
    for k in sorted({1, rank}):
        a = _low_rank(48, 40, k, seed=10 + k)
        log = _steps(backend, scheme, [a, a, 0.5 * a])
        for i, step in enumerate(log):
            want = a if i < 2 else 0.5 * a
            out = _np(step["out"])
            np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * np.abs(want).max())
            assert np.abs(_np(step["after"].residual)).max() < 2e-5 * np.abs(want).max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_warm_start_converges_to_best_rank_r(backend):
    """Without EF, repeating one matrix: warm start is subspace iteration, reaching the SVD error."""
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    v, _ = np.linalg.qr(rng.standard_normal((50, 50)))
    s = 0.6 ** np.arange(50)
    a = (u[:, :50] * s) @ v.T
    best = np.linalg.norm(a - (u[:, :2] * s[:2]) @ v[:, :2].T)
    warm = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False)), [a] * 25)
    cold = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False,
                                                         warm_start=False)), [a] * 25)
    err_warm = [np.linalg.norm(_np(x["out"]) - a) for x in warm]
    err_cold = [np.linalg.norm(_np(x["out"]) - a) for x in cold]
    assert err_warm[-1] < best * 1.01, (err_warm[-1], best)
    assert err_warm[-1] < err_warm[0] and np.mean(err_cold[5:]) > err_warm[-1] * 1.05
    q = _np(warm[-1]["after"].q)  # unit rows (= Q's columns), aligned with the top singular vectors
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.abs(q @ v[:, :2]), np.eye(2), atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_feedback_identity_float64(backend):
    """M = G + E_old == P Q_local^T + E_new, with the local decode, over several steps.

    Warm-up steps are the fp16 baseline, whose rounding is not fed back (residual zero, see
    test_start_step_warm_up), so the identity is checked from start_step on.
    """
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal((32, 24)) for _ in range(5)]
    for cfg in (PowerSGDConfig(rank=2), PowerSGDConfig(rank=1, start_step=2, warm_start=False)):
        log = _steps(backend, PowerSGDScheme(cfg), grads)
        for step, g in list(zip(log, grads))[cfg.start_step:]:
            corrected = g + _np(step["old"].residual)
            rebuilt = _np(step["out"]) + _np(step["after"].residual)
            np.testing.assert_allclose(rebuilt, corrected, rtol=0, atol=1e-5 * np.abs(corrected).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_zeros_give_exact_zeros_and_keep_q(backend):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    a = _low_rank(30, 20, 2, seed=5)
    log = _steps(backend, scheme, [np.zeros((30, 20)), np.zeros((30, 20)), a])
    for step in log[:2]:
        out = _np(step["out"])
        assert (out == 0).all() and (_np(step["after"].residual) == 0).all()
        np.testing.assert_array_equal(_np(step["after"].q), _np(log[0]["old"].q))  # not poisoned
    np.testing.assert_allclose(_np(log[2]["out"]), a, atol=2e-5 * np.abs(a).max())
    assert [int(_np(s["after"].step)) for s in log] == [1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_keeps_state_and_reaches_output(backend):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    rng = np.random.default_rng(6)
    g0, g2 = rng.standard_normal((30, 20)), rng.standard_normal((30, 20))
    bad = rng.standard_normal((30, 20))
    bad[4, 7] = np.nan
    log = _steps(backend, scheme, [g0, bad, g2])
    assert np.isnan(_np(log[1]["out"])).all() and np.isnan(_np(log[1]["payload"])).all()
    for field in ("residual", "q"):
        np.testing.assert_array_equal(_np(getattr(log[1]["after"], field)),
                                      _np(getattr(log[1]["old"], field)))
    assert int(_np(log[1]["after"].step)) == 2  # the counter still advances (same on all ranks)
    assert np.isfinite(_np(log[2]["out"])).all()
    # The vector path (fp16) carries NaN through the cast.
    vec = np.ones(9)
    vec[2] = np.inf
    out = _np(_steps(backend, scheme, [vec], key="b")[0]["out"])
    assert not np.isfinite(out[2]) and np.isfinite(np.delete(out, 2)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_uncompressed_tensors_follow_fp16_or_float32(backend):
    ops = one_rank_ops(backend)
    rng = np.random.default_rng(7)
    for shape in [(), (9,), (3, 3), (2, 2, 2)]:
        g = rng.standard_normal(shape) * 100
        out = _np(_steps(backend, PowerSGDScheme(), [g], world_size=2)[0]["out"])
        x = _tensor(backend, g)
        info = TensorInfo("w", shape, "float32", 2, 0)
        ref = _np(Fp16Scheme().decompress(ops, Fp16Scheme().compress(ops, x, (), info, None)[0], None, info))
        np.testing.assert_array_equal(out, ref.reshape(shape))
        wide = PowerSGDScheme(PowerSGDConfig(uncompressed_dtype="float32"))
        np.testing.assert_array_equal(_np(_steps(backend, wide, [g])[0]["out"]), _np(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_step_warm_up(backend):
    """Before start_step: fp16 round trip, payload of the same size, Q untouched; then PowerSGD."""
    ops = one_rank_ops(backend)
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal((24, 20)) for _ in range(4)]
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, start_step=2))
    plain = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2)), grads[2:])
    log = _steps(backend, scheme, grads)
    info = TensorInfo("w", (24, 20), "float32", 1, 0)
    for i in range(2):
        x = _tensor(backend, grads[i])
        fp16 = _np(Fp16Scheme().decompress(ops, Fp16Scheme().compress(ops, x, (), info, None)[0], None, info))
        np.testing.assert_array_equal(_np(log[i]["out"]), fp16)
        np.testing.assert_array_equal(_np(log[i]["after"].q), _np(log[0]["old"].q))
        assert (_np(log[i]["after"].residual) == 0).all()
    # From step 2 on it is exactly PowerSGD started fresh (the warm-up left no trace).
    for a, b in zip(log[2:], plain):
        np.testing.assert_array_equal(_np(a["out"]), _np(b["out"]))
    sizes = {tuple(ops.shape(s["payload"])) for s in log}
    assert sizes == {(40,)}
    assert [int(_np(s["after"].step)) for s in log] == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_inputs_keep_dtype(backend):
    ops = one_rank_ops(backend)
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    a = _low_rank(16, 12, 2, seed=9)
    for dtype in ("float16", "bfloat16", "float64"):
        x = _tensor(backend, a, dtype)
        info = TensorInfo("w", (16, 12), dtype, 1, 0)
        payload, ctx, _ = compress_tensor(scheme, ops, x, scheme.init(ops, info, x), info)
        out = decompress_tensor(scheme, ops, payload, ctx, info)
        assert ops.dtype(out) == dtype and tuple(ops.shape(out)) == (16, 12)
        assert ops.dtype(payload) == "float32"
        np.testing.assert_allclose(_np(out), _np(x), atol=2e-2 * np.abs(a).max())


# ---------------------------------------------------------------- frameworks agree
def _tf_graph_steps(scheme, grads, key="w"):
    """The TensorFlow run of _steps, each step one tf.function call (state passed through)."""
    import tensorflow as tf
    ops = one_rank_ops("tensorflow")
    info = TensorInfo(key, tuple(np.shape(grads[0])), "float32", 1, 0)
    state = scheme.init(ops, info, None)

    @tf.function
    def step(x, *fields):
        payload, ctx, new = compress_tensor(scheme, ops, x, PowerSGDState(*fields), info)
        out = decompress_tensor(scheme, ops, payload, ctx, info)
        return out, tuple(scheme.absorb(ops, payload, ctx, new, info))

    outs = []
    for g in grads:
        out, fields = step(tf.constant(g, tf.float32), *state)
        state = PowerSGDState(*fields)
        outs.append(out.numpy().astype(np.float64))
    return outs, state


@pytest.mark.skipif(set(BACKENDS) != {"torch", "tensorflow"}, reason="needs both backends")
def test_torch_tensorflow_parity_eager_and_tf_function():
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal((40, 3, 2, 2)) for _ in range(5)]
    for cfg in (PowerSGDConfig(rank=2), PowerSGDConfig(rank=3, start_step=2, warm_start=False)):
        scheme = PowerSGDScheme(cfg)
        # The first Q comes from the counter-based generator: bit-identical in both frameworks.
        np.testing.assert_array_equal(
            _np(scheme.init(one_rank_ops("torch"), TensorInfo("w", (40, 12), "float32", 1, 0), None).q),
            _np(scheme.init(one_rank_ops("tensorflow"), TensorInfo("w", (40, 12), "float32", 1, 0), None).q))
        torch_log = _steps("torch", scheme, grads)
        tf_log = _steps("tensorflow", scheme, grads)
        graph_outs, graph_state = _tf_graph_steps(scheme, grads)
        for a, b, c in zip(torch_log, tf_log, graph_outs):
            np.testing.assert_allclose(_np(a["out"]), _np(b["out"]), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(_np(b["out"]), c, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(_np(torch_log[-1]["after"].residual), _np(graph_state.residual), atol=1e-4)
        assert int(_np(graph_state.step)) == len(grads)
