"""PowerSGD and its orthogonalisation, one process, at the scheme level.

Collectives: a single process never reaches compress through Horovod (Horovod skips
compression at size 1), so these tests call the scheme directly with
``one_rank_ops(backend)``: the backend's primitives with the side all-reduce replaced by the
identity, which is exactly what an all-reduce over one rank does. Several ranks of the
(collective-free) alternating variant are simulated in one process by summing their payloads
(tests/core/powersgd_emulation.py; their tests: tests/core/test_powersgd_ranks.py); real
Horovod with 2 ranks is in tests/parallel/test_powersgd.py.
"""

import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo, WireBytes, compress_tensor, finish_tensor
from hvd_gradcomp.cast import Fp16Scheme
from hvd_gradcomp.powersgd import (CONTROL, STATE_VERSION, PowerSGDConfig, PowerSGDScheme, PowerSGDState,
                                   matrix_view)
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from hvd_gradcomp.routing import Routing
from tests.backends import BACKENDS, as_float64, backend_tensor, backend_unusable, one_rank_ops, scheme_steps
from tests.core.powersgd_emulation import rank_grads, simulate
from tests.reference import gram_schmidt64

TWO = dict(variant="two_round")


_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


def _low_rank(n, m, k, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, k)) @ rng.standard_normal((k, m))


def _steps(backend, scheme, grads, key="w", world_size=1):
    """:func:`tests.conftest.scheme_steps` over ``grads`` (NumPy arrays) on one backend."""
    ops = one_rank_ops(backend)
    xs = [_tensor(backend, g) for g in grads]
    return scheme_steps(ops, scheme, xs, TensorInfo(key, ops.shape(xs[0]), ops.dtype(xs[0]), world_size, 0))


def _routed(scheme, shape, key="w"):
    """The scheme a compressor of ``scheme`` sends a float32 tensor of ``shape`` with: the
    routing's decision (``scheme`` itself, or its fallback where it does not accept it)."""
    return Routing.single(scheme).decide(key, TensorInfo(key, tuple(shape), "float32", 1, 0)).scheme


# ---------------------------------------------------------------- configuration and policy
def test_config_defaults_and_errors():
    cfg = PowerSGDConfig()
    assert (cfg.rank, cfg.min_compression_rate, cfg.start_step, cfg.error_feedback, cfg.warm_start,
            cfg.seed, cfg.uncompressed_dtype, cfg.variant) == (1, 2.0, 0, True, True, 0, "float16", "alternating")
    assert not PowerSGDScheme().blocking and PowerSGDScheme(PowerSGDConfig(**TWO)).blocking
    with pytest.raises(ValueError, match=r"^powersgd: rank must be an integer >= 1, got 0$"):
        PowerSGDConfig(rank=0)
    bad = [dict(rank=1.5), dict(rank=True), dict(min_compression_rate=0.5),
           dict(min_compression_rate="2"), dict(start_step=-1), dict(start_step=1.0, **TWO),
           dict(error_feedback=1), dict(warm_start=None), dict(seed="a"),
           dict(uncompressed_dtype="bfloat16"), dict(variant="acp")]
    for options in bad:
        with pytest.raises(ValueError, match=r"^powersgd: "):
            PowerSGDConfig(**options)
    with pytest.raises(ValueError, match=r"^powersgd: start_step=3 needs variant='two_round'.*side collective"):
        PowerSGDConfig(start_step=3)
    with pytest.raises(ValueError, match=r"^powersgd: warm_start=False needs variant='two_round'"):
        PowerSGDConfig(warm_start=False)
    PowerSGDConfig(start_step=3, warm_start=False, **TWO)  # fine there


def test_spec_roundtrip():
    scheme = make_scheme("powersgd", rank=4, start_step=10, variant="two_round")
    assert to_spec(scheme) == "powersgd:rank=4,start_step=10,variant=two_round"
    name, options = parse_spec("powersgd:rank=2,warm_start=false,min_compression_rate=3,variant=two_round")
    assert name == "powersgd" and options == {"rank": 2, "warm_start": False, "min_compression_rate": 3.0,
                                              "variant": "two_round"}
    assert make_scheme(name, **options).config == PowerSGDConfig(rank=2, warm_start=False,
                                                                   min_compression_rate=3.0, **TWO)
    assert to_spec(make_scheme("powersgd", rank=2)) == "powersgd:rank=2"


