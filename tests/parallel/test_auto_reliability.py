"""Half-precision gradients, a large carried residual, and ``auto``'s agreement across ranks:
2 real Horovod ranks (Gloo), PyTorch and TensorFlow (eager; ``auto`` runs eagerly only), one
launch per framework.

1. float16 and bfloat16 gradients of 2e4 per coordinate on each rank (the sum, 4e4, fits
   float16), every scheme (fp16, topkc, thc, powersgd, auto), op Sum and Average, 5 steps:
   every output finite (float16: at most 65504), the same on both ranks, and outputs plus
   the ranks' pending error feedback equal the float64 sum of the gradients.
2. ``auto`` on TopKC, one coordinate of 1e6 on rank 0 at step 1, sent to fp16 by the step
   gate at its first probe (step 2): every step finite but the one rank 1's NaN fails (step
   8), and the whole 1e6 delivered within 24 steps, at most 65504 a step.
3. ``hvd.join()`` with uneven data: both ranks run steps 0-1, rank 0 a third (its probe,
   with rank 1 joined), then both join and run 8 more steps: no shape mismatch, no decision
   from rank 0's lanes alone, the same decisions and outputs on both ranks afterwards, and
   nothing of the gradient lost (float64).
4. A state saved with ``state_dict(gather=True)`` after 7 steps and loaded on rank 0 only
   into a new compressor (rank 1's is fresh, on another choice): the first step realigns
   both ranks on rank 0's step and choice; the same outputs on both ranks, nothing lost.
5. ``auto``'s calibration is measured once per process: after the first compressor, 10 more
   are built in a fraction of its time with the same link and codec figures; when one rank
   lacks them, every rank measures again (no hang), and all agree.
"""
import numpy as np
import pytest

from tests.backends import BACKENDS
from tests.hvdrun import run

SHAPE = (64, 64)
SPECS = ("fp16", "topkc:0.1", "thc:4", "powersgd:2",
         "auto:candidates=fp16|topkc:0.1,bandwidth_gbit=0.0001,latency_ms=0.1,warmup=3,every=4")
# Starts on TopKC (a slow link), and the step gate sends it to fp16 at the first probe.
GATED = dict(candidates="fp16|topkc:0.1", bandwidth_gbit=0.0001, latency_ms=0.1, warmup=3,
             every=4, step_penalty=1e6)


def _large(rank, step):
    return 2e4 * (1.0 + 0.01 * np.random.default_rng([rank, step]).standard_normal(SHAPE))


def _small(rank, step):
    return np.random.default_rng([5, rank, step]).standard_normal(SHAPE)


def _spiked(rank, step):
    g = 0.01 * np.random.default_rng([rank, step]).standard_normal(SHAPE)
    if step == 1 and rank == 0:
        g[3, 5] = 1e6
    if step == 8 and rank == 1:
        g[0, 0] = np.nan
    return g


