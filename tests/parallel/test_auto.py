"""``auto`` under real Horovod: 2 ranks, Gloo, one PyTorch and one TensorFlow (eager) launch.

Each rank's gradient at step t comes from ``_grad(rank, t)``, so the host rebuilds the float64
sums. Checks: the ranks take the same decisions; THC's probes flush its error feedback exactly
(at every probe step the summed outputs equal the summed gradients, float64 reference); a
float candidate's probe carries the lanes in its own payload under op Average, and a switch
carries the error feedback over (outputs plus every rank's pending residual equal the summed
gradients at every step); a link measured on the unthrottled loopback keeps every tensor on
fp16; a gathered checkpoint resumes the schedule and choice; metrics and the log say what was
chosen and why; TensorFlow's ``tf.function`` is refused with a clear error.
"""
import numpy as np
import pytest

from tests.backends import backend_unusable
from tests.hvdrun import run

SHAPE = (64, 64)
STEPS = 11  # probes at steps 2, 6, 10 (warmup=3, every=4)
PROBES = (2, 6, 10)
# A slow link (100 kbit/s): every compressed candidate beats fp16 by far, and THC starts.
# THC sums exactly (integers), so a flush leaves no error at all; TopKC's float16 sum rounds.
SLOW = dict(candidates="fp16|thc:4|thc:8", bandwidth_gbit=0.0001, latency_ms=0.1,
            warmup=3, every=4)
# PowerSGD starts (fewest bytes); at the first probe the step gate (a huge penalty) sends the
# tensor to fp16, with PowerSGD's residual carried (random data: its error is near 1).
GATE = dict(candidates="fp16|powersgd:4", bandwidth_gbit=0.0001, latency_ms=0.1, warmup=3,
            every=4, step_penalty=1e6, error_budget=2.0)
GATE_STEPS = 6


def _grad(rank, step, shape=SHAPE):
    """Rank ``rank``'s gradient at ``step`` (float64 NumPy): a shared part plus noise."""
    common = np.random.default_rng([7, step]).standard_normal(shape)
    return common + 0.3 * np.random.default_rng([rank, step]).standard_normal(shape)


def _torch_worker():
    import logging

    import horovod.torch as hvd
    import torch

    from tests.hvdrun import LogRecords
    from torch_backend import Compression

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    logs = LogRecords()
    logging.getLogger("hvd_gradcomp").addHandler(logs)
    logging.getLogger("hvd_gradcomp").setLevel(logging.INFO)
    res = {"rank": rank}

    def steps(comp, first, last, name="w"):
        outs, choices = [], []
        for t in range(first, last):
            x = torch.as_tensor(_grad(rank, t)).float()
            out = hvd.allreduce(x, name=name, compression=comp, op=hvd.Sum)
            outs.append(out.double().numpy())
            choices.append(comp.routes() and comp.metrics()[name].get("scheme"))
        return outs, choices

    # 1. Slow link: a switch after the first window; every probe flushes exactly.
    comp = Compression.auto(**SLOW)
    outs, choices = steps(comp, 0, STEPS)
    res["slow_outs"] = outs
    res["slow_choices"] = choices
    res["slow_metrics"] = {k: v for k, v in comp.metrics()["w"].items() if not hasattr(v, "numpy")}
    res["slow_decision"] = tuple(comp.scheme.decisions["w"])
    res["slow_history"] = comp.decisions()
    res["slow_wire"] = comp.wire_bytes()["w"].payload
    # 2. Checkpoint after step 6, resume in a new compressor: same outputs as going on.
    comp_a = Compression.auto(**SLOW)
    steps(comp_a, 0, 7)
    saved = comp_a.state_dict(gather=True)
    rest_a, _ = steps(comp_a, 7, STEPS)
    comp_b = Compression.auto(**SLOW)
    comp_b.load_state_dict(saved)
    rest_b, choices_b = steps(comp_b, 7, STEPS)
    # The resumed first step is a sync step (a float32 flush of what each rank owes: auto's
    # Agreement), so its outputs differ from going on; by the probe at step 10 (THC's exact
    # flush) both runs have delivered everything: the same sums, and the same schedule.
    res["resume_same"] = np.allclose(sum(rest_a), sum(rest_b), rtol=0, atol=1e-4)
    res["resume_choices"] = choices_b
    # 3. Lanes riding on PowerSGD's payload under Average; the switch to fp16 carries.
    comp_g = Compression.auto(**GATE)
    res["gate"] = _gate_run(lambda x: hvd.allreduce(x, name="g", compression=comp_g, op=hvd.Average),
                            lambda t: torch.as_tensor(_grad(rank, t)).float(), comp_g, rank)
    # 4. Link measured on the loopback: fast, so nothing pays against fp16's cast.
    comp = Compression.auto(candidates="fp16|topkc:0.1|thc:4", warmup=3, every=4)
    res["link"] = tuple(comp.scheme.link)
    res["start_costs"] = comp.scheme.start_costs
    _, choices = steps(comp, 0, 6, name="fast")
    res["fast_choices"] = choices
    res["fast_history"] = comp.decisions()
    res["link_logs"] = [m for m in logs.messages if "link measured" in m]
    res["logs"] = [m for m in logs.messages if "auto:" in m]
    return res


