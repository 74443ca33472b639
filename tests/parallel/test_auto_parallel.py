"""``auto`` under real Horovod: 2 ranks, Gloo, one PyTorch and one TensorFlow (eager) launch.

Each rank's gradient at step t comes from ``_grad(rank, t)``, so the host rebuilds the float64
sums. Checks: the ranks take the same decisions; a switch keeps error feedback exact (at every
probe step the summed outputs equal the summed gradients, float64 reference); a link measured
on the unthrottled loopback keeps every tensor on fp16; a gathered checkpoint resumes the
schedule and choice; metrics and the log say what was chosen and why; TensorFlow's
``tf.function`` is refused with a clear error.
"""
import numpy as np
import pytest

from tests.backends import BACKENDS
from tests.hvdrun import run
from tests.reference import allreduce_fp16, fp16, fp32

SHAPE = (64, 64)
STEPS = 11  # probes at steps 2, 6, 10 (warmup=3, every=4)
PROBES = (2, 6, 10)
# A slow link (100 kbit/s): every compressed candidate beats fp16 by far.
# THC sums exactly (integers), so a flush leaves no error at all; TopKC's float16 sum rounds.
SLOW = dict(candidates="fp16|thc:4|thc:8", bandwidth_gbit=0.0001, latency_ms=0.1,
            warmup=3, every=4)


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
    res["logs"] = [m for m in logs.messages if "auto:" in m]
    # 2. Checkpoint after step 6, resume in a new compressor: same outputs as going on.
    comp_a = Compression.auto(**SLOW)
    steps(comp_a, 0, 7)
    saved = comp_a.state_dict(gather=True)
    rest_a, _ = steps(comp_a, 7, STEPS)
    comp_b = Compression.auto(**SLOW)
    comp_b.load_state_dict(saved)
    rest_b, choices_b = steps(comp_b, 7, STEPS)
    res["resume_same"] = all(np.array_equal(a, b) for a, b in zip(rest_a, rest_b))
    res["resume_choices"] = choices_b
    # 3. Link measured on the loopback: fast, so nothing pays against fp16's cast.
    comp = Compression.auto(candidates="fp16|topkc:0.1|thc:4", warmup=3, every=4)
    res["link"] = tuple(comp.scheme.link)
    _, choices = steps(comp, 0, 4, name="fast")
    res["fast_choices"] = choices
    res["link_logs"] = [m for m in logs.messages if "link measured" in m]
    return res


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

    graph_comp = Compression.auto(**SLOW)

    @tf.function
    def step(x):
        return hvd.allreduce(x, name="g", compression=graph_comp, op=hvd.Sum)

    res["graph_error"] = value_error(lambda: step(tf.ones(SHAPE)))
    return res


def _fp16_sum(t):
    """fp16's step (no error feedback): each rank's x / 2 in float16, summed in float16, x 2."""
    return allreduce_fp16([fp16(fp32(_grad(r, t)) * 0.5) for r in (0, 1)], "sum") * 2


def _check_flushes(outs):
    """At each probe step, the summed outputs so far equal the summed gradients (float64),
    fp16's own rounding on the steps before the first probe aside."""
    total_out = np.zeros(SHAPE)
    total_in = np.zeros(SHAPE)
    for t, out in enumerate(outs):
        total_out += out
        total_in += _fp16_sum(t) if t < PROBES[0] else _grad(0, t) + _grad(1, t)
        rel = np.linalg.norm(total_out - total_in) / np.linalg.norm(total_in)
        if t < PROBES[0]:
            assert rel < 1e-12, (t, rel)
        if t in PROBES:
            assert rel < 1e-6, (t, rel)  # float32 rounding of the probe payload only
        elif t == PROBES[0] + 1:
            assert rel > 1e-3, (t, rel)  # a compressed step in between: error feedback pending


@pytest.fixture(scope="module")
def torch_results():
    if "torch" not in BACKENDS:
        pytest.skip("torch backend not under test")
    return run(_torch_worker, np=2, timeout=240)


@pytest.fixture(scope="module")
def tf_results():
    if "tensorflow" not in BACKENDS:
        pytest.skip("tensorflow backend not under test")
    return run(_tf_worker, np=2, timeout=240)


def test_torch_same_decisions_and_outputs_on_every_rank(torch_results):
    r0, r1 = torch_results
    assert r0["slow_choices"] == r1["slow_choices"]
    assert r0["slow_decision"] == r1["slow_decision"]
    for a, b in zip(r0["slow_outs"], r1["slow_outs"]):
        np.testing.assert_array_equal(a, b)
    # fp16 through the first window, a compressed candidate from the first probe on.
    assert r0["slow_choices"][:2] == ["fp16", "fp16"]
    assert r0["slow_choices"][2] != "fp16"
    assert len(set(r0["slow_choices"][2:])) == 1


def test_torch_switch_keeps_error_feedback_exact(torch_results):
    _check_flushes(torch_results[0]["slow_outs"])


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
    # One line per change, on rank 0 only.
    assert len([l for l in r0["logs"] if "tensor w:" in l and "fp16 -> " in l]) == 1
    assert not [l for l in r1["logs"] if "tensor w:" in l]


def test_torch_checkpoint_resumes_schedule_and_choice(torch_results):
    for r in torch_results:
        assert r["resume_same"]
        assert r["resume_choices"] == r["slow_choices"][7:]


def test_torch_unthrottled_link_stays_fp16(torch_results):
    r0, r1 = torch_results
    assert r0["link"] == r1["link"]  # averaged over the ranks
    assert r0["link"][0] > 1e7  # loopback: far above 10 MB/s
    assert r0["fast_choices"] == r1["fast_choices"] == ["fp16"] * 4
    assert len(r0["link_logs"]) == 1 and "link measured over 2 ranks" in r0["link_logs"][0]
    assert not r1["link_logs"]


def test_tf_eager_same_decisions_and_exact_flush(tf_results):
    r0, r1 = tf_results
    assert r0["choices"] == r1["choices"]
    assert r0["choices"][2] != "fp16"
    for a, b in zip(r0["outs"], r1["outs"]):
        np.testing.assert_array_equal(a, b)
    _check_flushes(r0["outs"])


def test_tf_function_is_refused_clearly(tf_results):
    for r in tf_results:
        assert r["graph_error"] is not None and "runs eagerly only" in r["graph_error"]