def _scenarios(hvd, comp_of, tensor, to_numpy, rank):
    """The four cases on one framework: ``comp_of(spec or options)`` builds a compressor,
    ``tensor(values, dtype)`` a gradient, ``to_numpy`` the float64 output."""
    from hvd_gradcomp import composite
    res = {}

    def step(comp, g, dtype="float32", op=hvd.Sum, name="w"):
        return to_numpy(hvd.allreduce(tensor(g, dtype), name=name, compression=comp, op=op))

    def pending(comp, name="w"):
        """This rank's pending error feedback (float64, gradient coordinates)."""
        state = comp.codec.store.read(name) if comp.codec.store.has(name) else None
        scheme = comp.table.routes[name].scheme
        owed = None if state is None else composite.residual_of(scheme, comp.ops, state, comp.codec.tensors.infos[name])
        return np.zeros(SHAPE) if owed is None else \
            np.asarray(comp.ops.to_host(owed), dtype=np.float64).reshape(SHAPE)

    # 1. half-precision gradients, every scheme
    half = {}
    for spec in SPECS:
        for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
            for dtype in ("float16", "bfloat16"):
                comp = comp_of(spec)
                outs = [step(comp, _large(rank, t), dtype, op) for t in range(5)]
                half[spec, op_name, dtype] = (outs, pending(comp))
    res["half"] = half
    # 2. a large carried residual
    comp = comp_of(GATED)
    res["spiked"] = ([step(comp, _spiked(rank, t)) for t in range(24)], pending(comp),
                     [d["step"] for d in comp.decisions()])
    # 3. hvd.join() with uneven data
    comp = comp_of(GATED)
    outs = [step(comp, _small(rank, t)) for t in range(2 if rank else 3)]
    hvd.join()
    outs += [step(comp, _small(rank, t)) for t in range(len(outs), len(outs) + 8)]
    res["join"] = (outs, pending(comp), comp.decisions(), comp.metrics()["w"]["scheme"])
    # 4. a gathered state loaded on rank 0 only
    comp = comp_of(GATED)
    for t in range(7):
        step(comp, _small(rank, t))
    saved = comp.state_dict(gather=True)
    before = pending(comp)
    fresh = comp_of(GATED)
    if rank == 0:
        fresh.load_state_dict(saved)
    outs = [step(fresh, _small(rank, t)) for t in range(7, 13)]
    res["load"] = (outs, before, pending(fresh), fresh.metrics()["w"]["scheme"],
                   int(fresh.ops.to_host(fresh.metrics()["w"]["step"])))
    # 5. calibration measured once per process
    import time
    from hvd_gradcomp.auto import CALIBRATIONS
    CALIBRATIONS.clear()
    measured = dict(candidates="fp16|topkc:0.1", warmup=3, every=4)
    start = time.perf_counter()
    first = comp_of(measured)
    first_s = time.perf_counter() - start
    built = []
    for _ in range(10):
        start = time.perf_counter()
        comp = comp_of(measured)
        built.append((time.perf_counter() - start, tuple(comp.scheme.link), comp.scheme.start_costs))
    if rank == 1:
        CALIBRATIONS.clear()  # one rank without the figures: every rank measures again
    again = comp_of(measured)
    res["calibration"] = (first_s, tuple(first.scheme.link), first.scheme.start_costs, built,
                          tuple(again.scheme.link), again.scheme.start_costs)
    return res


def _torch_worker():
    import horovod.torch as hvd
    import torch

    from torch_backend import Compression
    from torch_backend.ops import to_torch_dtype
    hvd.init()
    torch.set_num_threads(1)

    def comp_of(spec):
        return Compression.from_spec(spec) if isinstance(spec, str) else Compression.auto(**spec)
    return _scenarios(hvd, comp_of, lambda g, dtype: torch.as_tensor(g).to(to_torch_dtype(dtype)),
                      lambda out: out.float().double().numpy(), hvd.rank())


def _tf_worker():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tf_backend import Compression
    hvd.init()

    def comp_of(spec):
        return Compression.from_spec(spec) if isinstance(spec, str) else Compression.auto(**spec)
    return _scenarios(hvd, comp_of, lambda g, dtype: tf.cast(tf.constant(g, tf.float64), dtype),
                      lambda out: tf.cast(out, tf.float64).numpy(), hvd.rank())


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request):
    worker = _torch_worker if request.param == "torch" else _tf_worker
    return run(worker, np=2, timeout=420)


