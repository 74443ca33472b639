"""TopKC, with TopK and the casts beside it, through Horovod's TensorFlow frontend under real
Horovod (one 2-rank Gloo launch: ``worker_tf``, ``results_tf``, ``TF_SCENARIOS``): the known
gradients of tests/parallel/topkc_known.py (loss = sum_i <v_i, C_i>, SGD lr 1), with
``hvd.DistributedGradientTape`` inside ``tf.function`` and eagerly, with ``groups``, and with
``hvd.DistributedOptimizer`` around a Keras 2 optimizer. In TensorFlow a variable outside the
loss has a None gradient, which Horovod does not reduce: on odd steps ``w`` is skipped (its
residual waits), and the step function is traced twice (with and without ``w``), so keys must
survive retracing. PyTorch's launches: tests/parallel/test_topkc.py.
"""
import numpy as np
import pytest

from tests.hvdrun import default_timeout, run
from tests.parallel.topkc_known import SHAPES, STEPS, TOPKC, grad_of, init_of
from tests.reference import allreduce_fp16, fp16, reference_for_spec


# name -> (spec, how, op)
TF_SCENARIOS = {
    "tape_fn_topkc": (TOPKC, "tape_fn", "average"),
    "tape_eager_topkc": (TOPKC, "tape_eager", "average"),
    "tape_groups_topkc": (TOPKC, "tape_groups", "average"),
    "tape_fn_topkc_sum": (TOPKC, "tape_fn", "sum"),
    "tape_fn_topkc_predivide": (TOPKC, "tape_fn_predivide", "average"),
    "tape_fn_topkc_min100": ("topkc:ratio=0.25,chunk=8,min_numel=100", "tape_fn", "average"),
    "keras_opt_topkc": (TOPKC, "keras", "average"),
    "keras_opt_topk": ("topk:ratio=0.1", "keras", "average"),
    "tape_fn_fp16": ("fp16", "tape_fn", "average"),
}


def _train_tf(hvd, tf, Compression, spec, how, op, steps=STEPS, start=0, values=None, state=None):
    names = sorted(SHAPES)
    variables = {k: tf.Variable(init_of(k) if values is None else values[k], name=k) for k in names}
    var_list = [variables[k] for k in names]
    comp = Compression.from_spec(spec)
    if state is not None:
        comp.load_state_dict(state)
    hop = hvd.Sum if op == "sum" else hvd.Average

    def loss_fn(consts, use_w):
        total = 0.0
        for k in names:
            if k != "w" or use_w:
                total += tf.reduce_sum(variables[k] * consts[k])
        return total

    if how == "keras":
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), compression=comp, op=hop)
        opt.build(var_list)

        def step(consts, use_w):
            with tf.GradientTape() as tape:
                loss = loss_fn(consts, use_w)
            used = [v for k, v in zip(names, var_list) if k != "w" or use_w]
            opt.minimize(loss, used, tape=tape)
    else:
        sgd = tf.keras.optimizers.SGD(1.0)
        sgd.build(var_list)
        groups = 2 if how == "tape_groups" else None
        factor = 4.0 if how == "tape_fn_predivide" else 1.0

        def step(consts, use_w):
            with tf.GradientTape() as tape:
                loss = loss_fn(consts, use_w)
            tape = hvd.DistributedGradientTape(tape, compression=comp, op=hop, groups=groups,
                                               gradient_predivide_factor=factor)
            grads = tape.gradient(loss, var_list)
            sgd.apply_gradients([(g, v) for g, v in zip(grads, var_list) if g is not None])
    if how != "tape_eager":
        step = tf.function(step)
    for s in range(start, start + steps):
        consts = {k: tf.constant(grad_of(k, hvd.rank(), s, 0) if grad_of(k, hvd.rank(), s, 0) is not None
                                 else np.zeros(SHAPES[k], np.float32)) for k in names}
        step(consts, s % 2 == 0)
    return {k: v.numpy().copy() for k, v in variables.items()}, comp


def worker_tf():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    out = {"rank": hvd.rank()}
    for label, (spec, how, op) in TF_SCENARIOS.items():
        values, comp = _train_tf(hvd, tf, Compression, spec, how, op)
        out[label] = {"params": values, "state_keys": sorted(comp.state_dict()["tensors"]),
                      "wire": {k: tuple(v) for k, v in comp.wire_bytes().items()}}
    # Checkpoint: 3 steps, save, fresh variables and compressor, load, 3 more == 6 in one go.
    spec = TOPKC
    full, _ = _train_tf(hvd, tf, Compression, spec, "tape_fn", "average", steps=6)
    half, comp = _train_tf(hvd, tf, Compression, spec, "tape_fn", "average", steps=3)
    saved = comp.state_dict()
    resumed, _ = _train_tf(hvd, tf, Compression, spec, "tape_fn", "average", steps=3, start=3,
                        values=half, state=saved)
    out["resume_equal"] = all(np.array_equal(full[k], resumed[k]) for k in full)
    # NaN on rank 1 through hvd.allreduce (eager): every rank's output is non-finite.
    # One good step first, so the state kept is not the initial one.
    comp = Compression.topkc(ratio=0.5, chunk=4, min_numel=1)
    x = np.arange(32, dtype=np.float32) / 7.0 * (hvd.rank() + 1)
    hvd.allreduce(tf.constant(x), name="nan_t", compression=comp)
    before = {f: v.numpy().copy() for f, v in comp.state_dict()["tensors"]["nan_t"].items()}
    if hvd.rank() == 1:
        x[3] = np.nan
    res = hvd.allreduce(tf.constant(x), name="nan_t", compression=comp)
    after = {f: v.numpy().copy() for f, v in comp.state_dict()["tensors"]["nan_t"].items()}
    out["nan_output_finite"] = bool(tf.reduce_all(tf.math.is_finite(res)))
    out["nan_residual_finite"] = bool(np.isfinite(after["residual"]).all())
    out["nan_state_kept"] = all(np.array_equal(before[f], after[f]) for f in before) and set(before) == {
        "residual", "scores", "realigned"}
    # Ops a selected payload cannot take are refused before any collective; fp16 takes them.
    refused = {}
    for label, hop in (("adasum", hvd.Adasum), ("min", hvd.Min), ("max", hvd.Max)):
        try:
            hvd.allreduce(tf.ones([64]), name=f"op_{label}", op=hop, compression=Compression.topkc(min_numel=1))
            refused[label] = None
        except ValueError as e:
            refused[label] = str(e)
    out["refused"] = refused
    out["after_refusal"] = float(hvd.allreduce(tf.constant(float(hvd.rank() + 1)), name="after_refusal", op=hvd.Sum))
    v = tf.constant([1.0, -1.0, 0.5, 3.0]) * float(hvd.rank() + 1)
    out["fp16_max"] = hvd.allreduce(v, name="fp16_max", op=hvd.Max, compression=Compression.fp16()).numpy()
    # No name: a stateless compressor needs none.
    out["fp16_no_name"] = hvd.allreduce(v, compression=Compression.fp16()).numpy()
    return out