def _gate_run(allreduce, tensor, comp, rank):
    """GATE_STEPS steps of ``comp`` on tensor "g": outputs, choices, state fields and this
    rank's pending error feedback (float64) after each, and the decision history."""
    from hvd_gradcomp import composite
    outs, choices, fields, owed = [], [], [], []
    for t in range(GATE_STEPS):
        outs.append(np.asarray(allreduce(tensor(t)), dtype=np.float64))
        choices.append(comp.metrics()["g"].get("scheme"))
        state = comp.codec.store.read("g")
        fields.append(tuple(state._fields))
        pending = composite.residual_of(comp.scheme, comp.ops, state, comp.codec.tensors.infos["g"])
        owed.append(np.zeros(SHAPE) if pending is None else
                    np.asarray(comp.ops.to_host(pending), dtype=np.float64).reshape(SHAPE))
    return {"outs": outs, "choices": choices, "fields": fields, "owed": owed,
            "history": comp.decisions()}


def _tf_worker():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tests.hvdrun import value_error
    from tf_backend import Compression

    hvd.init()
    rank = hvd.rank()
    res = {"rank": rank}
    comp = Compression.auto(**SLOW)
    outs, choices = [], []
    for t in range(STEPS):
        x = tf.constant(_grad(rank, t), tf.float32)
        out = hvd.allreduce(x, name="w", compression=comp, op=hvd.Sum)
        outs.append(out.numpy().astype(np.float64))
        choices.append(comp.metrics()["w"].get("scheme"))
    res["outs"], res["choices"] = outs, choices
    comp_g = Compression.auto(**GATE)
    res["gate"] = _gate_run(lambda x: hvd.allreduce(x, name="g", compression=comp_g, op=hvd.Average),
                            lambda t: tf.constant(_grad(rank, t), tf.float32), comp_g, rank)

    graph_comp = Compression.auto(**SLOW)

    @tf.function
    def step(x):
        return hvd.allreduce(x, name="g", compression=graph_comp, op=hvd.Sum)

    res["graph_error"] = value_error(lambda: step(tf.ones(SHAPE)))
    # DistributedGradientTape all-reduces in a tf.function of its own, even eagerly: the
    # refusal names the way out, and with it a Keras model trains on auto.
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, input_shape=(48,)), tf.keras.layers.Dense(4)])
    x = tf.constant(_grad(rank, 0)[:, :48], tf.float32)
    tape_comp = Compression.auto(**GATE)

    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=tape_comp, op=hvd.Average)
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    res["tape_error"] = value_error(tape_step)
    tf.config.run_functions_eagerly(True)
    try:
        res["tape_grads"] = [tape_step() for _ in range(4)]
    finally:
        tf.config.run_functions_eagerly(False)
    res["tape_choices"] = {k: v.get("scheme") for k, v in tape_comp.metrics().items()}
    return res


