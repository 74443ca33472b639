"""PowerSGD under real Horovod: 2 ranks, Gloo, PyTorch and TensorFlow.

One PyTorch launch (``_torch_worker``) and one TensorFlow launch (``_tf_worker``) run every
check and return plain values; the tests below assert on them. Each rank's inputs come from
``_grad(tag, rank, step, shape)``, so the host rebuilds them for the float64 references, which
simulate both ranks.
"""
import numpy as np
import pytest

from hvd_gradcomp.base import WireBytes
from hvd_gradcomp.powersgd import CONTROL
from tests.backends import backend_unusable
from tests.hvdrun import run
from tests.reference import gram_schmidt64

SIZE = 2
SHAPE = (24, 20)  # compressed for rank <= 2: r (n + m) * 2 <= n m
RANK = 2
STEPS = 4


def _grad(tag, rank, step, shape=SHAPE):
    """Rank ``rank``'s input at ``step`` for the check ``tag`` (float64 numpy)."""
    return np.random.default_rng([tag, rank, step]).standard_normal(shape)


# ------------------------------------------------------------------ float64 references
_gram_schmidt64 = gram_schmidt64  # tests/reference.py


def _basis64(a, fill):
    """orthogonalize.basis() in float64: zero columns of ``a`` taken from ``fill`` first."""
    a = a.copy()
    zero = ~(np.abs(a).max(0) > 0)
    a[:, zero] = fill[:, zero]
    return _gram_schmidt64(a)


def _alternating_reference(inputs, q0_t, fill, average=True):
    """The alternating variant with EF by hand, both ranks: inputs[step][rank] -> outputs."""
    n, m = inputs[0][0].shape
    residual = [np.zeros((n, m))] * len(inputs[0])
    q, p = q0_t.T.astype(np.float64), None
    outs = []
    for t, xs in enumerate(inputs):
        ms = [x + e for x, e in zip(xs, residual)]
        if t % 2 == 0:  # P_i = M_i Q^ travels; P^ := basis(P_agg)
            local = [mi @ q for mi in ms]
            agg = sum(local) / (len(ms) if average else 1)
            outs.append(agg @ q.T)
            residual = [mi - li @ q.T for mi, li in zip(ms, local)]
            p = _basis64(agg, fill[:, :n].T)
        else:  # Q_i = M_i^T P^ travels; Q^ := basis(Q_agg)
            local = [mi.T @ p for mi in ms]
            agg = sum(local) / (len(ms) if average else 1)
            outs.append(p @ agg.T)
            residual = [mi - p @ li.T for mi, li in zip(ms, local)]
            q = _basis64(agg, fill[:, :m].T)
    return outs


def _two_round_reference(inputs, q0_t, average=True):
    """Two-round PowerSGD with EF and warm start by hand: inputs[step][rank] -> outputs."""
    residual = [0.0] * len(inputs[0])
    q_t = q0_t.astype(np.float64)
    outs = []
    for xs in inputs:
        ms = [x.reshape(x.shape[0], -1) + e for x, e in zip(xs, residual)]
        p = _gram_schmidt64(sum(m @ q_t.T for m in ms))
        qs = [m.T @ p for m in ms]
        q_agg = sum(qs) / (len(qs) if average else 1)
        outs.append(p @ q_agg.T)
        residual = [m - p @ q.T for m, q in zip(ms, qs)]
        q_t = (q_agg / np.linalg.norm(q_agg, axis=0)).T
    return outs


