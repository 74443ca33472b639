"""THC under real Horovod (Gloo): 2-, 3- and 4-rank PyTorch launches and a 2-rank TensorFlow one.

Each launch runs one worker that does every check below and returns plain values; the tests
assert on them. Payloads are all-reduced by Horovod itself, with ``op=hvd.Sum`` and with the
default ``op=hvd.Average`` (which truncates int32: the scheme must recover exact sums).

- 2 ranks (PyTorch): decoded == a float64 reference computed here from every rank's own
  levels; identical outputs on all ranks; zeros -> zeros; NaN/inf on one rank -> NaN on every
  rank, residual and step unchanged; tiny tensors travel as fp16; Sum == n * Average;
  ``hvd.DistributedOptimizer`` with Average and with Sum gives the mean and the sum of the
  ranks' gradients; a 200-step training run (below).
- 3 ranks: Average with a world size that is not a power of two (``1/3`` is inexact in double).
- 4 ranks: every coordinate of every rank at the top level, at 2, 4 and 8 bits (8 bits at 4
  ranks fills a 10-bit lane to 1020 of 1023): the all-reduced lanes equal the sums of the
  ranks' levels, so nothing carried.
- 2 ranks (TensorFlow): the same through ``DistributedGradientTape`` inside ``tf.function``.

Training: a 64-128-10 MLP (both weight matrices, 8192 and 1280 coordinates, go through THC;
the biases are below ``min_numel`` and go as fp16) on scikit-learn's digits, each rank holding
half the data, full-batch gradient descent (lr 0.5), 200 steps from the same initial weights.
THC with saturation (4 bits, partial rotation, error feedback) must end within 2 % + 0.005 of
the fp16 run's full-data cross-entropy (measured: 0.107771 against fp16's 0.107770).
"""
import math

import numpy as np
import pytest

from tests.reference import fwht64
from tests.hvdrun import run

D = 5000  # coordinates of the main test tensor (50 x 100): not a power of two


def _inputs(rank, seed=0):
    return np.random.default_rng([seed, rank]).standard_normal((50, 100)).astype(np.float32)


def _record(comp, tensor, name, op_fn, hvd):
    """compress, Horovod all-reduce, decompress; everything the tests need, as NumPy."""
    payload, ctx = comp.compress(tensor, name=name)
    own = np.array(payload.numpy(), copy=True)
    reduced = hvd.allreduce(payload, op=op_fn, name=name + ".payload")
    out = comp.decompress(reduced, ctx)
    rec = {"own": own, "reduced": np.array(reduced.numpy(), copy=True), "out": out.numpy().copy(),
           "dtype": str(payload.dtype).replace("torch.", "")}
    if ctx is not None and hasattr(ctx[1], "diag"):
        rec.update(diag=ctx[1].diag.numpy().copy(), top=float(ctx[1].top), delta=float(ctx[1].delta))
    return rec


def _max_level_input(scheme, ops, info, torch):
    """x with rotated y = +R in every coordinate: a spike, signed by the step-0 diagonal."""
    diag = scheme.rotation_diagonal(ops, info, torch.tensor(0, dtype=torch.int64), torch.zeros(1))
    x = torch.zeros(info.shape)
    # rht(x) = H (x * diag): only coordinate 0 is non-zero, 3 |diag_0| = 3 / sqrt(B) > 0, and
    # column 0 of H is all ones, so every rotated coordinate is +3 / sqrt(B) = R.
    x.view(-1)[0] = 3.0 * float(torch.sign(diag[0]))
    return x