@pytest.mark.parametrize("shape,layout,view", [
    ((64, 48), "torch", (64, 48, False)),
    ((64, 48), "tensorflow", (64, 48, False)),  # 2-D: shape[0] rows in both
    ((8, 4, 3, 3), "torch", (8, 36, False)),  # (out, in, h, w) -> out x (in h w)
    ((3, 3, 4, 8), "tensorflow", (8, 36, True)),  # (h, w, in, out) -> out x (h w in), stored as M^T
    ((5, 6, 7), "tensorflow", (7, 30, True)),  # conv1d (w, in, out)
])
def test_matrix_view_puts_output_channels_on_rows(shape, layout, view):
    assert tuple(matrix_view(shape, layout)) == view


@pytest.mark.parametrize("shape,rank,expected", [
    ((), 1, None),  # scalar
    ((7,), 1, None),  # vector (bias)
    ((0, 5), 1, None),  # empty
    ((5, 0), 1, None),
    ((3, 3), 1, None),  # 1 * 6 * 2 = 12 > 9
    ((4, 4), 1, (4, 4)),  # 1 * 8 * 2 = 16 <= 16: the boundary is compressed
    ((64, 48), 1, (64, 48)),
    ((8, 4, 3, 3), 1, (8, 36)),  # conv kernel: first dimension by the rest (PyTorch)
    ((10, 64), 4, (10, 64)),  # 4 * 74 * 2 = 592 <= 640
    ((10, 64), 5, None),  # 5 * 74 * 2 = 740 > 640
    ((1, 1000), 1, None),
])
def test_policy_and_wire(shape, rank, expected):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=rank))
    two = PowerSGDScheme(PowerSGDConfig(rank=rank, **TWO))
    info = TensorInfo("t", shape, "float32", 4, 0)
    assert scheme.matrix_shape(info) == expected
    assert scheme.accepts(info) == two.accepts(info) == (expected is not None)
    if expected is None:  # the routing sends it as fp16, or as it is with uncompressed_dtype=float32
        assert _routed(scheme, shape).wire(info) == _routed(two, shape).wire(info) == WireBytes(2 * info.numel)
        wide = PowerSGDScheme(PowerSGDConfig(rank=rank, uncompressed_dtype="float32"))
        assert not wide.accepts(info) and _routed(wide, shape).wire(info) == WireBytes(4 * info.numel)
        with pytest.raises(ValueError, match="accepts"):
            scheme.wire(info)
    else:
        n, m = expected
        # One all-reduce of r max(n, m) + 6 floats, no side collective; two-round: Q + P.
        assert scheme.wire(info) == WireBytes(4 * (rank * max(n, m) + CONTROL))
        assert two.wire(info) == WireBytes(4 * rank * m, 4 * rank * n, 1)


def test_wire_follows_the_layout():
    info = TensorInfo("k", (3, 3, 4, 8), "float32", 2, 0)  # a TensorFlow kernel: 8 x 36
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    assert scheme.matrix_shape(info, "tensorflow") == (8, 36)
    assert scheme.matrix_shape(info, "torch") is None  # 3 x 96 read PyTorch's way: 2 * 99 * 2 > 288
    assert scheme.wire(info, "tensorflow") == WireBytes(4 * (2 * 36 + CONTROL))
    if backend_unusable("tensorflow") is None:  # without a layout, wire() uses the backend the scheme ran with
        scheme.init(one_rank_ops("tensorflow"), info, None)
        assert scheme.wire(info) == WireBytes(4 * (2 * 36 + CONTROL))


def test_min_compression_rate_moves_the_boundary():
    info = TensorInfo("t", (16, 16), "float32", 2, 0)
    assert PowerSGDScheme(PowerSGDConfig(rank=2, min_compression_rate=4.0)).matrix_shape(info) == (16, 16)
    assert PowerSGDScheme(PowerSGDConfig(rank=2, min_compression_rate=4.1)).matrix_shape(info) is None