# ------------------------------------------------------------------ PyTorch worker
def _torch_worker():
    import horovod.torch as hvd
    import torch

    from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
    from hvd_gradcomp.primitives import one_rank
    from torch_backend import OPS, Compression

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    res = {"rank": rank}

    def t(a, dtype=torch.float32):
        return torch.as_tensor(np.asarray(a, dtype=np.float64)).to(dtype)

    def reduce(comp, x, name, op=hvd.Average):
        return hvd.allreduce(x, name=name, compression=comp, op=op)

    def np_state(comp, key):
        return {f: v.numpy().copy() for f, v in comp.state_dict()["tensors"][key].items()}

    for variant in ("alternating", "two_round"):
        v = {"variant": variant}
        res[variant] = v

        def make(**kw):
            return Compression.powersgd(rank=RANK, variant=variant, **kw)

        # 1. Identical inputs on both ranks == the one-rank result (scheme driven with world 1).
        comp = make()
        scheme, world1 = comp.scheme, one_rank(OPS)
        info1 = TensorInfo("same", SHAPE, "float32", 1, 0)
        state1 = scheme.init(world1, info1, None)
        v["same_diff"] = []
        for step in range(3):
            x = t(_grad(1, 0, step))
            got = reduce(comp, x, "same")
            payload, ctx = compress_tensor(scheme, world1, x, state1, info1)
            want, state1 = finish_tensor(scheme, world1, payload, ctx, state1, info1)
            v["same_diff"].append(float((got - want).abs().max()))

        # 2. Different inputs: outputs (Average, then Sum on a twin), the shared state, bytes.
        comp, twin = make(), make()
        info = TensorInfo("diff", SHAPE, "float32", SIZE, rank)
        v["q0"] = comp.scheme.init(OPS, info, None).q.numpy()
        v["diff_out"], v["diff_sum"], v["diff_states"] = [], [], []
        for step in range(STEPS):
            v["diff_out"].append(reduce(comp, t(_grad(2, rank, step)), "diff").numpy())
            v["diff_sum"].append(reduce(twin, t(_grad(2, rank, step)), "diff", op=hvd.Sum).numpy())
            v["diff_states"].append(np_state(comp, "diff"))
        v["wire"] = tuple(comp.wire_bytes()["diff"])

        # 3. Zeros give exact zeros; the bases stay usable.
        comp = make()
        v["zeros_out"] = [reduce(comp, torch.zeros(SHAPE), "zeros").numpy() for _ in range(2)]
        v["zeros_state"] = np_state(comp, "zeros")

        # 4. NaN on rank 0 only at step 1: every rank's output is NaN; no state moves.
        comp = make()
        v["nan_out"] = []
        for step in range(3):
            g = _grad(4, rank, step)
            if step == 1 and rank == 0:
                g[3, 5] = np.nan
            before = np_state(comp, "nan") if step == 1 else None
            v["nan_out"].append(reduce(comp, t(g), "nan").numpy())
            if step == 1:
                after = np_state(comp, "nan")
                v["nan_state_kept"] = {f: bool(np.array_equal(before[f], after[f])) for f in before}
                v["nan_state_finite"] = all(np.isfinite(x).all() for x in after.values())

        # 5. state_dict after step 3, resumed in a new compressor == the uninterrupted run.
        full = make()
        uninterrupted = [reduce(full, t(_grad(5, rank, s)), "ckpt").numpy() for s in range(6)]
        first = make()
        for s in range(3):
            reduce(first, t(_grad(5, rank, s)), "ckpt")
        saved = first.state_dict()
        resumed = make()
        resumed.load_state_dict(saved)
        v["resume_equal"] = [bool(np.array_equal(reduce(resumed, t(_grad(5, rank, s)), "ckpt").numpy(),
                                                 uninterrupted[s])) for s in range(3, 6)]
        v["ckpt_fields"] = sorted(saved["tensors"]["ckpt"])

        # 6. Other shapes and dtypes: conv kernel, vector, scalar, empty, fp16 gradient.
        comp = Compression.powersgd(rank=1, variant=variant)
        v["shapes"] = {}
        for name, shape, dtype in [("conv", (8, 4, 3, 3), torch.float32), ("vec", (7,), torch.float32),
                                   ("scalar", (), torch.float32), ("empty", (0, 5), torch.float32),
                                   ("half", (16, 12), torch.float16)]:
            x = t(_grad(6, rank, 0, shape), dtype)
            out = reduce(comp, x, name)
            v["shapes"][name] = (tuple(out.shape), str(out.dtype), out.double().numpy())
        v["shape_wire"] = {k: tuple(w) for k, w in comp.wire_bytes().items()}

        # 7. A mean of rank <= r: exact from step 0 (two-round) or step 1 (alternating, no EF);
        # with EF the alternating variant's outputs sum to the inputs' after every odd step.
        low = _grad(9, 0, 0, (SHAPE[0], RANK)) @ _grad(9, 0, 1, (RANK, SHAPE[1]))
        v["low_rank_err"] = {}
        options = [dict(error_feedback=False)] if variant == "alternating" else [{}, dict(warm_start=False)]
        for kw in options:
            comp = make(**kw)
            outs = [reduce(comp, t((1.0 + rank) * (step + 1) * low), "low").numpy() for step in range(3)]
            v["low_rank_err"][str(kw)] = [float(np.abs(o - 1.5 * (s + 1) * low).max()
                                                / np.linalg.norm(1.5 * (s + 1) * low)) for s, o in enumerate(outs)]
        if variant == "alternating":
            comp = make()
            outs = [reduce(comp, t((1.0 + rank) * low), "low_ef").numpy() for _ in range(4)]
            v["low_rank_ef_sums"] = [float(np.abs(sum(outs[:k + 1]) - 1.5 * (k + 1) * low).max()
                                           / np.linalg.norm(1.5 * low)) for k in (1, 3)]

    # 8. Alternating: rank 0 resumes a 3-step checkpoint alone, rank 1 starts afresh. The first
    # step is a disagreement on both ranks: output 0, the corrected gradient kept, realigned.
    comp = Compression.powersgd(rank=RANK)
    for s in range(3):
        reduce(comp, t(_grad(10, rank, s)), "split")
    saved = comp.state_dict()
    comp = Compression.powersgd(rank=RANK)
    if rank == 0:
        comp.load_state_dict(saved)
        loaded_residual = saved["tensors"]["split"]["residual"].numpy().copy()
    else:
        loaded_residual = np.zeros(SHAPE)
    res["split_out"], res["split_states"] = [], []
    for s in range(4):
        res["split_out"].append(reduce(comp, t(_grad(11, rank, s)), "split").numpy())
        res["split_states"].append(np_state(comp, "split"))
    res["split_corrected0"] = _grad(11, rank, 0) + loaded_residual
    res["split_metrics"] = {k: {m: int(x) for m, x in d.items()} for k, d in comp.metrics().items()}

    # 9. Two-round start_step=2: fp16 mean (and sum) during warm-up, then PowerSGD from a fresh start.
    make = lambda **kw: Compression.powersgd(rank=RANK, variant="two_round", **kw)  # noqa: E731
    warm, warm_sum, fresh = make(start_step=2), make(start_step=2), make()
    res["warm_out"], res["warm_sum"], res["fresh_out"] = [], [], []
    for step in range(4):
        x = t(_grad(7, rank, step))
        res["warm_out"].append(reduce(warm, x, "warm").numpy())
        res["warm_sum"].append(reduce(warm_sum, x, "warm", op=hvd.Sum).numpy())
        if step >= 2:
            res["fresh_out"].append(reduce(fresh, x, "warm").numpy())
    res["warm_wire"] = tuple(warm.wire_bytes()["warm"])
    # Training with PowerSGD against FP16: tests/parallel/test_training.py.
    return res


