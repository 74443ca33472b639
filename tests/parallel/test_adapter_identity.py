"""Tensor identity and unknown shapes, 2 real Horovod ranks (Gloo), one TensorFlow launch.

TensorFlow only: PyTorch keys state by parameter name, checked in tests/parallel/test_topkc.py
(``test_one_residual_per_parameter``).

1. Two variables both named "w" (different shapes and values) through one
   ``DistributedGradientTape``: each keeps its own state (keys are positions ``grad_<j>``,
   never bare variable names), so with ``topk:ratio=0.5`` each variable's update equals a
   float64 simulation of TopK with error feedback on its own gradients.
2. One compressor used by two tapes whose gradients share positions: the second tape's
   variable gets its own state (``grad_0@1``), matching its own float64 simulation; keys stay
   the same at every step (the owner is the variable, not the tape object).
3. ``sparse_as_dense=True`` on an Embedding (gradient shape ``(None, 16)`` inside the
   function): Keras ``model.fit`` with ``hvd.DistributedOptimizer`` for every compressor, two
   epochs; the weights end identical on both ranks and finite.
"""
import numpy as np
import pytest

from tests.backends import requires_backend
from tests.hvdrun import run
from tests.reference import RefTopK

SPECS = ["fp16", "topkc:ratio=0.25,chunk=8,min_numel=1", "thc:min_numel=1", "powersgd:rank=2", "topk:ratio=0.5"]


def _topk_reference(grads_per_rank, ratio=0.5):
    """Average over ranks of TopK-with-EF outputs, step by step (float64), one tensor."""
    ref = RefTopK(grads_per_rank[0][0].size, len(grads_per_rank), ratio)
    return [ref.step([g[step] for g in grads_per_rank]) for step in range(len(grads_per_rank[0]))]


def _grad(rank, step, shape, salt):
    return np.random.default_rng([salt, rank, step]).standard_normal(shape).astype(np.float32)


def worker():
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    out = {}
    # 1 and 2: known gradients via loss = sum(<v, C>), SGD lr 1 -> v = -sum of outputs.
    a = tf.Variable(tf.zeros((6,)), name="w")
    b = tf.Variable(tf.zeros((3, 4)), name="w")
    c = tf.Variable(tf.zeros((6,)), name="c")
    comp = Compression.topk(ratio=0.5)
    shared = Compression.topk(ratio=0.5)

    @tf.function
    def step(ga, gb, gc):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * ga) + tf.reduce_sum(b * gb)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        da, db = tape.gradient(loss, [a, b])
        a.assign_sub(da)
        b.assign_sub(db)
        with tf.GradientTape() as t1:
            l1 = tf.reduce_sum(a * ga)
        d1 = hvd.DistributedGradientTape(t1, compression=shared).gradient(l1, [a])[0]
        with tf.GradientTape() as t2:
            l2 = tf.reduce_sum(c * gc)
        d2 = hvd.DistributedGradientTape(t2, compression=shared).gradient(l2, [c])[0]
        return d1, d2

    firsts, seconds = [], []
    for s in range(3):
        d1, d2 = step(_grad(hvd.rank(), s, (6,), 1), _grad(hvd.rank(), s, (3, 4), 2),
                      _grad(hvd.rank(), s, (6,), 3))
        firsts.append(d1.numpy())
        seconds.append(d2.numpy())
    out["a"], out["b"] = a.numpy(), b.numpy()
    out["shared_first"], out["shared_second"] = firsts, seconds
    out["keys"] = sorted(comp.wire_bytes()), sorted(shared.wire_bytes())
    # 3: Keras model.fit, Embedding with sparse_as_dense.
    rng = np.random.default_rng(hvd.rank())
    x = rng.integers(0, 50, size=(64, 5))
    y = rng.integers(0, 2, size=(64,))
    out["fit"] = {}
    for spec in SPECS:
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.layers.Embedding(50, 16), tf.keras.layers.GlobalAveragePooling1D(),
                                     tf.keras.layers.Dense(2)])
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), sparse_as_dense=True,
                                             compression=Compression.from_spec(spec))
        model.compile(opt, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        out["fit"][spec] = [w.copy() for w in model.get_weights()]
    return out


@pytest.fixture(scope="module")
def results():
    return run(worker, np=2, timeout=300)


@requires_backend("tensorflow")
def test_same_named_variables_keep_their_own_state(results):
    for r in results:
        for name, shape, salt in (("a", (6,), 1), ("b", (3, 4), 2)):
            ref = _topk_reference([[_grad(k, s, shape, salt) for s in range(3)] for k in range(2)])
            expect = -sum(ref)
            np.testing.assert_allclose(r[name].reshape(-1), expect, rtol=1e-5, atol=1e-6, err_msg=name)


@requires_backend("tensorflow")
def test_one_compressor_two_tapes_keeps_states_apart(results):
    for r in results:
        first, second = r["keys"]
        assert first == ["grad_0", "grad_1"]
        assert second == ["grad_0", "grad_0@1"]
        ref2 = _topk_reference([[_grad(k, s, (6,), 3) for s in range(3)] for k in range(2)])
        for s in range(3):
            np.testing.assert_allclose(r["shared_second"][s], ref2[s], rtol=1e-5, atol=1e-6)


@requires_backend("tensorflow")
@pytest.mark.parametrize("spec", SPECS)
def test_keras_fit_sparse_as_dense_embedding(results, spec):
    w0, w1 = results[0]["fit"][spec], results[1]["fit"][spec]
    for a, b in zip(w0, w1):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
