"""EF21 error feedback and the FP16 warm-up under real Horovod (2 ranks, Gloo): one PyTorch
launch and one TensorFlow launch run every check below.

PyTorch (``worker``): ``hvd.allreduce(x, name=..., op=..., compression=...)`` of tensors known
in advance (``known(rank, step)``), compared with the float64 EF21 recursion
(tests/reference.py:RefTopKCEF21) under Sum and Average; a checkpoint (save after 3 steps,
load into a fresh compressor, 3 more steps equal 6 uninterrupted; a gathered state loaded as
if on another number of ranks restarts h_i and H at 0); ``hvd.join()`` (rank 1 joins after one
step while rank 0 goes on): EF21 realigns at the first step after the join (output 0 on both
ranks, counted in ``metrics()``) and then matches the recursion restarted at 0, and an FP16
warm-up is held back while rank 1 is joined (no shape mismatch), then both ranks hand over at
the same step. TensorFlow (``worker_tf``): the EF21 values and the warm-up hand-over through
``hvd.allreduce`` eagerly; a ``tf.function`` refuses the warm-up with a ValueError.
"""
import numpy as np
import pytest

from tests.hvdrun import run
from tests.reference import RefTopKCEF21, allreduce_fp16, fp16

SHAPE = (24, 40)  # 960 coordinates: 120 chunks of 8, 30 sent per step at ratio 0.25
D = 960
EF21 = "topkc:ratio=0.25,chunk=8,error_feedback=ef21,min_numel=1"
STEPS = 5
TIMEOUT = 240


def known(rank, step, salt=0):
    gen = np.random.default_rng([salt, rank, step])
    return (gen.standard_normal(SHAPE) * gen.uniform(0.1, 3.0, SHAPE).round(1)).astype(np.float32)


def _ef21_reference(op, steps, salt, payload="float16", start=0):
    ref = RefTopKCEF21(D, 2, 0.25, 8, payload)
    return [ref.step([known(r, s, salt).astype(np.float64) for r in range(2)], op) for s in range(start, start + steps)]


def _fp16_reference(op, step, salt, ranks=(0, 1)):
    parts = [fp16(known(r, step, salt).astype(np.float64).reshape(-1) / 2) if r in ranks else np.zeros(D)
             for r in range(2)]
    return allreduce_fp16(parts, op) * 2


def worker():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}

    def reduce(comp, step, salt, op, name="x"):
        t = torch.from_numpy(known(rank, step, salt))
        return hvd.allreduce(t, name=name, op=hvd.Sum if op == "sum" else hvd.Average,
                             compression=comp).numpy().astype(np.float64)

    # 1. EF21 values, Sum and Average, fp16 and fp32 payloads.
    for op in ("sum", "average"):
        for payload in ("float16", "float32"):
            comp = Compression.from_spec(EF21 + f",payload_dtype={payload}")
            out[f"values_{op}_{payload}"] = [reduce(comp, s, 1, op, f"v.{op}.{payload}") for s in range(STEPS)]

    # 2. Checkpoint: 3 steps, save, a fresh compressor loads it, 3 more == 6 uninterrupted.
    full = Compression.from_spec(EF21)
    out["ckpt_full"] = [reduce(full, s, 2, "average", "c") for s in range(6)]
    half = Compression.from_spec(EF21)
    for s in range(3):
        reduce(half, s, 2, "average", "c")
    saved = half.state_dict()
    out["ckpt_fields"] = sorted(saved["tensors"]["c"])
    resumed = Compression.from_spec(EF21)
    resumed.load_state_dict(saved)
    out["ckpt_resumed"] = [reduce(resumed, s, 2, "average", "c") for s in range(3, 6)]
    # ... and a gathered state of "one rank" (rank 0's part alone), loaded on two: h_i and H
    # restart at 0 on both ranks, scores and step kept.
    gathered = half.state_dict(gather=True)
    elastic = Compression.from_spec(EF21)
    elastic.load_state_dict({"spec": gathered["spec"], "world_size": 1, "ranks": gathered["ranks"][:1]})
    out["elastic_first"] = reduce(elastic, 3, 2, "average", "c")
    st = elastic.state_dict()["tensors"]["c"]
    out["elastic_state"] = {f: np.asarray(v).copy() for f, v in st.items()}

    # 3. Join: rank 1 joins after step 0, rank 0 takes steps 1 and 2 alone, then both go on.
    for label, spec in (("join_ef21", EF21 + ",payload_dtype=float32"),
                        ("join_warmup", EF21 + ",fp16_warmup=2")):
        comp = Compression.from_spec(spec)
        outs = [reduce(comp, 0, 3, "sum", label)]
        if rank == 0:
            outs += [reduce(comp, s, 3, "sum", label) for s in (1, 2)]
        hvd.join()
        states = []
        for s in range(3, 7):
            outs.append(reduce(comp, s, 3, "sum", label))
            states.append({f: np.asarray(v).copy() for f, v in comp.state_dict()["tensors"][label].items()})
        out[label] = {"outs": outs, "states": states, "realigned": int(comp.metrics()[label]["realigned"])}
    return out


@pytest.fixture(scope="module")
def results():
    return run(worker, np=2, timeout=TIMEOUT)


@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("payload", ["float16", "float32"])
def test_ef21_values(results, op, payload):
    expected = _ef21_reference(op, STEPS, 1, payload)
    tol = 2e-3 if payload == "float16" else 1e-5
    for step in range(STEPS):
        for r in range(2):
            got = results[r][f"values_{op}_{payload}"][step].reshape(-1)
            np.testing.assert_allclose(got, expected[step], rtol=0, atol=tol * np.abs(expected[step]).max(),
                                       err_msg=f"{op} {payload} step {step} rank {r}")
        np.testing.assert_array_equal(results[0][f"values_{op}_{payload}"][step],
                                      results[1][f"values_{op}_{payload}"][step])