def _check_flushes(outs):
    """At each probe step (and the sync step 0), the summed outputs so far equal the summed
    gradients (float64); between probes THC's error feedback is pending."""
    total_out = np.zeros(SHAPE)
    total_in = np.zeros(SHAPE)
    for t, out in enumerate(outs):
        total_out += out
        total_in += _grad(0, t) + _grad(1, t)
        rel = np.linalg.norm(total_out - total_in) / np.linalg.norm(total_in)
        if t in PROBES or t == 0:  # step 0: the sync step, a float32 flush too
            assert rel < 1e-6, (t, rel)  # float32 rounding of the probe payload only
        elif t in (1, PROBES[0] + 1):
            assert rel > 1e-3, (t, rel)  # a compressed step: error feedback pending


def _check_gate(ranks):
    """The gate run on every rank: the same choices and outputs; PowerSGD from the sync
    step (step 0, exact) until the first probe (step 2), then fp16 with the carry held for one step; at every step the ranks'
    mean outputs times 2 plus their pending residuals equal the summed gradients."""
    r0, r1 = (r["gate"] for r in ranks)
    assert r0["choices"] == r1["choices"] == ["powersgd:rank=4"] * 2 + ["fp16"] * (GATE_STEPS - 2)
    assert r0["history"] == r1["history"] and r0["history"][0]["reason"].startswith("step gate")
    for a, b in zip(r0["outs"], r1["outs"]):
        np.testing.assert_array_equal(a, b)
    assert "carry" in r0["fields"][2] and "carry" not in r0["fields"][3]
    total_in = np.zeros(SHAPE)
    total_out = np.zeros(SHAPE)
    for t in range(GATE_STEPS):
        total_in += _grad(0, t) + _grad(1, t)
        total_out += 2 * r0["outs"][t]  # op Average
        owed = r0["owed"][t] + r1["owed"][t]
        assert np.linalg.norm(owed) > 1.0 if 0 < t < 3 else np.linalg.norm(owed) == 0, t  # 0: sync
        rel = np.linalg.norm(total_out + owed - total_in) / np.linalg.norm(total_in)
        assert rel < 2e-3, (t, rel)  # fp16 payloads round


@pytest.fixture(scope="module")
def torch_results():
    why = backend_unusable("torch")
    if why:
        pytest.skip(why)
    return run(_torch_worker, np=2, timeout=240)


@pytest.fixture(scope="module")
def tf_results():
    why = backend_unusable("tensorflow")
    if why:
        pytest.skip(why)
    return run(_tf_worker, np=2, timeout=240)


def test_torch_same_decisions_and_outputs_on_every_rank(torch_results):
    r0, r1 = torch_results
    assert r0["slow_choices"] == r1["slow_choices"]
    assert r0["slow_decision"] == r1["slow_decision"]
    for a, b in zip(r0["slow_outs"], r1["slow_outs"]):
        np.testing.assert_array_equal(a, b)
    # THC from the start (the fewest bytes on the slow link), and kept at every probe.
    assert r0["slow_choices"] == ["thc"] * STEPS


def test_torch_thc_probes_flush_exactly(torch_results):
    _check_flushes(torch_results[0]["slow_outs"])


def test_torch_riding_lanes_and_carried_switch(torch_results):
    _check_gate(torch_results)