def worker_torch():
    import horovod.torch as hvd
    import torch
    from hvd_gradcomp.base import TensorInfo
    from torch_backend import OPS, Compression
    hvd.init()
    torch.set_num_threads(1)
    r, n = hvd.rank(), hvd.size()
    ops_by_name = {"sum": hvd.Sum, "average": hvd.Average}
    out = {"rank": r, "size": n}

    # 1. Main tensor, default THC and the simple adaptation, both ops.
    for label, spec in (("default", "thc"), ("simple", "thc:rotation=full,saturation=false,bits=2")):
        for op in ("sum", "average"):
            comp = Compression.from_spec(spec)
            out[f"{label}_{op}"] = _record(comp, torch.tensor(_inputs(r)), "main", ops_by_name[op], hvd)
            out[f"{label}_{op}"]["saturated"] = int(comp.metrics()["main"]["saturated"])

    # 2. Top level everywhere (bits 4, full rotation, no saturation).
    scheme_spec = "thc:rotation=full,saturation=false"
    comp = Compression.from_spec(scheme_spec)
    info = TensorInfo("top", (4096,), "float32", n, r)
    x = _max_level_input(comp.scheme, OPS, info, torch)
    out["top_sum"] = _record(comp, x, "top", hvd.Sum, hvd)

    # 3. Zeros give zeros.
    for op in ("sum", "average"):
        out[f"zeros_{op}"] = _record(Compression.thc(), torch.zeros(50, 100), "zeros", ops_by_name[op], hvd)["out"]

    # 4. NaN on rank 1, inf on rank 0 (other tensor): NaN everywhere; states untouched.
    for label, bad_rank, bad in (("nan", 1, float("nan")), ("inf", 0, float("inf"))):
        comp = Compression.thc()
        _record(comp, torch.tensor(_inputs(r, 1)), "t", hvd.Average, hvd)  # a first, finite step
        before = {k: v.clone() for k, v in comp.state_dict()["tensors"]["t"].items()}
        y = torch.tensor(_inputs(r, 2))
        if r == bad_rank:
            y[3, 7] = bad
        res = _record(comp, y, "t", hvd.Average, hvd)
        after = comp.state_dict()["tensors"]["t"]
        out[label] = {"all_nan": bool(np.isnan(res["out"]).all()),
                      "state_kept": all(torch.equal(before[k], after[k]) for k in before),
                      "step": int(after["step"])}

    # 5. Tiny tensors travel as fp16, pre-scaled by 1/n.
    tiny = torch.linspace(-1, 1, 100) * (r + 1)
    out["tiny"] = _record(Compression.thc(), tiny, "tiny", hvd.Sum, hvd)

    # 6. Sum == n * Average from identical states (same seed, same step, same levels).
    a = _record(Compression.thc(bits=8), torch.tensor(_inputs(r, 3)), "same", hvd.Sum, hvd)["out"]
    b = _record(Compression.thc(bits=8), torch.tensor(_inputs(r, 3)), "same", hvd.Average, hvd)["out"]
    out["sum_vs_avg"] = (a, b)

    # 7. DistributedOptimizer, default op (Average) and op=Sum: grads vs the true mean / sum.
    for op in ("average", "sum"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
        kwargs = {} if op == "average" else {"op": hvd.Sum}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                       named_parameters=net.named_parameters(),
                                       compression=Compression.thc(bits=8), **kwargs)
        gen = torch.Generator().manual_seed(100 + r)
        xb, yb = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        local = [torch.autograd.grad(torch.nn.functional.cross_entropy(net(xb), yb), list(net.parameters()))]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
        out[f"opt_{op}"] = {"local": [g.numpy().copy() for g in local[0]],
                            "synced": [p.grad.numpy().copy() for p in net.parameters()]}

    # Training with THC against FP16: tests/parallel/test_training.py.
    return out