def test_ef21_checkpoint(results):
    for r in range(2):
        assert results[r]["ckpt_fields"] == ["estimate", "local", "momentum", "realigned", "scores", "step"]
        for a, b in zip(results[r]["ckpt_full"][3:], results[r]["ckpt_resumed"]):
            np.testing.assert_array_equal(a, b)
        st = results[r]["elastic_state"]
        assert int(st["step"]) == 4 and int(st["realigned"]) == 0
    # Restarted at 0: the first step after the elastic load delivers the selected chunks of
    # the gradient alone (H = the all-reduced C(g_i)), the same on both ranks.
    np.testing.assert_array_equal(results[0]["elastic_first"], results[1]["elastic_first"])
    first = results[0]["elastic_first"].reshape(-1)
    assert np.count_nonzero(first) == 30 * 8


def test_ef21_join_realigns(results):
    res = [results[r]["join_ef21"] for r in range(2)]
    # Step 0 (both ranks) matches the recursion; steps 1-2 are rank 0's alone.
    expected0 = _ef21_reference("sum", 1, 3, "float32")[0]
    np.testing.assert_allclose(res[0]["outs"][0].reshape(-1), expected0, rtol=0, atol=1e-5 * np.abs(expected0).max())
    assert len(res[0]["outs"]) == 7 and len(res[1]["outs"]) == 5
    # The first step after the join: rank 1's state is two steps behind: 0 on both, realigned.
    for r in range(2):
        after = res[r]["outs"][-4]
        assert not after.any(), "a disagreement must give 0, never a wrong sum"
        assert res[r]["realigned"] == 1
        assert int(res[r]["states"][0]["step"]) == 0 and not res[r]["states"][0]["estimate"].any()
    for s in range(1, 4):
        np.testing.assert_array_equal(res[0]["outs"][-4 + s], res[1]["outs"][-4 + s])
        assert res[0]["outs"][-4 + s].any()


def test_warmup_held_back_during_join(results):
    res = [results[r]["join_warmup"] for r in range(2)]
    # Step 0: FP16 on both ranks; steps 1-2: rank 0 alone, still FP16 (rank 1 is joined).
    for step, ranks in ((0, (0, 1)), (1, (0,)), (2, (0,))):
        expected = _fp16_reference("sum", step, 3, ranks)
        np.testing.assert_allclose(res[0]["outs"][step].reshape(-1), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    # Step 3: rank 1 is back (it counted 1 step, rank 0 3): FP16 on both, and both hand over.
    expected = _fp16_reference("sum", 3, 3)
    for r in range(2):
        np.testing.assert_allclose(res[r]["outs"][-4].reshape(-1), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
        assert [int(s["warmup"]) for s in res[r]["states"]] == [-1, -1, -1, -1]
        assert res[r]["realigned"] == 0
    for s in range(-3, 0):
        np.testing.assert_array_equal(res[0]["outs"][s], res[1]["outs"][s])


def worker_tf():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    rank = hvd.rank()
    out = {}
    for op in ("sum", "average"):
        comp = Compression.from_spec(EF21 + ",payload_dtype=float32")
        out[f"values_{op}"] = [hvd.allreduce(tf.constant(known(rank, s, 1)), name=f"v{op}", compression=comp,
                                             op=hvd.Sum if op == "sum" else hvd.Average).numpy().astype(np.float64)
                               for s in range(STEPS)]
    comp = Compression.from_spec(EF21 + ",fp16_warmup=2")
    out["warmup"] = [hvd.allreduce(tf.constant(known(rank, s, 4)), name="w", compression=comp, op=hvd.Sum).numpy()
                     .astype(np.float64) for s in range(4)]
    out["warmup_state"] = int(comp.state_dict()["tensors"]["w"]["warmup"])
    graph = Compression.from_spec(EF21 + ",fp16_warmup=2")

    @tf.function
    def step(x):
        return hvd.allreduce(x, name="g", compression=graph, op=hvd.Sum)
    try:
        step(tf.constant(known(rank, 0, 5)))
        out["graph"] = None
    except ValueError as e:
        out["graph"] = str(e)
    return out


@pytest.fixture(scope="module")
def results_tf():
    return run(worker_tf, np=2, timeout=TIMEOUT)


@pytest.mark.parametrize("op", ["sum", "average"])
def test_tf_ef21_values(results_tf, op):
    expected = _ef21_reference(op, STEPS, 1, "float32")
    for step in range(STEPS):
        for r in range(2):
            got = results_tf[r][f"values_{op}"][step].reshape(-1)
            np.testing.assert_allclose(got, expected[step], rtol=0, atol=1e-5 * np.abs(expected[step]).max())


def test_tf_warmup(results_tf):
    for r in range(2):
        for step in range(2):
            expected = _fp16_reference("sum", step, 4)
            np.testing.assert_allclose(results_tf[r]["warmup"][step].reshape(-1), expected, rtol=0,
                                       atol=1e-6 * np.abs(expected).max())
        assert results_tf[r]["warmup_state"] == -1
        assert results_tf[r]["graph"] is not None and "fp16_warmup" in results_tf[r]["graph"]
        assert "topkc:ratio=0.25" in results_tf[r]["graph"] and "eager" in results_tf[r]["graph"]  # TF prefixes its trace
    for s in (2, 3):
        np.testing.assert_array_equal(results_tf[0]["warmup"][s], results_tf[1]["warmup"][s])
