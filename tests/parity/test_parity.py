"""Framework parity: the same inputs, seeds and options give the same results in both backends.

Scheme level, one process, side collectives replaced by the identity (world size 1); the
multi-rank behaviour of each frontend is tested in tests/parallel/. Selections (integer ctx
tensors) and integer payloads must match bit for bit; float outputs must be allclose.

Here: every catalogue entry (:func:`test_backends_agree`), the counter-based generator's bits,
THC's int32 payload bit for bit on inputs where every float step is exact, with TensorFlow
inside tf.function, and PowerSGD's outputs in PyTorch, TensorFlow eager and tf.function over
several variants. The generator's own statistics are in tests/core/test_rng.py; PowerSGD's
two real-Horovod launches are compared in tests/parallel/test_powersgd.py
(``test_tensorflow_matches_torch``, which needs both launches' results).
"""

import dataclasses

import numpy as np
import pytest

from hvd_gradcomp import rng
from hvd_gradcomp.rng import normal as rng_normal
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.powersgd import PowerSGDConfig, PowerSGDScheme, PowerSGDState
from hvd_gradcomp.registry import SCHEMES, make_scheme
from hvd_gradcomp.thc import THCConfig, THCScheme
from tests.backends import (as_float64, as_numpy, backend_ops, native_tensor, one_rank_ops,
                            requires_backend, scheme_steps)
from tests.core.test_powersgd import TWO, _steps
from tests.core.thc_emulation import layout_of

pytestmark = [requires_backend("torch"), requires_backend("tensorflow")]  # parity needs both

VARIANTS = [(name, {"bandwidth_gbit": 1.0} if name == "auto" else {}) for name in sorted(SCHEMES)] + [
    ("topkc", {"selection": "current"}),
    ("topkc", {"payload_dtype": "float32", "chunk": 7, "ratio": 0.3}),
    ("topk", {"ratio": 0.05}),
    ("topkc", {"error_feedback": "ef21", "ratio": 0.1}),
    ("topkc", {"error_feedback": "ef21", "ratio": 0.1, "fp16_warmup": 1}),
    ("powersgd", {"error_feedback": "ef21", "rank": 2}),
    ("thc", {"fp16_warmup": 2}),
]


_np, _tensor = as_numpy, native_tensor  # the shared helpers of tests/backends.py (own dtype)


def _run(backend, scheme, inputs):
    ops = one_rank_ops(backend)
    xs = [_tensor(backend, v) for v in inputs]
    trace = []
    for step in scheme_steps(ops, scheme, xs, TensorInfo("layer.weight", inputs[0].shape, "float32", 1, 0)):
        ctx = step["ctx"]
        leaves = ctx if isinstance(ctx, (tuple, list)) else [ctx]
        selections = [_np(c) for c in leaves if c is not None and hasattr(c, "dtype")
                      and "int" in str(c.dtype)]
        trace.append((_np(step["payload"]), selections, _np(step["out"])))
    return trace


@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}-{o}" for n, o in VARIANTS])
def test_backends_agree(name, options):
    scheme = make_scheme(name, **options)
    gen = np.random.default_rng(7)
    inputs = [gen.standard_normal((96, 40)).astype(np.float32) for _ in range(3)]
    # A scheme per backend: the FP16 warm-up mirrors each tensor's count on the host.
    a, b = _run("torch", scheme, inputs), _run("tensorflow", make_scheme(name, **options), inputs)
    for step, ((pa, sa, oa), (pb, sb, ob)) in enumerate(zip(a, b)):
        assert pa.dtype == pb.dtype and pa.shape == pb.shape, (name, step)
        if scheme.adaptive:  # auto's probe payload ends in codec times measured on the host
            pa, pb = pa.reshape(-1)[:inputs[0].size], pb.reshape(-1)[:inputs[0].size]
        assert len(sa) == len(sb)
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(x, y, err_msg=f"{name} selection, step {step}")
        if pa.dtype.kind in "iu":
            # Integer payloads (quantised levels): the float math before rounding may differ in
            # the last bit between frameworks, flipping a rare stochastic rounding decision.
            assert np.mean(pa == pb) > 0.999, (name, step)
        else:
            np.testing.assert_allclose(pa.astype(np.float64), pb.astype(np.float64), rtol=1e-3,
                                       atol=1e-3, err_msg=f"{name} payload, step {step}")
        scale = np.abs(oa).max() + 1e-12
        np.testing.assert_allclose(oa, ob, rtol=0, atol=2e-2 * scale, err_msg=f"{name} output, step {step}")