# ------------------------------------------------------------------ TensorFlow worker
def _tf_worker():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from tf_backend import Compression

    hvd.init()
    rank = hvd.rank()
    res = {"rank": rank}

    def traced(comp, name):
        @tf.function
        def reduce(x):
            return hvd.allreduce(x, name=name, compression=comp, op=hvd.Average)
        return reduce

    # The same inputs as the PyTorch worker's check 2 (both variants) and 9, inside tf.function.
    for variant in ("alternating", "two_round"):
        reduce = traced(Compression.powersgd(rank=RANK, variant=variant), "diff")
        res[f"diff_out_{variant}"] = [reduce(tf.constant(_grad(2, rank, s), tf.float32)).numpy()
                                      for s in range(STEPS)]
    warm = Compression.powersgd(rank=RANK, start_step=2, variant="two_round")
    reduce = traced(warm, "warm")
    res["warm_out"] = [reduce(tf.constant(_grad(7, rank, s), tf.float32)).numpy() for s in range(4)]
    res["warm_step"] = int(warm.state_dict()["tensors"]["warm"]["step"].numpy())
    # Eagerly too (tf.cond and the side collectives outside any graph; the default variant).
    for variant, kw in (("two_round", dict(start_step=1)), ("alternating", {})):
        eager = Compression.powersgd(rank=RANK, variant=variant, **kw)
        res[f"eager_out_{variant}"] = [hvd.allreduce(tf.constant(_grad(7, rank, s), tf.float32), name="eager",
                                                     compression=eager, op=hvd.Average).numpy()
                                       for s in range(3)]

    # DistributedGradientTape in a tf.function: a conv kernel (h, w, in, out) and a dense
    # layer, 3 SGD steps with the default (alternating) PowerSGD.
    k = tf.Variable(tf.constant(_grad(8, 0, 0, (3, 3, 4, 8)) * 0.1, tf.float32), name="k")
    w = tf.Variable(tf.constant(_grad(8, 0, 1, (8 * 36, 10)) * 0.1, tf.float32), name="w")
    b = tf.Variable(tf.zeros((10,)), name="b")
    comp = Compression.powersgd(rank=RANK)
    x = tf.constant(_grad(8, rank, 2, (16, 8, 8, 4)), tf.float32)
    y = tf.constant(_grad(8, rank, 3, (16, 10)), tf.float32)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            h = tf.reshape(tf.nn.conv2d(x, k, strides=1, padding="VALID"), (16, 8 * 36))  # [16, 6, 6, 8]
            loss = tf.reduce_mean((tf.matmul(h, w) + b - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, [k, w, b])
        for var, g in zip([k, w, b], grads):
            var.assign_sub(0.01 * g)
        return loss

    res["tape_loss"] = [float(train_step()) for _ in range(4)]
    res["tape_vars"] = [k.numpy(), w.numpy(), b.numpy()]
    tensors = comp.state_dict()["tensors"]
    res["tape_keys"] = sorted(tensors)
    res["tape_steps"] = {key: int(s["step"].numpy()) for key, s in tensors.items()}
    res["tape_residual_shapes"] = {key: tuple(s["residual"].shape) for key, s in tensors.items()}
    res["tape_wire"] = {key: tuple(x) for key, x in comp.wire_bytes().items()}
    return res


# ------------------------------------------------------------------ launches
@pytest.fixture(scope="module")
def torch_results():
    why = backend_unusable("torch")
    if why:
        pytest.skip(why)
    return run(_torch_worker, np=SIZE)


@pytest.fixture(scope="module")
def tf_results():
    why = backend_unusable("tensorflow")
    if why:
        pytest.skip(why)
    return run(_tf_worker, np=SIZE)


def _same_on_all_ranks(values):
    for other in values[1:]:
        for a, b in zip(values[0], other):
            np.testing.assert_array_equal(a, b)


VARIANTS = ["alternating", "two_round"]


# ------------------------------------------------------------------ PyTorch checks
@pytest.mark.parametrize("variant", VARIANTS)
def test_identical_inputs_give_the_one_rank_result(torch_results, variant):
    for res in torch_results:
        assert res[variant]["same_diff"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_different_inputs_match_float64_reference(torch_results, variant):
    """Both ranks give bit-identical outputs, equal to the float64 simulation of both ranks
    under Average and under Sum; the shared state (bases, step) is bit-identical too."""
    a, b = torch_results[0][variant], torch_results[1][variant]
    _same_on_all_ranks([a["diff_out"], b["diff_out"]])
    _same_on_all_ranks([a["diff_sum"], b["diff_sum"]])
    np.testing.assert_array_equal(a["q0"], b["q0"])
    inputs = [[_grad(2, r, s) for r in range(SIZE)] for s in range(STEPS)]
    if variant == "alternating":
        fill = a["diff_states"][0]["fill"]
        want = _alternating_reference(inputs, a["q0"], fill)
        want_sum = _alternating_reference(inputs, a["q0"], fill, average=False)
    else:
        want = _two_round_reference(inputs, a["q0"])
        want_sum = _two_round_reference(inputs, a["q0"], average=False)
    for got, got_sum, ref, ref_sum in zip(a["diff_out"], a["diff_sum"], want, want_sum):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
        np.testing.assert_allclose(got_sum, ref_sum, rtol=0, atol=1e-4 * np.abs(ref_sum).max())
    for sa, sb in zip(a["diff_states"], b["diff_states"]):
        for field in ("p", "q", "step", "fill", "realigned", "version"):
            np.testing.assert_array_equal(sa[field], sb[field])
    assert [int(s["step"]) for s in a["diff_states"]] == [1, 2, 3, 4]
    q = a["diff_states"][-1]["q"]
    if variant == "alternating":
        np.testing.assert_allclose(q @ q.T, np.eye(RANK), atol=1e-5)  # orthonormal basis
        # Step 0 written out: P_agg Q0^T with P_agg the mean of M_i Q0 (Q0 orthonormal).
        mean = (inputs[0][0] + inputs[0][1]) / 2
        np.testing.assert_allclose(want[0], mean @ a["q0"].T @ a["q0"], atol=1e-12)
    else:
        np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-6)
        mean = (inputs[0][0] + inputs[0][1]) / 2
        p = _gram_schmidt64((inputs[0][0] + inputs[0][1]) @ a["q0"].T)
        np.testing.assert_allclose(want[0], p @ (p.T @ mean), atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_low_rank_mean_reproduced(torch_results, variant):
    """Largest error relative to the mean's Frobenius norm (float32 rounding grows with ||M||
    and the conditioning of M Q); measured ~6e-6. The alternating variant without EF is exact
    from step 1; with EF its outputs summed over steps 0-1 and 0-3 equal the inputs summed."""
    for res in torch_results:
        for kw, errors in res[variant]["low_rank_err"].items():
            errors = errors[1:] if variant == "alternating" else errors
            assert max(errors) < 2e-5, (kw, errors)
        if variant == "alternating":
            assert max(res[variant]["low_rank_ef_sums"]) < 2e-5, res[variant]["low_rank_ef_sums"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_bytes(torch_results, variant):
    n, m = SHAPE
    for res in torch_results:
        v = res[variant]
        wire = v["shape_wire"]
        if variant == "alternating":  # one all-reduce, fixed size, no side collective
            assert v["wire"] == tuple(WireBytes(4 * (RANK * max(n, m) + CONTROL)))
            assert wire["conv"] == (4 * (36 + CONTROL), 0, 0)
            assert wire["half"] == (4 * (16 + CONTROL), 0, 0)
        else:
            assert v["wire"] == tuple(WireBytes(4 * RANK * m, 4 * RANK * n, 1))
            assert wire["conv"] == (4 * 36, 4 * 8, 1)
            assert wire["half"] == (4 * 12, 4 * 16, 1)
        assert wire["vec"] == (14, 0, 0) and wire["scalar"] == (2, 0, 0)
        assert "empty" not in wire  # empty tensors pass through untouched
    assert torch_results[0]["warm_wire"] == torch_results[0]["two_round"]["wire"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_zeros_give_exact_zeros(torch_results, variant):
    for res in torch_results:
        v = res[variant]
        assert all((out == 0).all() for out in v["zeros_out"])
        state = v["zeros_state"]
        assert all(np.isfinite(x).all() for x in state.values())
        if variant == "alternating":
            for field in ("p", "q"):
                np.testing.assert_allclose(state[field] @ state[field].T, np.eye(RANK), atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_reaches_every_rank_and_no_state(torch_results, variant):
    for res in torch_results:
        v = res[variant]
        assert np.isnan(v["nan_out"][1]).all()
        assert np.isfinite(v["nan_out"][0]).all() and np.isfinite(v["nan_out"][2]).all()
        fields = ("residual", "p", "q", "step", "fill", "realigned", "version")
        assert v["nan_state_kept"] == {f: True for f in fields}
        assert v["nan_state_finite"]
    _same_on_all_ranks([res[variant]["nan_out"] for res in torch_results])


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_resume_equals_uninterrupted(torch_results, variant):
    for res in torch_results:
        assert res[variant]["resume_equal"] == [True, True, True]
        assert res[variant]["ckpt_fields"] == ["fill", "p", "q", "realigned", "residual", "step", "version"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_other_shapes_and_dtypes(torch_results, variant):
    for res in torch_results:
        shapes = res[variant]["shapes"]
        assert shapes["conv"][:2] == ((8, 4, 3, 3), "torch.float32")
        assert shapes["half"][:2] == ((16, 12), "torch.float16")
        assert shapes["empty"][:2] == ((0, 5), "torch.float32")
        assert shapes["scalar"][:2] == ((), "torch.float32")
        for name in ("vec", "scalar"):  # uncompressed: the fp16 mean
            mean = (_grad(6, 0, 0, shapes[name][2].shape) + _grad(6, 1, 0, shapes[name][2].shape)) / 2
            np.testing.assert_allclose(shapes[name][2], mean, atol=2e-3)
        assert np.isfinite(shapes["conv"][2]).all()
    for name in ("conv", "vec", "scalar", "half"):
        np.testing.assert_array_equal(torch_results[0][variant]["shapes"][name][2],
                                      torch_results[1][variant]["shapes"][name][2])


def test_checkpoint_on_one_rank_realigns(torch_results):
    """Rank 0 resumed a 3-step state alone: the ranks disagree on the parity at the next step.
    That step's output is 0 on both ranks (never a wrong value), each rank keeps its corrected
    gradient as residual, both leave with the same basis at step 0; then they agree."""
    a, b = torch_results
    assert (a["split_out"][0] == 0).all() and (b["split_out"][0] == 0).all()
    for res in (a, b):
        np.testing.assert_allclose(res["split_states"][0]["residual"], res["split_corrected0"],
                                   rtol=1e-6, atol=1e-6)
        assert [int(s["step"]) for s in res["split_states"]] == [0, 1, 2, 3]
        assert [int(s["realigned"]) for s in res["split_states"]] == [1, 1, 1, 1]
        assert res["split_metrics"] == {"split": {"realigned": 1}}
    for sa, sb in zip(a["split_states"], b["split_states"]):
        for field in ("p", "q", "step", "realigned"):
            np.testing.assert_array_equal(sa[field], sb[field])
    _same_on_all_ranks([a["split_out"], b["split_out"]])
    assert all(np.isfinite(o).all() and np.abs(o).max() > 0 for o in a["split_out"][1:])


def test_start_step_warm_up(torch_results):
    _same_on_all_ranks([res["warm_out"] for res in torch_results])
    res = torch_results[0]
    for step in range(2):  # warm-up: the fp16 mean, and the sum under op=Sum
        xs = [_grad(7, r, step) for r in range(SIZE)]
        np.testing.assert_allclose(res["warm_out"][step], sum(xs) / SIZE, atol=2e-3)
        np.testing.assert_allclose(res["warm_sum"][step], sum(xs), atol=4e-3)
    for got, want in zip(res["warm_out"][2:], res["fresh_out"]):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ TensorFlow checks
def test_tensorflow_matches_torch(tf_results, torch_results):
    for a, b in zip(tf_results, torch_results):
        for variant in VARIANTS:
            for got, want in zip(a[f"diff_out_{variant}"], b[variant]["diff_out"]):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        for got, want in zip(a["warm_out"], b["warm_out"]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for variant in VARIANTS:
        _same_on_all_ranks([res[f"diff_out_{variant}"] for res in tf_results])
    assert tf_results[0]["warm_step"] == 4


def test_tensorflow_eager_and_gradient_tape(tf_results):
    for variant in VARIANTS:
        _same_on_all_ranks([res[f"eager_out_{variant}"] for res in tf_results])
    res = tf_results[0]
    xs = [_grad(7, r, 0) for r in range(SIZE)]
    np.testing.assert_allclose(res["eager_out_two_round"][0], sum(xs) / SIZE, atol=2e-3)
    _same_on_all_ranks([res["tape_vars"] for res in tf_results])
    assert res["tape_loss"][-1] < res["tape_loss"][0]
    # Two states (kernel and dense weight; the bias goes as fp16, without a state), whatever
    # names Horovod gives the gradients. The kernel (3, 3, 4, 8) is viewed as 8 x 36 (output
    # channels as rows) and kept as its plain reshape 36 x 8; the dense (288, 10) as 288 x 10.
    assert len(res["tape_keys"]) == 2 and set(res["tape_steps"].values()) == {4}
    shapes = res["tape_residual_shapes"]
    assert sorted(shapes.values()) == [(36, 8), (288, 10)]


def test_tensorflow_kernel_wire_bytes(tf_results):
    """wire_bytes() of a TensorFlow conv kernel uses the out x (h w in) view. The adapter asks
    for the bytes before the scheme has seen the backend's ops; this passes once the adapter
    calls ``scheme.bind(ops)`` when the compressor is created (or records wire() after
    compress)."""
    res = tf_results[0]
    shapes = res["tape_residual_shapes"]
    kernel = [key for key, shape in shapes.items() if shape == (36, 8)][0]
    assert res["tape_wire"][kernel] == (4 * (RANK * 36 + CONTROL), 0, 0)