# ---------------------------------------------------------------- the alternating variant
_orth64 = gram_schmidt64  # tests/reference.py


@pytest.mark.parametrize("backend", BACKENDS)
def test_alternating_even_and_odd_steps_payload_and_control(backend):
    """Even steps send M Q^, odd steps M^T P^, in one fixed-size payload with its controls."""
    rng = np.random.default_rng(20)
    n, m, r = 12, 30, 2
    grads = [rng.standard_normal((n, m)) for _ in range(4)]
    scheme = PowerSGDScheme(PowerSGDConfig(rank=r, error_feedback=False))
    log = _steps(backend, scheme, grads)
    q0 = _np(log[0]["old"].q).T
    np.testing.assert_allclose(q0.T @ q0, np.eye(r), atol=1e-6)  # the first Q^ is orthonormal
    for t, step in enumerate(log):
        payload, old = _np(step["payload"]), step["old"]
        assert payload.shape == (r * m + CONTROL,)  # K = max(n, m) = m at every step
        factor, control = payload[:r * m].reshape(r, m), payload[r * m:]
        assert int(_np(old.step)) == t
        if t % 2 == 0:
            np.testing.assert_allclose(factor[:, :n], (grads[t] @ _np(old.q).T).T, rtol=1e-5, atol=1e-5)
            assert (factor[:, n:] == 0).all()  # padding
            np.testing.assert_allclose(_np(step["out"]), factor[:, :n].T @ _np(old.q), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(factor, (grads[t].T @ _np(old.p).T).T, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(_np(step["out"]), _np(old.p).T @ factor, rtol=1e-5, atol=1e-5)
        assert list(control[:2]) == ([1.0, 0.0] if t % 2 == 0 else [0.0, 1.0])
        np.testing.assert_allclose(control[[3, 5]], control[[2, 4]] ** 2, rtol=1e-6)
        after = step["after"]
        assert int(_np(after.step)) == t + 1 and int(_np(after.realigned)) == 0
        # The factor that arrived becomes the orthonormal basis of the next step; the other stays.
        arrived, kept = ("p", "q") if t % 2 == 0 else ("q", "p")
        new = _np(getattr(after, arrived)).T
        np.testing.assert_allclose(new.T @ new, np.eye(r), atol=1e-5)
        np.testing.assert_allclose(new, _orth64(factor[:, :new.shape[0]].T), atol=1e-5)
        np.testing.assert_array_equal(_np(getattr(after, kept)), _np(getattr(old, kept)))
        assert int(_np(after.version)) == STATE_VERSION


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["alternating", "two_round"])
def test_error_feedback_identity_float64(backend, variant):
    """M = G + E_old == (local decode) + E_new over several steps; one rank, so the local
    decode is the output. Two-round warm-up steps are the fp16 baseline, whose rounding is not
    fed back (residual zero, see test_start_step_warm_up): checked from start_step on."""
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal((32, 24)) for _ in range(6)]
    cfgs = [PowerSGDConfig(rank=2, variant=variant)]
    if variant == "two_round":
        cfgs.append(PowerSGDConfig(rank=1, start_step=2, warm_start=False, **TWO))
    for cfg in cfgs:
        log = _steps(backend, PowerSGDScheme(cfg), grads)
        for step, g in list(zip(log, grads))[cfg.start_step:]:
            corrected = g + _np(step["old"].residual)
            rebuilt = _np(step["out"]) + _np(step["after"].residual)
            np.testing.assert_allclose(rebuilt, corrected, rtol=0, atol=1e-5 * np.abs(corrected).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_alternating_low_rank_exact(backend, rank):
    """A repeated matrix of rank <= r. Without error feedback: exact from step 1 (P^ = orth(A Q0)
    spans A's columns, then Q^ = orth(A^T P^) its rows). With error feedback: every odd step
    leaves a zero residual (its P^ spans the columns of A and of the residual), so the outputs
    summed up to an odd step equal the gradients summed; the even steps project on a basis
    taken from A + E, which tends to A's rows (module docstring)."""
    for k in sorted({1, rank}):
        a = _low_rank(48, 40, k, seed=10 + k)
        scale = np.abs(a).max()
        plain = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=rank, error_feedback=False)), [a] * 4)
        for step in plain[1:]:
            np.testing.assert_allclose(_np(step["out"]), a, rtol=0, atol=2e-5 * scale)
        grads = [a, a, 0.5 * a, 0.5 * a, a, a]
        log = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=rank)), grads)
        total_out, total_in = 0.0, 0.0
        for t, (step, g) in enumerate(zip(log, grads)):
            total_out, total_in = total_out + _np(step["out"]), total_in + g
            if t % 2:
                assert np.abs(_np(step["after"].residual)).max() < 2e-5 * scale
                np.testing.assert_allclose(total_out, total_in, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("warm_start", [True, False])
def test_two_round_low_rank_exact_at_first_step(backend, rank, warm_start):
    """Two-round: a matrix of rank <= r is reproduced to float32 precision, residual ~ 0, from step 0."""
    scheme = PowerSGDScheme(PowerSGDConfig(rank=rank, warm_start=warm_start, **TWO))
    for k in sorted({1, rank}):
        a = _low_rank(48, 40, k, seed=10 + k)
        log = _steps(backend, scheme, [a, a, 0.5 * a])
        for i, step in enumerate(log):
            want = a if i < 2 else 0.5 * a
            np.testing.assert_allclose(_np(step["out"]), want, rtol=0, atol=2e-5 * np.abs(want).max())
            assert np.abs(_np(step["after"].residual)).max() < 2e-5 * np.abs(want).max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["alternating", "two_round"])
