"""The stats helpers: :mod:`hvd_gradcomp.stats` (numbers and text, framework-free) and
:mod:`torch_backend.stats` on 2 real Horovod ranks (one launch).

The TensorFlow helpers (``tf_backend.stats``: ``CompressionStats`` in a GradientTape loop,
``CompressionStatsCallback`` in Keras ``fit``, TensorBoard) run in tests/test_examples.py.
"""
import logging
import math

import pytest

from hvd_gradcomp.base import TensorInfo, WireBytes
from hvd_gradcomp.registry import make_scheme
from hvd_gradcomp.stats import StatsLogger, WireReport, summarize
from tests.backends import requires_backend
from tests.hvdrun import LogRecords, run


# ---- framework-free: summarize, the line, the scalars ----

def test_summarize_adds_up_bytes_collectives_and_metrics():
    wire = {"w": WireBytes(1000), "b": WireBytes(64), "v": WireBytes(300, 40, 1)}
    metrics = {"w": {"saturated": 3, "realigned": 0}, "v": {"saturated": 4, "realigned": 2},
               "emb": {"sparse_bytes": 999, "sparse_steps": 5}}  # sparse: counted as bytes instead
    rep = summarize("thc", wire, coordinates=2000, metrics=metrics, sparse_bytes=160, sparse_collectives=2)
    assert (rep.tensors, rep.payload_bytes, rep.side_bytes, rep.side_collectives) == (3, 1364, 40, 1)
    assert rep.bytes_sent == 1364 + 40 + 160 and rep.fp16_bytes == 4000
    assert rep.collectives == 3 + 1 + 2 and rep.fp16_ratio == pytest.approx(4000 / 1564)
    assert rep.metrics == {"saturated": 7, "realigned": 2}
    assert rep.line() == ("thc: 1,564 B/step sent, FP16 4,000 B/step (FP16/ours 2.56x); 6 collectives/step "
                          "(3 payloads + 1 side + 2 sparse gathers of 160 B); realigned 2; saturated 7")
    assert rep.scalars() == {"compression/bytes_per_step": 1564.0, "compression/fp16_bytes_per_step": 4000.0,
                             "compression/collectives_per_step": 6.0,
                             "compression/fp16_ratio": pytest.approx(4000 / 1564),
                             "compression/saturated": 7.0, "compression/realigned": 2.0}


def test_report_before_any_step_and_bad_input():
    rep = summarize("topkc:ratio=0.1", {}, coordinates=10)
    assert rep.bytes_sent == 0 and rep.fp16_ratio is None and rep.collectives == 0
    assert rep.line() == "topkc:ratio=0.1: no gradient compressed yet"
    assert "compression/fp16_ratio" not in rep.scalars()
    # fp32 payloads: twice FP16's bytes, a ratio below 1
    rep = WireReport("none", 2, 400, 0, 0, 200)
    assert rep.fp16_ratio == 0.5 and "(FP16/ours 0.50x); 2 collectives/step (2 payloads + 0 side)" in rep.line()
    # no parameters given: no baseline, no ratio (rather than 0.00x)
    rep = summarize("fp16", {"w": WireBytes(200)}, coordinates=0)
    assert rep.fp16_ratio is None and "compression/fp16_ratio" not in rep.scalars()
    assert rep.line() == ("fp16: 200 B/step sent, FP16 unknown (no parameters counted); 1 collectives/step "
                          "(1 payloads + 0 side)")
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match=r"stats: coordinates must be an int >= 0, got"):
            summarize("fp16", {}, bad)
    with pytest.raises(TypeError, match=r"stats: expected a compressor from torch_backend.Compression"):
        StatsLogger(object())


# ---- PyTorch on 2 ranks ----

STEPS = 3
SPIKE = 1000.0  # the loss is multiplied by this at the last step: THC's lagged ranges saturate
SPECS = ("fp16", "none", "topkc:ratio=0.1", "thc", "thc:range=current")
SHAPES = [(32, 64), (32,), (10, 32), (10,)]  # Linear(64, 32), Linear(32, 10): 2,410 parameters