def _as_half(values, dtype):
    """``values`` rounded to ``dtype`` as the gradients were (float64)."""
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    bits = values.astype(np.float32).view(np.uint32)  # bfloat16: round to nearest even
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def test_half_precision_gradients_stay_finite_and_lose_nothing(ranks):
    r0, r1 = ranks
    for (spec, op, dtype), (outs, owed0) in r0["half"].items():
        outs1, owed1 = r1["half"][spec, op, dtype]
        sums = [o * (2 if op == "average" else 1) for o in outs]
        for t, (a, b) in enumerate(zip(outs, outs1)):
            assert np.isfinite(a).all(), (spec, op, dtype, t)
            np.testing.assert_array_equal(a, b)
            if dtype == "float16":
                assert float(np.abs(a).max()) <= 65504.0, (spec, op, dtype, t)
        sent = sum(_as_half(_large(r, t), dtype) for r in range(2) for t in range(5))
        rel = np.linalg.norm(sum(sums) + owed0 + owed1 - sent) / np.linalg.norm(sent)
        assert rel < (1e-2 if dtype == "bfloat16" else 2e-3), (spec, op, dtype, rel)


def test_large_carried_residual_saturates_and_is_delivered(ranks):
    r0, r1 = ranks
    (outs, owed0, probes), (outs1, owed1, _) = r0["spiked"], r1["spiked"]
    assert probes == [2, 6, 10, 14, 18, 22]
    assert [int(not np.isfinite(o).all()) for o in outs] == [0] * 8 + [1] + [0] * 15
    good = [o for t, o in enumerate(outs) if t != 8]
    assert max(float(np.abs(o).max()) for o in good) <= 65504.0
    for a, b in zip(outs, outs1):
        np.testing.assert_array_equal(a, b)
    expected = sum(_spiked(0, t) + _spiked(1, t) for t in range(24) if t != 8)
    assert abs(sum(good)[3, 5] - expected[3, 5]) <= 1e-3 * 1e6
    assert np.abs(owed0 + owed1).max() == 0.0
    rest = np.ones(SHAPE, bool)
    rest[3, 5] = False
    assert np.abs(sum(good) - expected)[rest].max() < 1e-2  # float16 rounding of 0.01-scale values


def test_join_with_uneven_data_stays_in_step(ranks):
    r0, r1 = ranks
    (outs0, owed0, hist0, scheme0), (outs1, owed1, hist1, scheme1) = r0["join"], r1["join"]
    assert len(outs0) == 11 and len(outs1) == 10
    assert hist0 == hist1 and [d["step"] for d in hist0] == [2, 6]  # none at rank 0's solo probe
    assert scheme0 == scheme1 == "fp16"
    for a, b in zip(outs0[3:], outs1[2:]):
        np.testing.assert_array_equal(a, b)
    sent = sum(_small(0, t) for t in range(11)) + sum(_small(1, t) for t in range(10))
    rel = np.linalg.norm(sum(outs0) + owed0 + owed1 - sent) / np.linalg.norm(sent)
    assert rel < 2e-3, rel  # float16 payloads round


def test_state_loaded_on_rank_0_only_realigns_in_one_step(ranks):
    r0, r1 = ranks
    (outs0, before0, owed0, scheme0, step0), (outs1, before1, owed1, scheme1, step1) = r0["load"], r1["load"]
    assert scheme0 == scheme1 == "fp16" and step0 == step1 == 13
    for a, b in zip(outs0, outs1):
        np.testing.assert_array_equal(a, b)
    # The first step delivers what rank 0 owed at the save (loaded) plus both gradients;
    # rank 1's owed error feedback stayed with its old compressor.
    sent = sum(_small(0, t) + _small(1, t) for t in range(7, 13)) + before0
    rel = np.linalg.norm(sum(outs0) + owed0 + owed1 - sent) / np.linalg.norm(sent)
    assert rel < 2e-3, rel


def test_calibration_is_shared_by_the_compressors_of_a_process(ranks):
    r0, r1 = ranks
    first_s, link, costs, built, again_link, again_costs = r0["calibration"]
    assert r1["calibration"][1:3] == (link, costs) and len(costs) == 2
    for seconds, b_link, b_costs in built:
        assert (b_link, b_costs) == (link, costs)
        assert seconds < first_s / 4, (seconds, first_s)
    assert r1["calibration"][4:] == (again_link, again_costs)  # measured again, agreed
    assert again_link != link