def test_warm_start_converges_to_best_rank_r(backend, variant):
    """Without EF, repeating one matrix: warm start is subspace iteration, reaching the SVD error."""
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    v, _ = np.linalg.qr(rng.standard_normal((50, 50)))
    s = 0.6 ** np.arange(50)
    a = (u[:, :50] * s) @ v.T
    best = np.linalg.norm(a - (u[:, :2] * s[:2]) @ v[:, :2].T)
    warm = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False, variant=variant)), [a] * 30)
    err_warm = [np.linalg.norm(_np(x["out"]) - a) for x in warm]
    assert err_warm[-1] < best * 1.01, (err_warm[-1], best)
    assert err_warm[-1] < err_warm[0]
    q = _np(warm[-1]["after"].q)  # unit rows (= Q's columns), aligned with the top singular vectors
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.abs(q @ v[:, :2]), np.eye(2), atol=1e-2)
    if variant == "two_round":
        cold = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False, warm_start=False,
                                                             **TWO)), [a] * 30)
        err_cold = [np.linalg.norm(_np(x["out"]) - a) for x in cold]
        assert np.mean(err_cold[5:]) > err_warm[-1] * 1.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["alternating", "two_round"])
def test_zeros_give_exact_zeros_and_keep_a_basis(backend, variant):
    """All-zero gradients give exact zeros and leave a usable basis: the two-round Q is kept,
    the alternating bases are refilled from the shared random matrix (never zero or NaN)."""
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, variant=variant))
    a = _low_rank(30, 20, 2, seed=5)
    log = _steps(backend, scheme, [np.zeros((30, 20))] * 2 + [a] * 2)
    for step in log[:2]:
        assert (_np(step["out"]) == 0).all() and (_np(step["after"].residual) == 0).all()
        if variant == "two_round":
            np.testing.assert_array_equal(_np(step["after"].q), _np(log[0]["old"].q))  # not poisoned
        else:
            for field in ("p", "q"):
                b = _np(getattr(step["after"], field))
                np.testing.assert_allclose(b @ b.T, np.eye(2), atol=1e-5)
    if variant == "two_round":  # exact at once
        np.testing.assert_allclose(_np(log[2]["out"]), a, atol=2e-5 * np.abs(a).max())
    else:  # the odd step after delivers the rest: the two outputs sum to 2a
        np.testing.assert_allclose(_np(log[2]["out"]) + _np(log[3]["out"]), 2 * a, atol=1e-4 * np.abs(a).max())
    assert [int(_np(s["after"].step)) for s in log] == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["alternating", "two_round"])
