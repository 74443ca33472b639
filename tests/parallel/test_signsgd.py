"""signSGD with error feedback under real Horovod (Gloo, 2 ranks): one PyTorch launch and one
TensorFlow launch run every check below; the tests compare what each rank recorded with the
float64 reference of tests/core/test_signsgd.py (``RefSignSGD``, all ranks simulated).

PyTorch: by hand (``compress(t, name=...)``, ``hvd.allreduce(payload, op=...)``,
``decompress``: the op unknown to the compressor, told by the count word) under Sum and
Average, where Horovod's int32 Average must equal ``trunc(sum / n)`` as the core tests emulate
it; ``hvd.allreduce(x, compression=c)`` with the op known; NaN on one rank (NaN on both, both
residuals kept); ``hvd.DistributedOptimizer`` (every parameter through signsgd, whose
``min_numel`` default is 1); and a 200-step training run of tests/parallel/test_training.py's
workload against fp16; Min/Max/Adasum and scale factors refused on every rank before any
collective (also ``DistributedOptimizer(op=hvd.Adasum)``, which compresses parameter deltas).
TensorFlow: ``DistributedGradientTape`` inside ``tf.function`` (Average)
and a direct Sum.
"""
import numpy as np
import pytest

from tests.core.test_signsgd import RefSignSGD, np_words
from tests.core.test_thc import emulate_allreduce
from tests.hvdrun import run, value_error

SHAPE = (30, 40)  # 1200 coordinates: two blocks of the default 1024, the second short
STEPS = 3
TRAIN_STEPS = 200


def _inputs(rank, seed, step, shape=SHAPE):
    return np.random.default_rng([seed, rank, step]).standard_normal(shape).astype(np.float32)


def _residual(comp, name):
    """This rank's pending error feedback of tensor ``name`` (the state keeps ``p`` and ``S``)."""
    e = comp.codec.error_feedback(name)
    return None if e is None else np.array(np.asarray(e), copy=True)


def worker_torch():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    r = hvd.rank()
    ops = {"sum": hvd.Sum, "average": hvd.Average}
    out = {}
    for op in ("sum", "average"):
        comp, hand = Compression.signsgd(), []
        for t in range(STEPS):
            x = torch.tensor(_inputs(r, 1, t))
            payload, ctx = comp.compress(x, name="hand")
            reduced = hvd.allreduce(payload, op=ops[op], name="hand.payload")
            got = comp.decompress(reduced, ctx)
            hand.append({"x": x.numpy().copy(), "own": payload.numpy().copy(), "reduced": reduced.numpy().copy(),
                         "dtype": str(payload.dtype), "out": got.numpy().copy(), "residual": _residual(comp, "hand")})
        out[f"hand_{op}"] = hand
        comp, known = Compression.signsgd(), []
        for t in range(STEPS):
            x = torch.tensor(_inputs(r, 2, t))
            got = hvd.allreduce(x, name="known", op=ops[op], compression=comp)
            known.append({"x": x.numpy().copy(), "out": got.numpy().copy(), "residual": _residual(comp, "known")})
        out[f"known_{op}"] = {"steps": known, "wire": comp.wire_bytes()["known"].payload}
    # NaN on rank 1 after a finite step: NaN on both ranks, both residuals as they were.
    comp = Compression.signsgd()
    hvd.allreduce(torch.tensor(_inputs(r, 3, 0)), name="nan", compression=comp)
    before = _residual(comp, "nan")
    x = _inputs(r, 3, 1)
    if r == 1:
        x[2, 5] = np.nan
    out["nan"] = {"out": hvd.allreduce(torch.tensor(x), name="nan", compression=comp).numpy().copy(),
                  "kept": np.array_equal(before, _residual(comp, "nan"))}
    # DistributedOptimizer (Average), lr 0: the synced gradients are the decoded means.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                   named_parameters=net.named_parameters(), compression=Compression.signsgd())
    out["opt"] = []
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(100 + 10 * t + r)
        xb, yb = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        local = [p.grad.numpy().copy() for p in net.parameters()]
        opt.step()
        out["opt"].append({"local": local, "synced": [p.grad.numpy().copy() for p in net.parameters()]})
    # Ops and scale factors the integer payload cannot take: a ValueError on every rank before
    # any collective (the next collective still pairs up), also through DistributedOptimizer
    # (op=Adasum compresses each parameter's delta; gradient_predivide_factor scales).
    refused = {}
    for label, kwargs in (("min", {"op": hvd.Min}), ("max", {"op": hvd.Max}),
                          ("prescale", {"prescale_factor": 2.0}), ("postscale", {"postscale_factor": 0.5})):
        refused[label] = value_error(lambda: hvd.allreduce(torch.ones(8), name=f"refused_{label}",
                                                           compression=Compression.signsgd(), **kwargs))
    for label, kwargs in (("adasum", {"op": hvd.Adasum}), ("predivide", {"gradient_predivide_factor": 2.0})):
        net = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                       compression=Compression.signsgd(), **kwargs)

        def step():
            net(torch.ones(3, 4)).sum().backward()
            opt.step()
        refused[label] = value_error(step)
    out["refused"] = refused
    out["after_refusal"] = float(hvd.allreduce(torch.tensor(float(r + 1)), name="after_refusal", op=hvd.Sum))
    # Training on digits (tests/parallel/test_training.py's workload), signsgd against fp16.
    from tests.digits import train
    out["losses"] = {spec: train(hvd, Compression.from_spec(spec), TRAIN_STEPS) for spec in ("fp16", "signsgd")}
    return out