def worker_torch_stats(log_dir):
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    from torch_backend.stats import CompressionStats
    hvd.init()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    out = {}
    for spec in SPECS:
        net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
        comp = Compression.from_spec(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                       named_parameters=net.named_parameters(), compression=comp)
        logger = logging.getLogger(f"test.stats.{spec}")
        logger.setLevel(logging.INFO)
        logger.propagate = False
        handler = LogRecords()
        logger.addHandler(handler)
        stats = CompressionStats(comp, net.parameters(), every=2, logger=logger,
                                 log_dir=f"{log_dir}/{spec}" if spec == "thc" else None)
        before = stats.report()
        reports = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            (loss * (SPIKE if step == STEPS - 1 else 1.0)).backward()
            opt.step()
            stats.step()
            reports.append(stats.report())
        final = stats.log()
        stats.close()
        out[spec] = {"before": before, "reports": reports, "final": final, "lines": handler.messages,
                     "wire": comp.bytes_per_step()}
    return out


def _expected(spec):
    """Payload bytes, side bytes and side collectives per step from the schemes' wire formulas:
    tensors below 1024 coordinates go as fp16 under thc and topkc."""
    from hvd_gradcomp.registry import parse_spec
    name, options = parse_spec(spec)
    scheme = make_scheme(name, **options)
    payload = side = count = 0
    for i, shape in enumerate(SHAPES):
        numel = math.prod(shape)
        if name in ("thc", "topkc") and numel < 1024:
            payload += 2 * numel
            continue
        w = scheme.wire(TensorInfo(f"t{i}", shape, "float32", 2, 0, "average"))
        payload, side, count = payload + w.payload, side + w.side, count + w.side_collectives
    return payload, side, count


@pytest.fixture(scope="module")
def torch_stats(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tb")
    return run(worker_torch_stats, np=2, args=(str(log_dir),), timeout=240), log_dir


@requires_backend("torch")
@pytest.mark.parametrize("spec", SPECS)
def test_torch_stats_numbers(torch_stats, spec):
    results, _ = torch_stats
    params = sum(math.prod(s) for s in SHAPES)
    for r in results:
        res = r[spec]
        assert res["before"].bytes_sent == 0 and res["before"].tensors == 0
        final = res["final"]
        payload, side, count = _expected(spec)
        assert (final.payload_bytes, final.side_bytes, final.side_collectives) == (payload, side, count)
        assert final.bytes_sent == res["wire"].total and final.tensors == 4
        assert final.collectives == 4 + count and final.fp16_bytes == 2 * params
        assert final.fp16_ratio == pytest.approx(2 * params / (payload + side))
        sizes = {(rep.payload_bytes, rep.side_bytes, rep.side_collectives, rep.tensors) for rep in res["reports"]}
        assert sizes == {(payload, side, count, 4)}  # the same bytes at every step
    assert results[0]["fp16"]["final"].fp16_ratio == 1.0 and results[0]["none"]["final"].fp16_ratio == 0.5
    assert results[0]["thc:range=current"]["final"].side_collectives == 1  # the 2,048-coordinate weight


@requires_backend("torch")
def test_torch_stats_metrics_logging_and_tensorboard(torch_stats):
    results, log_dir = torch_stats
    r0, r1 = results
    thc = r0["thc"]
    # THC's ranges lag a step: the 1000x gradient at the last step clips (saturates) most of
    # the weight's 2,048 rotated coordinates (measured ~2,035; ~200 at the step before, 0 at
    # the first); no step was realigned.
    before_spike, at_spike = thc["reports"][-2].metrics["saturated"], thc["reports"][-1].metrics["saturated"]
    assert at_spike > 1024 and at_spike > 2 * before_spike, (before_spike, at_spike)
    assert thc["final"].metrics["realigned"] == 0 and set(thc["final"].metrics) == {"saturated", "realigned"}
    assert r0["topkc:ratio=0.1"]["final"].metrics == {"realigned": 0} and r0["fp16"]["final"].metrics == {}
    # every=2 over 3 steps: a line at step 2, then log() at step 3; rank 1 logs nothing.
    for spec in SPECS:
        lines = r0[spec]["lines"]
        assert [ln.split(":")[0] for ln in lines] == ["step 2", "step 3"], lines
        assert lines[-1] == "step 3: " + r0[spec]["final"].line()
        assert r1[spec]["lines"] == []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir / "thc"))
    acc.Reload()
    sent = [(e.step, e.value) for e in acc.Scalars("compression/bytes_per_step")]
    assert sent == [(2, thc["final"].bytes_sent), (3, thc["final"].bytes_sent)]
    saturated = [(e.step, e.value) for e in acc.Scalars("compression/saturated")]
    assert saturated == [(2, before_spike), (3, at_spike)]