def worker_wide():
    """3 or 4 ranks: top-level lanes at 2/4/8 bits, and a random tensor, with Sum and Average."""
    import horovod.torch as hvd
    import torch
    from hvd_gradcomp.base import TensorInfo
    from torch_backend import OPS, Compression
    hvd.init()
    torch.set_num_threads(1)
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n}
    for bits in (2, 4, 8):
        for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
            comp = Compression.thc(bits=bits, rotation="full", saturation=False)
            info = TensorInfo("top", (4096,), "float32", n, r)
            out[f"top_{bits}_{op_name}"] = _record(comp, _max_level_input(comp.scheme, OPS, info, torch),
                                                   "top", op, hvd)
            out[f"rand_{bits}_{op_name}"] = _record(Compression.thc(bits=bits), torch.tensor(_inputs(r, 4)),
                                                    "rand", op, hvd)
    return out


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

    out["tape"] = []
    for step in range(3):
        rng = np.random.default_rng([step, r])
        c_w = rng.standard_normal((64, 128)).astype(np.float32)
        c_b = rng.standard_normal(128).astype(np.float32)
        g_w, g_b = grads(tf.constant(c_w), tf.constant(c_b))
        out["tape"].append((c_w, c_b, g_w.numpy(), g_b.numpy()))
    out["tape_step"] = {k: int(v["step"]) for k, v in comp.state_dict()["tensors"].items() if "step" in v}
    # Direct all-reduce with op=Sum, and NaN on rank 0.
    x = tf.constant(_inputs(r, 5))
    out["sum"] = hvd.allreduce(x, name="tf_sum", op=hvd.Sum, compression=Compression.thc(bits=8)).numpy()
    bad = _inputs(r, 6)
    if r == 0:
        bad[0, 0] = np.nan
    out["nan"] = hvd.allreduce(tf.constant(bad), name="tf_nan", compression=Compression.thc()).numpy()
    return out


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def torch2():
    return run(worker_torch, np=2)


@pytest.fixture(scope="module")
def torch3():
    return run(worker_wide, np=3)


@pytest.fixture(scope="module")
def torch4():
    return run(worker_wide, np=4)


@pytest.fixture(scope="module")
def tf2():
    return run(worker_tf, np=2)


# ---------------------------------------------------------------- reference

def _layout(bits, n):
    width, guard = (n * ((1 << bits) - 1)).bit_length(), n.bit_length()
    return (31 - guard) // width, width, guard