def worker_tf():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    r = hvd.rank()
    w = tf.Variable(tf.zeros(SHAPE), name="w")
    comp = Compression.signsgd()

    @tf.function
    def grads(c_w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c_w)
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])[0]

    out = {"tape": [grads(tf.constant(_inputs(r, 4, t))).numpy() for t in range(STEPS)]}
    comp, out["sum"] = Compression.signsgd(), []
    for t in range(STEPS):
        out["sum"].append(hvd.allreduce(tf.constant(_inputs(r, 5, t)), name="tf_sum", op=hvd.Sum,
                                        compression=comp).numpy())
    return out


@pytest.fixture(scope="module")
def torch2():
    return run(worker_torch, np=2)


@pytest.fixture(scope="module")
def tf2():
    return run(worker_tf, np=2)


def _check(outs, ref, grads, op):
    """Every rank's output == the reference's for the ranks' inputs; identical on all ranks."""
    expected = ref.step(grads, op)
    for got in outs:
        np.testing.assert_array_equal(got, outs[0])
        np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), expected, rtol=0,
                                   atol=1e-6 * ref.scale.max() * len(grads))


@pytest.mark.parametrize("op", ["sum", "average"])
def test_by_hand_matches_reference(torch2, op):
    ref = RefSignSGD(2, int(np.prod(SHAPE)))
    for t in range(STEPS):
        recs = [res[f"hand_{op}"][t] for res in torch2]
        assert all(rec["dtype"] == "torch.int32" for rec in recs)
        # Horovod's own int32 Sum / Average is what the core tests emulate.
        np.testing.assert_array_equal(recs[0]["reduced"], emulate_allreduce([rec["own"] for rec in recs], op, 2))
        _check([rec["out"] for rec in recs], ref, [rec["x"] for rec in recs], op)
        for rec, e in zip(recs, ref.residual):
            np.testing.assert_allclose(rec["residual"], e, rtol=0, atol=1e-6 * max(ref.scale.max(), np.abs(e).max()))


@pytest.mark.parametrize("op", ["sum", "average"])
def test_allreduce_with_compression_matches_reference(torch2, op):
    ref = RefSignSGD(2, int(np.prod(SHAPE)))
    for t in range(STEPS):
        recs = [res[f"known_{op}"]["steps"][t] for res in torch2]
        _check([rec["out"] for rec in recs], ref, [rec["x"] for rec in recs], op)
    assert torch2[0][f"known_{op}"]["wire"] == 4 * sum(np_words(2, op, int(np.prod(SHAPE))))


def test_nonfinite_reaches_both_ranks_and_spares_the_state(torch2):
    for res in torch2:
        assert np.isnan(res["nan"]["out"]).all() and res["nan"]["kept"]


def test_distributed_optimizer(torch2):
    refs = None
    for t in range(STEPS):
        local = [res["opt"][t]["local"] for res in torch2]
        refs = refs or [RefSignSGD(2, g.size) for g in local[0]]
        for i, ref in enumerate(refs):
            _check([res["opt"][t]["synced"][i] for res in torch2], ref, [loc[i] for loc in local], "average")


def test_ops_and_scale_factors_refused_before_any_collective(torch2):
    for res in torch2:
        for label in ("min", "max", "adasum"):
            message = res["refused"][label]
            assert message is not None and message.startswith("signsgd: tensor ") and \
                f"op={label.capitalize()} cannot combine signsgd payloads" in message, (label, message)
        for label in ("prescale", "postscale", "predivide"):
            message = res["refused"][label]
            assert message is not None and "corrupts signsgd's integer payload" in message, (label, message)
        assert "tensor 'weight'" in res["refused"]["adasum"] or "tensor 'bias'" in res["refused"]["adasum"]
        assert res["after_refusal"] == 3.0  # the ranks' collectives still pair up


def test_training_reaches_fp16(torch2):
    """200 full-batch steps on digits: signSGD with error feedback ends near fp16's loss."""
    losses = torch2[0]["losses"]
    assert losses["signsgd"] < losses["fp16"] + 0.05, losses


def test_tensorflow_tape_and_sum(tf2):
    ref = RefSignSGD(2, int(np.prod(SHAPE)))
    for t in range(STEPS):  # the gradient of <w, C_r> is C_r
        _check([res["tape"][t] for res in tf2], ref, [_inputs(r, 4, t) for r in range(2)], "average")
    ref = RefSignSGD(2, int(np.prod(SHAPE)))
    for t in range(STEPS):
        _check([res["sum"][t] for res in tf2], ref, [_inputs(r, 5, t) for r in range(2)], "sum")
