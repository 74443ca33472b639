"""Framework parity: the same inputs, seeds and options give the same results in both backends.

Scheme level, one process, side collectives replaced by the identity (world size 1); the
multi-rank behaviour of each frontend is tested in tests/parallel/. Selections (integer ctx
tensors) and integer payloads must match bit for bit; float outputs must be allclose.

Two scheme-specific parity checks stay beside their schemes, being the only ones of their kind:
THC's int32 payload bit for bit on inputs where every float step is exact, with TensorFlow
inside tf.function (tests/test_thc.py::test_torch_tensorflow_payload_parity), and PowerSGD's
outputs in PyTorch, TensorFlow eager and tf.function over several variants
(tests/test_powersgd.py::test_torch_tensorflow_parity_eager_and_tf_function). The generator's
own statistics are in tests/test_rng.py.
"""

import numpy as np
import pytest

from hvd_gradcomp import rng
from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.registry import SCHEMES, make_scheme
from tests.conftest import BACKENDS, one_rank_ops, scheme_steps

pytestmark = pytest.mark.skipif(len(BACKENDS) < 2, reason="parity needs both backends")

VARIANTS = [(name, {"bandwidth_gbit": 1.0} if name == "auto" else {}) for name in sorted(SCHEMES)] + [
    ("topkc", {"selection": "current"}),
    ("topkc", {"payload_dtype": "float32", "chunk": 7, "ratio": 0.3}),
    ("topk", {"ratio": 0.05}),
]


def _np(x):
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _tensor(backend, value):
    if backend == "torch":
        import torch
        return torch.tensor(value)
    import tensorflow as tf
    return tf.constant(value)


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
    a, b = _run("torch", scheme, inputs), _run("tensorflow", scheme, inputs)
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
    from tests.conftest import backend_ops
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