def test_rng_identical_across_backends():
    import tensorflow as tf
    import torch
    pt, tfo = backend_ops("torch"), backend_ops("tensorflow")
    for key in (0, 1, 2**31 + 5, rng.stream_key("thc", "layer.weight", 3)):
        np.testing.assert_array_equal(_np(rng.bits32(pt, key, 5000, torch.zeros(1))),
                                      _np(rng.bits32(tfo, key, 5000, None)))
    k_pt = rng.step_key(pt, 12345, torch.tensor(17, dtype=torch.int64))
    k_tf = rng.step_key(tfo, 12345, tf.constant(17, tf.int64))
    assert int(k_pt) == int(k_tf)
    np.testing.assert_array_equal(_np(rng.uniform(pt, k_pt, 1000, torch.zeros(1))),
                                  _np(rng.uniform(tfo, k_tf, 1000, None)))
    np.testing.assert_array_equal(_np(rng.normal(pt, 9, 1000, torch.zeros(1))),
                                  _np(rng.normal(tfo, 9, 1000, None)))


# ---------------------------------------------------------------- THC: the payload bit for bit
@requires_backend("torch")
@requires_backend("tensorflow")
@pytest.mark.parametrize("config", [
    THCConfig(), THCConfig(bits=2, rotation="full", saturation=False),
    THCConfig(bits=8, rotation="full"), THCConfig(bits=4, rotation_stages=4, error_feedback=False),
    THCConfig(rotation="full", saturation=False, range="current"), THCConfig(lane_bits=4, flush=0.25),
    THCConfig(subtract_own=True),
])
def test_torch_tensorflow_payload_parity(config):
    """The int32 payload is bit-for-bit the same in PyTorch and TensorFlow.

    Inputs are chosen so that every floating-point step is exact or correctly rounded, hence
    independent of the order in which either framework sums: values in {-1, 0, 1}, d = 4096,
    rotation blocks of 1024, 4096 or 16 (even log2, so 1/sqrt(B) is a power of two and the
    rotated coordinates are small multiples of it), a residual of small multiples of 2**-8,
    agreed ranges that are powers of two, sums of squares below 2**24 units of the last
    place. The rest (divisions, sqrt, casts, the RNG's integer hashing) is IEEE-exact in both;
    the statistics' log2 may differ in its last bits, which moves a code only at a rounding
    tie (none here). Outputs and residuals, which go through inverse rotations of
    non-integers, agree to float32 rounding; so do the next ranges (exp2).
    """
    import tensorflow as tf
    gen = np.random.default_rng(3)
    x = gen.integers(-1, 2, 4096).astype(np.float32)
    results = {}
    for backend in ("torch", "tensorflow"):
        ops = one_rank_ops(backend)
        scheme = THCScheme(config)
        for n in (2, 8):
            info = TensorInfo("layer/w", (64, 64), "float32", n, 1, "sum")
            xt = native_tensor(backend, x.reshape(64, 64))
            state = scheme.init(ops, info, xt)
            lay = layout_of(scheme, info)
            ranges = (2.0 ** (np.arange(lay["blocks"]) % 5 - 2)).astype(np.float32)
            residual = np.random.default_rng(4).integers(-8, 9, as_numpy(state.residual).size).astype(np.float32) / 256
            state = state._replace(ranges=native_tensor(backend, ranges), step=native_tensor(backend, np.int64(3)),
                                   residual=native_tensor(backend, residual))
            side = (lambda v, *a, **k: v)
            if backend == "tensorflow":
                ops_tf = dataclasses.replace(ops, allreduce=side)
                payload, ctx = tf.function(lambda v, s: compress_tensor(scheme, ops_tf, v, s, info))(xt, state)
            else:
                payload, ctx = compress_tensor(scheme, ops, xt, state, info)
            out, new = finish_tensor(scheme, ops, payload, ctx, state, info)
            results[backend, n] = (as_numpy(payload), as_numpy(out), as_numpy(new.residual), int(as_numpy(new.saturated)),
                                   as_numpy(new.ranges), int(as_numpy(new.step)))
    for n in (2, 8):
        (p1, o1, r1, s1, g1, t1), (p2, o2, r2, s2, g2, t2) = results["torch", n], results["tensorflow", n]
        assert p1.dtype == p2.dtype == np.int32
        np.testing.assert_array_equal(p1, p2)
        assert s1 == s2 and t1 == t2 == 4
        np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r1, r2, rtol=0, atol=1e-5)
        np.testing.assert_allclose(g1, g2, rtol=1e-6)