def _unpack(words, bits, n, padded):
    lanes, width, guard = _layout(bits, n)
    shifts = guard + width * np.arange(lanes)
    return ((np.asarray(words, np.int64)[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)[:padded]


def _reference(records, bits, op, block):
    """What every rank must output, in float64, from each rank's own (pre-all-reduce) levels."""
    n = len(records)
    padded = records[0]["diag"].size
    levels = sum(_unpack(rec["own"][:-1], bits, n, padded) for rec in records)
    top, delta, diag = records[0]["top"], records[0]["delta"], records[0]["diag"].astype(np.float64)
    values = levels * delta - n * top if op == "sum" else levels / n * delta - top
    return fwht64(values, block) * diag, levels


def _check_exact_and_reference(records, bits, op, block, shape):
    n = len(records)
    for rec in records[1:]:  # shared scale and rotation; identical outputs
        assert rec["top"] == records[0]["top"] and np.array_equal(rec["diag"], records[0]["diag"])
        np.testing.assert_array_equal(rec["out"], records[0]["out"])
    # The all-reduced lanes hold exactly the sums of the ranks' levels (no carry), which for
    # Average are recovered from the truncated words (step 11).
    padded = records[0]["diag"].size
    summed = np.sum([rec["own"].astype(np.int64) for rec in records], axis=0)
    if op == "sum":
        np.testing.assert_array_equal(records[0]["reduced"].astype(np.int64), summed)
    else:
        np.testing.assert_array_equal(records[0]["reduced"][-1], 1 << 10)  # the averaged marker K
    ref, levels = _reference(records, bits, op, block)
    np.testing.assert_array_equal(_unpack(summed[:-1], bits, n, padded), levels)
    d = int(np.prod(shape))
    out = records[0]["out"].reshape(-1).astype(np.float64)
    np.testing.assert_allclose(out, ref[:d], rtol=0, atol=2e-6 * max(1.0, np.abs(ref).max()) * math.log2(block))
    return levels


# ---------------------------------------------------------------- 2 ranks, PyTorch

@pytest.mark.parametrize("label,bits,block", [("default", 4, 1024), ("simple", 2, 8192)])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_decoded_matches_float64_reference(torch2, label, bits, block, op):
    records = [res[f"{label}_{op}"] for res in torch2]
    assert all(rec["dtype"] == "int32" for rec in records)
    _check_exact_and_reference(records, bits, op, block, (50, 100))
    # ...and approximates the true sum / mean of the inputs.
    truth = sum(_inputs(r) for r in range(2)) / (2 if op == "average" else 1)
    err = np.linalg.norm(records[0]["out"] - truth) / np.linalg.norm(truth)
    assert err < {4: 0.25, 2: 1.3}[bits], err
    if label == "default":
        assert all(0 <= rec["saturated"] < 0.01 * 5120 for rec in records)
    else:
        assert all(rec["saturated"] == 0 for rec in records)


def test_top_level_on_two_ranks(torch2):
    records = [res["top_sum"] for res in torch2]
    levels = _check_exact_and_reference(records, 4, "sum", 4096, (4096,))
    assert levels.max() == 2 * 15 and (levels == 30).mean() > 0.999


@pytest.mark.parametrize("op", ["sum", "average"])
def test_zeros_give_zeros(torch2, op):
    for res in torch2:
        assert (res[f"zeros_{op}"] == 0).all()


@pytest.mark.parametrize("label", ["nan", "inf"])
def test_nonfinite_reaches_every_rank_and_spares_the_state(torch2, label):
    for res in torch2:
        assert res[label] == {"all_nan": True, "state_kept": True, "step": 1}


def test_tiny_tensor_goes_fp16(torch2):
    for res in torch2:
        assert res["tiny"]["dtype"] == "float16"
        np.testing.assert_allclose(res["tiny"]["out"], np.linspace(-1, 1, 100) * 3, atol=3e-3)


def test_sum_is_n_times_average(torch2):
    for res in torch2:
        total, mean = res["sum_vs_avg"]
        np.testing.assert_allclose(total, 2 * mean, rtol=0, atol=1e-5 * np.abs(total).max())


@pytest.mark.parametrize("op", ["average", "sum"])
def test_distributed_optimizer_sum_and_average(torch2, op):
    runs = [res[f"opt_{op}"] for res in torch2]
    for a, b in zip(runs[0]["synced"], runs[1]["synced"]):
        np.testing.assert_array_equal(a, b)
    for i, synced in enumerate(runs[0]["synced"]):
        truth = sum(run_["local"][i] for run_ in runs) / (2 if op == "average" else 1)
        err = np.linalg.norm(synced - truth) / np.linalg.norm(truth)
        assert err < 0.05, (op, i, err)  # 8 bits; biases (< min_numel) go as fp16 (~1e-3)


# ---------------------------------------------------------------- 3 and 4 ranks

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_wide_worlds(torch3, torch4, bits, op):
    for results in (torch3, torch4):
        n = len(results)
        assert [res["size"] for res in results] == [n] * n
        levels = _check_exact_and_reference([res[f"top_{bits}_{op}"] for res in results], bits, op, 4096, (4096,))
        top = (1 << bits) - 1
        assert levels.max() == n * top and (levels == n * top).mean() > 0.999
        assert n * top < 2 ** _layout(bits, n)[1]
        _check_exact_and_reference([res[f"rand_{bits}_{op}"] for res in results], bits, op, 1024, (50, 100))


# ---------------------------------------------------------------- TensorFlow

def test_tensorflow_tape_and_sum(tf2):
    for step in range(3):
        g_w = [res["tape"][step][2] for res in tf2]
        g_b = [res["tape"][step][3] for res in tf2]
        np.testing.assert_array_equal(g_w[0], g_w[1])
        np.testing.assert_array_equal(g_b[0], g_b[1])
        true_w = (tf2[0]["tape"][step][0] + tf2[1]["tape"][step][0]) / 2
        true_b = (tf2[0]["tape"][step][1] + tf2[1]["tape"][step][1]) / 2
        assert np.linalg.norm(g_w[0] - true_w) / np.linalg.norm(true_w) < 0.05  # 8 bits, with EF
        np.testing.assert_allclose(g_b[0], true_b, atol=2e-3)  # fp16
    assert all(step == 3 for step in tf2[0]["tape_step"].values()) and tf2[0]["tape_step"]
    truth = _inputs(0, 5) + _inputs(1, 5)
    for res in tf2:
        np.testing.assert_array_equal(res["sum"], tf2[0]["sum"])
        assert np.linalg.norm(res["sum"] - truth) / np.linalg.norm(truth) < 0.05
        assert np.isnan(res["nan"]).all()