def test_torch_metrics_and_log_say_what_and_why(torch_results):
    r0, r1 = torch_results
    m = r0["slow_metrics"]
    assert m["scheme"] == r0["slow_choices"][-1]
    assert m["reason"].startswith(("least predicted time", "kept"))
    assert m["predicted_ms"] < m["fp16_predicted_ms"]
    assert 0 <= m["error"] <= 0.95
    assert m["bytes_saved"] == 2 * 64 * 64 - r0["slow_wire"] > 0
    # The decision history (what the TTA harness records and plots), the same on every rank:
    # one record per probe (steps 2, 6, 10), with every candidate's prediction and error.
    h = r0["slow_history"]
    assert h == r1["slow_history"]
    assert [(d["key"], d["step"]) for d in h] == [("w", 2), ("w", 6), ("w", 10)]
    assert [d["scheme"] for d in h] == [r0["slow_choices"][3], r0["slow_choices"][7], m["scheme"]]
    assert set(h[0]["predicted_ms"]) == set(h[0]["errors"]) == {"fp16", "thc", "thc:bits=8"}  # canonical specs
    assert h[-1]["predicted_ms"][m["scheme"]] == m["predicted_ms"] and h[-1]["reason"] == m["reason"]
    # One line per change (the gate run's, tensor g), on rank 0 only.
    assert not [l for l in r0["logs"] if "tensor w:" in l]
    changes = [l for l in r0["logs"] if "tensor g:" in l]
    assert len(changes) == 1 and "powersgd:rank=4 -> fp16 at step 2 (step gate" in changes[0]
    assert not [l for l in r1["logs"] if "tensor g:" in l]


def test_torch_checkpoint_resumes_schedule_and_choice(torch_results):
    for r in torch_results:
        assert r["resume_same"]
        assert r["resume_choices"] == r["slow_choices"][7:]


def test_torch_unthrottled_link_stays_fp16(torch_results):
    r0, r1 = torch_results
    assert r0["link"] == r1["link"]  # averaged over the ranks
    assert r0["link"][0] > 1e7  # loopback: far above 10 MB/s
    assert 1e6 < r0["link"][2] < 10 * r0["link"][0]  # float16 payloads: measured on their own
    # calibrate() also timed the candidates' codecs on the reference matrix (the ranks' mean).
    # Whether the start is compressed depends on the loopback's measured rate (0.3-1.1 GB/s on
    # 2 busy cores: TopKC may pay on a 1M-coordinate matrix); the first probe (step 2) finds
    # fp16's cast cheapest for this 64 x 64 tensor, and every rank takes it.
    assert r0["start_costs"] == r1["start_costs"] and len(r0["start_costs"]) == 3
    assert all(c > 0 for c in r0["start_costs"])
    assert r0["fast_choices"] == r1["fast_choices"]
    assert r0["fast_choices"][3:] == ["fp16"] * 3
    d = [h for h in r0["fast_history"] if h["key"] == "fast"][0]
    assert d["scheme"] == "fp16" and d["predicted_ms"]["fp16"] < d["predicted_ms"]["thc"]
    assert len(r0["link_logs"]) == 1 and "link measured over 2 ranks" in r0["link_logs"][0]
    assert not r1["link_logs"]


def test_tf_eager_same_decisions_flush_and_carried_switch(tf_results):
    r0, r1 = tf_results
    assert r0["choices"] == r1["choices"] == ["thc"] * STEPS
    for a, b in zip(r0["outs"], r1["outs"]):
        np.testing.assert_array_equal(a, b)
    _check_flushes(r0["outs"])
    _check_gate(tf_results)


def test_tf_function_is_refused_clearly(tf_results):
    for r in tf_results:
        assert r["graph_error"] is not None and "runs eagerly only" in r["graph_error"]
        assert r["tape_error"] is not None and "run_functions_eagerly(True)" in r["tape_error"]


def test_tf_gradient_tape_runs_auto_with_functions_run_eagerly(tf_results):
    r0, r1 = tf_results
    assert len(r0["tape_grads"]) == 4
    for a, b in zip(r0["tape_grads"], r1["tape_grads"]):  # averaged: the same on every rank
        for ga, gb in zip(a, b):
            np.testing.assert_array_equal(ga, gb)
            assert np.isfinite(ga).all() and np.abs(ga).max() > 0
    # The 64 x 48 kernel started on PowerSGD and the step gate sent it to fp16 at step 2.
    assert r0["tape_choices"] == r1["tape_choices"] and "fp16" in r0["tape_choices"].values()