# ---------------------------------------------------------------- PowerSGD: eager and tf.function
def _tf_graph_steps(scheme, grads, key="w"):
    """The TensorFlow run of _steps, each step one tf.function call (state passed through)."""
    import tensorflow as tf
    ops = one_rank_ops("tensorflow")
    info = TensorInfo(key, tuple(np.shape(grads[0])), "float32", 1, 0)
    state = scheme.init(ops, info, None)

    @tf.function
    def step(x, *fields):
        payload, ctx = compress_tensor(scheme, ops, x, PowerSGDState(*fields), info)
        out, new = finish_tensor(scheme, ops, payload, ctx, PowerSGDState(*fields), info)
        return out, tuple(new)

    outs = []
    for g in grads:
        out, fields = step(tf.constant(g, tf.float32), *state)
        state = PowerSGDState(*fields)
        outs.append(out.numpy().astype(np.float64))
    return outs, state


def test_torch_tensorflow_parity_eager_and_tf_function():
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal((40, 12)) for _ in range(5)]
    kernels = [rng.standard_normal((2, 2, 3, 40)) for _ in range(5)]  # TensorFlow conv: 40 x 12
    for cfg in (PowerSGDConfig(rank=2), PowerSGDConfig(rank=3, start_step=2, warm_start=False, **TWO),
                PowerSGDConfig(rank=2, **TWO)):
        scheme = PowerSGDScheme(cfg)
        # The first Q comes from the counter-based generator, bit-identical in both frameworks,
        # and is then orthogonalised, whose reductions each backend orders its own way (and
        # its CPU's: a last-bit difference was seen on one machine).
        np.testing.assert_array_equal(
            as_float64(rng_normal(one_rank_ops("torch"), 12345, 40, None)),
            as_float64(rng_normal(one_rank_ops("tensorflow"), 12345, 40, None)))
        np.testing.assert_allclose(
            as_float64(scheme.init(one_rank_ops("torch"), TensorInfo("w", (40, 12), "float32", 1, 0), None).q),
            as_float64(scheme.init(one_rank_ops("tensorflow"), TensorInfo("w", (40, 12), "float32", 1, 0), None).q),
            rtol=0, atol=1e-6)
        torch_log = _steps("torch", scheme, grads)
        tf_log = _steps("tensorflow", scheme, grads)
        graph_outs, graph_state = _tf_graph_steps(scheme, grads)
        for a, b, c in zip(torch_log, tf_log, graph_outs):
            np.testing.assert_allclose(as_float64(a["out"]), as_float64(b["out"]), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(as_float64(b["out"]), c, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(as_float64(torch_log[-1]["after"].residual), as_float64(graph_state.residual), atol=1e-4)
        assert int(as_float64(graph_state.step)) == len(grads)
        # A 4-D TensorFlow kernel: eager and tf.function agree (transposed view in both).
        eager = _steps("tensorflow", scheme, kernels)
        graph_outs, _ = _tf_graph_steps(scheme, kernels)
        for a, c in zip(eager, graph_outs):
            np.testing.assert_allclose(as_float64(a["out"]), c, rtol=1e-4, atol=1e-4)