def test_nonfinite_keeps_whole_state_and_reaches_output(backend, variant):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, variant=variant))
    rng = np.random.default_rng(6)
    g0, g2 = rng.standard_normal((30, 20)), rng.standard_normal((30, 20))
    for value in (np.nan, np.inf):
        bad = rng.standard_normal((30, 20))
        bad[4, 7] = value
        log = _steps(backend, scheme, [g0, bad, g2])
        assert np.isnan(_np(log[1]["out"])).all() and np.isnan(_np(log[1]["payload"])).all()
        for field in PowerSGDState._fields:  # residual, factors and the step counter: unchanged
            np.testing.assert_array_equal(_np(getattr(log[1]["after"], field)), _np(getattr(log[1]["old"], field)))
        assert int(_np(log[1]["after"].step)) == 1
        assert np.isfinite(_np(log[2]["out"])).all()
        # Step 2 is exactly what step 1 would have been without the failed one.
        clean = _steps(backend, scheme, [g0, g2])
        np.testing.assert_array_equal(_np(log[2]["out"]), _np(clean[1]["out"]))
    # The vector path (fp16) carries NaN/inf to the output: poisoned, not saturated.
    vec = np.ones(9)
    vec[2] = np.inf
    out = _np(_steps(backend, _routed(scheme, vec.shape, "b"), [vec], key="b")[0]["out"])
    assert not np.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_uncompressed_tensors_follow_fp16_or_float32(backend):
    ops = one_rank_ops(backend)
    rng = np.random.default_rng(7)
    for shape in [(), (9,), (3, 3), (2, 2, 2)]:
        g = rng.standard_normal(shape) * 100
        log = _steps(backend, _routed(PowerSGDScheme(), shape), [g], world_size=2)
        assert len(log[0]["after"]) == 0  # no state kept for them
        out = _np(log[0]["out"])
        x = _tensor(backend, g)
        info = TensorInfo("w", shape, "float32", 2, 0)
        fp16 = Fp16Scheme()
        ref = _np(fp16.decompress(ops, fp16.compress(ops, x, (), info, None)[0], None, info))
        np.testing.assert_array_equal(out, ref.reshape(shape))
        wide = PowerSGDScheme(PowerSGDConfig(uncompressed_dtype="float32"))
        np.testing.assert_array_equal(_np(_steps(backend, _routed(wide, shape), [g])[0]["out"]), _np(x))
    # Uncompressed tensors have no error feedback to keep an excess in: a value beyond
    # float16's range becomes inf as in the fp16 baseline (never silently clipped), so the
    # all-reduced payload is non-finite on every rank and a loss scaler skips the step.
    out = _np(_steps(backend, _routed(PowerSGDScheme(), (3,)), [np.array([1e6, -1e6, 1.0])], world_size=2)[0]["out"])
    np.testing.assert_array_equal(out, [np.inf, -np.inf, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_step_warm_up(backend):
    """Two-round: before start_step an fp16 round trip, payload of the same size, Q untouched;
    then PowerSGD."""
    ops = one_rank_ops(backend)
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal((24, 20)) for _ in range(4)]
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, start_step=2, **TWO))
    plain = _steps(backend, PowerSGDScheme(PowerSGDConfig(rank=2, **TWO)), grads[2:])
    log = _steps(backend, scheme, grads)
    info = TensorInfo("w", (24, 20), "float32", 1, 0)
    fp16 = Fp16Scheme()
    for i in range(2):
        x = _tensor(backend, grads[i])
        want = _np(fp16.decompress(ops, fp16.compress(ops, x, (), info, None)[0], None, info))
        np.testing.assert_array_equal(_np(log[i]["out"]), want)
        np.testing.assert_array_equal(_np(log[i]["after"].q), _np(log[0]["old"].q))
        assert (_np(log[i]["after"].residual) == 0).all()
    # From step 2 on it is exactly PowerSGD started fresh (the warm-up left no trace).
    for a, b in zip(log[2:], plain):
        np.testing.assert_array_equal(_np(a["out"]), _np(b["out"]))
    sizes = {tuple(ops.shape(s["payload"])) for s in log}
    assert sizes == {(40,)}
    assert [int(_np(s["after"].step)) for s in log] == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["alternating", "two_round"])