@pytest.fixture(scope="module")
def results_tf():
    # Nine scenarios plus the checks, each tracing tf.functions: 2 minutes measured alone on
    # 2 cores, 3.7 minutes (beyond the default 180 s) while other launches shared them.
    return run(worker_tf, np=2, timeout=max(600.0, default_timeout()))


def _reference_tf(spec, op):
    name = spec.partition(":")[0]
    params = {k: init_of(k).astype(np.float64).reshape(-1) for k in SHAPES}
    refs = {k: reference_for_spec(spec, int(np.prod(SHAPES[k])), 2) for k in SHAPES}
    for step in range(STEPS):
        for k in SHAPES:
            if k == "w" and step % 2 == 1:
                continue  # None gradient: not reduced, no update
            grads = [grad_of(k, r, step, 0).astype(np.float64).reshape(-1) for r in range(2)]
            if name == "fp16":
                update = allreduce_fp16([fp16(g / 2) for g in grads], op) * 2
            else:
                update = refs[k].step(grads, op)
            params[k] = (params[k] - update).astype(np.float32).astype(np.float64)
    return {k: v.reshape(SHAPES[k]) for k, v in params.items()}


@pytest.mark.parametrize("label", sorted(TF_SCENARIOS))
def test_tf_scenario_matches_float64_reference(results_tf, label):
    spec, _, op = TF_SCENARIOS[label]
    expected = _reference_tf(spec, op)
    for r in results_tf:
        for k in SHAPES:
            np.testing.assert_allclose(r[label]["params"][k], expected[k], rtol=2e-3, atol=2e-3,
                                       err_msg=f"{label} {k} rank {r['rank']}")
    for k in SHAPES:
        assert np.array_equal(results_tf[0][label]["params"][k], results_tf[1][label]["params"][k])


def test_one_residual_per_variable_across_retraces(results_tf):
    """Keys are the gradient's position in Horovod's allreduce_grads (a, b, s, w sorted), the
    same on every rank, in every trace and in eager steps that build a new tape each time."""
    keys = ["grad_0", "grad_1", "grad_2", "grad_3"]
    for label in ("tape_fn_topkc", "tape_groups_topkc", "keras_opt_topkc", "keras_opt_topk", "tape_eager_topkc"):
        for r in results_tf:
            assert r[label]["state_keys"] == keys, label
    assert results_tf[0]["tape_fn_topkc_min100"]["state_keys"] == ["grad_3"]  # a, b, s go as fp16
    # a: 64 coords -> 8 chunks of 8, k = 2: 16 values + 8 scores + 16 vote slots in fp16.
    assert results_tf[0]["tape_fn_topkc"]["wire"]["grad_0"] == ((16 + 8 + 16) * 2, 0, 0)
    assert results_tf[0]["tape_fn_topkc_min100"]["wire"]["grad_0"] == (128, 0, 0)


def test_tf_predivide_factor_changes_nothing(results_tf):
    for r in results_tf:
        for k in SHAPES:
            np.testing.assert_allclose(r["tape_fn_topkc_predivide"]["params"][k], r["tape_fn_topkc"]["params"][k],
                                       rtol=1e-6, atol=1e-6, err_msg=k)


def test_tf_checkpoint_resume_equals_uninterrupted(results_tf):
    assert all(r["resume_equal"] for r in results_tf)


def test_nonfinite_reaches_every_rank(results_tf):
    for r in results_tf:
        assert r["nan_output_finite"] is False and r["nan_residual_finite"] is True
        assert r["nan_state_kept"] is True  # on rank 0 too, whose own gradient was finite


def test_ops_refused_and_fp16_without_a_name(results_tf):
    v = np.array([1.0, -1.0, 0.5, 3.0])  # rank r sent (r + 1) * v
    for r in results_tf:
        for label in ("adasum", "min", "max"):
            message = r["refused"][label]
            assert message is not None and "topkc" in message and f"op={label.capitalize()}" in message, message
        assert r["after_refusal"] == 3.0
        np.testing.assert_array_equal(r["fp16_max"], np.maximum(v, 2 * v))
        np.testing.assert_array_equal(r["fp16_no_name"], 1.5 * v)
