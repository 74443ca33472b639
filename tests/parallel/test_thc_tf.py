"""THC under real Horovod through TensorFlow (one 2-rank Gloo launch, ``worker_tf``):
``DistributedGradientTape`` inside ``tf.function``, a direct Sum, the hand-made path under
Average (TF's int32 Average), NaN on one rank, ``subtract_own`` in one group under Sum, and a
1e6 drop in gradient scale; checked as the PyTorch launches of tests/parallel/test_thc.py are
(tests/parallel/thc_launch.py).
"""
import numpy as np
import pytest

from tests.hvdrun import run
from tests.parallel.thc_launch import (D, DROP_RUNS, STEPS, check_drop, check_hand, check_known,
                                       decoded_from_states, drop_runs, known_inputs)


def worker_tf():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    r = hvd.rank()
    out = {"rank": r}
    # DistributedGradientTape inside tf.function, default op (Average): 3 steps of the
    # gradient of <w, C_r>, i.e. C_r itself; THC (8 bits) on w, fp16 on the bias.
    w = tf.Variable(tf.zeros((64, 128)), name="w")
    bias = tf.Variable(tf.zeros((128,)), name="bias")
    comp = Compression.thc(bits=8)

    @tf.function
    def grads(c_w, c_b):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c_w) + tf.reduce_sum(bias * c_b)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        return tape.gradient(loss, [w, bias])

    def w_state():
        for key, fields in comp.state_dict()["tensors"].items():
            if "residual" in fields and np.asarray(fields["residual"]).size == 8192:
                return key, {k: np.array(v, copy=True) for k, v in fields.items()}
        return None, None

    out["tape"] = []
    for step in range(STEPS):
        rng = np.random.default_rng([step, r])
        c_w = rng.standard_normal((64, 128)).astype(np.float32)
        c_b = rng.standard_normal(128).astype(np.float32)
        before = w_state()[1]
        g_w, g_b = grads(tf.constant(c_w), tf.constant(c_b))
        key, after = w_state()
        out["tape"].append({"c_w": c_w, "c_b": c_b, "g_w": g_w.numpy(), "g_b": g_b.numpy(),
                            "before": before, "after": after, "key": key})
    # Direct all-reduce with op=Sum (op known), two steps.
    comp = Compression.thc(bits=8)
    out["sum"] = []
    for t in range(2):
        x = tf.constant(known_inputs(r, 5, t))
        before = {k: np.array(v, copy=True) for k, v in comp.state_dict()["tensors"].get("tf_sum", {}).items()}
        got = hvd.allreduce(x, name="tf_sum", op=hvd.Sum, compression=comp).numpy()
        after = {k: np.array(v, copy=True) for k, v in comp.state_dict()["tensors"]["tf_sum"].items()}
        out["sum"].append({"x": x.numpy(), "out": got, "before": before or None, "after": after})
    # By hand under Average: TF's int32 Average, op inferred.
    comp = Compression.thc()
    out["hand_average"] = []
    for t in range(STEPS):
        x = tf.constant(known_inputs(r, 9, t))
        payload, ctx = comp.compress(x, name="hand")
        reduced = hvd.allreduce(payload, op=hvd.Average, name="hand.payload")
        got = comp.decompress(reduced, ctx)
        out["hand_average"].append({"own": payload.numpy(), "reduced": reduced.numpy(),
                                    "reduced_dtype": reduced.dtype.name, "out": got.numpy(),
                                    "ranges": ctx[1].ranges.numpy(), "diag": ctx[1].diag.numpy()})
    # NaN on rank 0 after a finite step.
    comp = Compression.thc()
    hvd.allreduce(tf.constant(known_inputs(r, 6)), name="tf_nan", compression=comp)
    before = {k: np.array(v, copy=True) for k, v in comp.state_dict()["tensors"]["tf_nan"].items()}
    bad = known_inputs(r, 6, 1)
    if r == 0:
        bad[0, 0] = np.nan
    out["nan"] = hvd.allreduce(tf.constant(bad), name="tf_nan", compression=comp).numpy()
    after = comp.state_dict()["tensors"]["tf_nan"]
    out["nan_state_kept"] = all(np.array_equal(before[k], np.asarray(after[k])) for k in before)
    out.update(drop_runs(hvd, Compression.from_spec, tf.constant,
                          lambda c, k: {f: np.array(v, copy=True) for f, v in c.state_dict()["tensors"][k].items()}))
    # subtract_own in one group with an fp16 bias (the int32 words travel as float64) under
    # Sum, whose exact sums pass int32's range: the gradients of the summing layout, bit for bit.
    out["own_grouped"] = []
    for own in (False, True):
        comp = Compression.thc(subtract_own=own)
        gw, gb = tf.Variable(tf.zeros((64, 128)), name="gw"), tf.Variable(tf.zeros((128,)), name="gb")

        @tf.function
        def grouped(c_w, c_b):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(gw * c_w) + tf.reduce_sum(gb * c_b)
            tape = hvd.DistributedGradientTape(tape, compression=comp, num_groups=1, op=hvd.Sum)
            return tape.gradient(loss, [gw, gb])

        steps = []
        for step in range(3):
            rng = np.random.default_rng([step, r, 7])
            got = grouped(tf.constant(rng.standard_normal((64, 128)).astype(np.float32)),
                          tf.constant(rng.standard_normal(128).astype(np.float32)))
            steps.append([g.numpy().copy() for g in got])
        out["own_grouped"].append(steps)
    return out