def test_low_precision_inputs_keep_dtype(backend, variant):
    ops = one_rank_ops(backend)
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False, variant=variant))
    a = _low_rank(16, 12, 2, seed=9)
    for dtype in ("float16", "bfloat16", "float64"):
        x = _tensor(backend, a, dtype)
        info = TensorInfo("w", (16, 12), dtype, 1, 0)
        state = scheme.init(ops, info, x)
        for _ in range(2):  # the alternating variant is exact from its second step
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        assert ops.dtype(out) == dtype and tuple(ops.shape(out)) == (16, 12)
        assert ops.dtype(payload) == "float32"
        np.testing.assert_allclose(_np(out), _np(x), atol=2e-2 * np.abs(a).max())


# ---------------------------------------------------------------- TensorFlow kernels
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_kernels_use_output_channels_as_rows(backend):
    """A conv kernel whose out x (rest) matrix has rank 2 is recovered exactly (no EF, from
    step 1) in the framework's own layout; read the other way it is not of low rank."""
    rng = np.random.default_rng(70)
    out_ch, cin, h, w = 8, 5, 3, 3
    m = rng.standard_normal((out_ch, 2)) @ rng.standard_normal((2, cin * h * w))  # out x (in h w)
    torch_kernel = m.reshape(out_ch, cin, h, w)
    kernel = torch_kernel if backend == "torch" else torch_kernel.transpose(2, 3, 1, 0)  # (h, w, in, out)
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2, error_feedback=False))
    log = _steps(backend, scheme, [kernel] * 3)
    ops = one_rank_ops(backend)
    info = TensorInfo("w", kernel.shape, "float32", 1, 0)
    n, cols = scheme.matrix_shape(info, ops.name)
    assert (n, cols) == (out_ch, cin * h * w)
    residual_shape = (cols, n) if backend == "tensorflow" else (n, cols)
    ef_state = PowerSGDScheme(PowerSGDConfig(rank=2)).init(ops, info, None)
    assert tuple(ops.shape(ef_state.residual)) == residual_shape  # the plain reshape, no transpose
    for step in log[1:]:
        assert _np(step["out"]).shape == kernel.shape
        np.testing.assert_allclose(_np(step["out"]), kernel, rtol=0, atol=2e-5 * np.abs(kernel).max())


# ---------------------------------------------------------------- checkpoints
def test_old_state_format_refused_with_reason():
    scheme = PowerSGDScheme()
    with pytest.raises(ValueError, match=r"^powersgd: .*'conv1' is PowerSGD state format 1 .*TensorFlow kernels "
                                         r"\(h, w, in, out\) as out x \(h w in\)"):
        scheme.check_loaded("conv1", {"residual": np.zeros((3, 96)), "q": np.zeros((1, 96)), "step": 5})
    with pytest.raises(ValueError, match=r"format 7; this hvd_gradcomp reads format 2"):
        scheme.check_loaded("w", {f: np.int64(7) for f in PowerSGDState._fields})
    scheme.check_loaded("w", {f: np.int64(STATE_VERSION) for f in PowerSGDState._fields})  # current: fine
    state = PowerSGDState(*[np.int64(STATE_VERSION)] * len(PowerSGDState._fields))
    scheme.check_loaded("w", state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_resume_equals_uninterrupted(backend):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    grads = rank_grads(80, 2, 6, (24, 20))
    full = simulate(backend, scheme, grads)
    first = simulate(backend, scheme, grads[:3])
    saved = [PowerSGDState(*[_np(v) for v in s]) for s in first[-1]["after"]]
    ops = one_rank_ops(backend)
    restored = [PowerSGDState(*[_tensor(backend, v, ops.dtype(f)) for v, f in zip(s, orig)])
                for s, orig in zip(saved, first[-1]["after"])]
    rest = simulate(backend, scheme, grads[3:], states=restored)
    for a, b in zip(full[3:], rest):
        for x, y in zip(a["outs"], b["outs"]):
            np.testing.assert_array_equal(_np(x), _np(y))