@pytest.fixture(scope="module")
def tf2():
    return run(worker_tf, np=2)


def test_tensorflow_tape(tf2):
    for t in range(STEPS):
        steps = [res["tape"][t] for res in tf2]
        g_w = [st["g_w"] for st in steps]
        np.testing.assert_array_equal(g_w[0], g_w[1])
        np.testing.assert_array_equal(steps[0]["g_b"], steps[1]["g_b"])
        true_b = (steps[0]["c_b"] + steps[1]["c_b"]) / 2
        np.testing.assert_allclose(steps[0]["g_b"], true_b, atol=2e-3)  # fp16
        if t == 0:
            assert (g_w[0] == 0).all()
            continue
        per_rank = [{"x": st["c_w"], "before": st["before"], "after": st["after"]} for st in steps]
        ref = decoded_from_states(per_rank, "average", 1024).reshape(64, 128)
        np.testing.assert_allclose(g_w[0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        assert int(steps[0]["after"]["step"]) == t + 1


def test_tensorflow_grouped_subtract_own_under_sum(tf2):
    """TensorFlow, one group of THC's int32 words (``subtract_own``) and an fp16 bias, so the
    group travels as float64, under Sum: the words' exact sums pass int32's range and come back
    modulo 2**32, and the gradients are the summing layout's bit for bit, on both ranks."""
    for res in tf2:
        plain, own = res["own_grouped"]
        for t, (a, b) in enumerate(zip(plain, own)):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
        assert np.abs(own[2][0]).max() > 0.1  # THC sent something from the second step on
    for a, b in zip(tf2[0]["own_grouped"][1], tf2[1]["own_grouped"][1]):
        np.testing.assert_array_equal(a[0], b[0])


def test_tensorflow_sum_average_and_nan(tf2):
    check_known([res["sum"] for res in tf2], "sum")
    for t in range(STEPS):
        records = [dict(rec, dtype="int32", x=np.zeros(D, np.float32)) for rec in (res["hand_average"][t] for res in tf2)]
        assert all(np.asarray(rec["reduced"]).dtype.kind == "i" for rec in records)
        ref, _, _ = check_hand(records, 4, "average")
        assert (ref == 0).all() if t == 0 else np.abs(ref).max() > 0.1
    for res in tf2:
        assert np.isnan(res["nan"]).all() and res["nan_state_kept"]


@pytest.mark.parametrize("spec,op", DROP_RUNS)
def test_drop_in_scale_settles_and_keeps_what_is_owed(tf2, spec, op):
    """After the gradients fall 1e6x, error feedback flushes at most the new gradient's own range
    a step, and nothing is lost (:func:`tests.parallel.thc_launch.check_drop`); TensorFlow's run."""
    check_drop(tf2, spec, op)
