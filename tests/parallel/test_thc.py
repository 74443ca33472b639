"""THC under real Horovod (Gloo): 2-, 3- and 4-rank PyTorch launches (TensorFlow's 2-rank launch:
tests/parallel/test_thc_tf.py; what both share: tests/parallel/thc_launch.py).

Each launch runs one worker that does every check below and returns plain values; the tests
assert on them. Payloads are all-reduced by Horovod itself, with ``op=hvd.Sum`` and with the
default ``op=hvd.Average`` (which truncates int32: the scheme must recover exact sums). Two
call paths: by hand (``compress(t, name=...)``, ``hvd.allreduce(payload, op=...)``,
``decompress``: the op is unknown to the compressor and inferred from the count word; the
payload is visible, so outputs are checked against the float64 reference of
tests/core/thc_emulation.py computed from every rank's own levels), and through Horovod
(``hvd.allreduce(t, compression=c)``, ``DistributedOptimizer``, ``DistributedGradientTape``:
the adapter reads the op; the payload is not visible, so the reference is each rank's own
decoded contribution recovered from its states, ``rht(x) + e_before - e_after``).

The first step of a tensor sends nothing (its ranges are all 0), so every check runs at
least two steps.

- 2 ranks (PyTorch): decoded == the float64 reference, identical on all ranks, next ranges
  == the reference from the ranks' statistics, for the default THC and for the simple
  adaptation with the blocking ``range="current"`` (a real Max side all-reduce), Sum and
  Average; Horovod's int32 Average == trunc(sum / n) as tests/core/thc_emulation.py emulates it; every
  coordinate at the top level; zeros -> zeros; NaN/inf on one rank -> NaN on every rank and
  every rank's whole state unchanged; a state with another step loaded on one rank -> output
  exactly 0 on both ranks, ``metrics()["realigned"] == 1``, then correct; tiny tensors as
  fp16 (routed there by a plain ``Compression.thc()``); Sum == n * Average; ``hvd.allreduce(..., compression=c)`` with the op known;
  ``hvd.DistributedOptimizer`` with Average and with Sum gives the mean and the sum of the
  ranks' decoded gradients; and the 200-step training below.
- 3 ranks: Average with a world size that is not a power of two (``1/3`` is inexact in double).
- 4 ranks: every coordinate of every rank at the top level L, at 2, 4 and 8 bits (8 bits at 4
  ranks: the 8-bit lanes cap L at 31, filling a 7-bit lane to 124 of 127): the all-reduced
  lanes equal the sums of the ranks' levels, so nothing carried.
- 2, 3 and 4 ranks: ``subtract_own`` (lanes for the other ranks' sum) decodes bit for bit as
  the summing layout, every coordinate at the top level (the int32 sums wrap at 2 ranks
  under Sum and 3 under Average) and on a random tensor, the payload reduced in place (``hvd.allreduce_``).
- 2 ranks: a 1e6 drop in gradient scale (the flush bound).

Training: the workload of tests/parallel/test_training.py (a 64-32-10 MLP on scikit-learn's
digits, each rank holding half the data, full-batch gradient descent, lr 0.5, 200 steps from
the same initial weights; the 32x64 weight goes through THC, the rest is below ``min_numel``
and goes as fp16). The simple adaptation with this step's ranges
(``thc:rotation=full,saturation=false,range=current``, the blocking variant, whose side
all-reduce runs inside Horovod's backward hooks here) must end within 2 % + 0.005 of the fp16
run's full-data cross-entropy, as THC's default must in test_training.py.
"""
import numpy as np
import pytest

from tests.core.thc_emulation import fingerprint_ok, np_layout, rotated, top_level_misses_allowed, unrotated
from tests.hvdrun import run
from tests.parallel.thc_launch import (D, DROP_RUNS, STEPS, check_drop, check_hand, check_known, decoded_from_states,
                                       drop_runs, known_inputs, layout_of_record)

# THC's default is trained against fp16 in tests/parallel/test_training.py (same workload).
TRAIN_SPECS = {"fp16": "fp16", "thc_simple_current": "thc:rotation=full,saturation=false,range=current"}
TRAIN_STEPS = 200


def _state_np(comp, name):
    st = comp.state_dict()["tensors"].get(name)
    return None if st is None else {k: np.array(v.numpy(), copy=True) for k, v in st.items()}


def _hand_step(comp, tensor, name, op_fn, hvd):
    """compress by hand, Horovod all-reduce of the payload, decompress; all as NumPy."""
    before = _state_np(comp, name)
    payload, ctx = comp.compress(tensor, name=name)
    own = np.array(payload.numpy(), copy=True)
    reduced = hvd.allreduce(payload, op=op_fn, name=name + ".payload")
    out = comp.decompress(reduced, ctx)
    rec = {"own": own, "reduced": np.array(reduced.numpy(), copy=True), "out": np.array(out.numpy(), copy=True),
           "dtype": str(payload.dtype).replace("torch.", "").replace("<dtype: '", "").replace("'>", ""),
           "x": np.array(tensor.numpy(), copy=True), "before": before, "after": _state_np(comp, name)}
    scheme_ctx = ctx[1] if ctx is not None else None
    if scheme_ctx is not None and hasattr(scheme_ctx, "diag"):
        rec.update(ranges=np.array(scheme_ctx.ranges.numpy(), copy=True),
                   diag=np.array(scheme_ctx.diag.numpy(), copy=True),
                   corrected=np.array(scheme_ctx.corrected.numpy(), copy=True))
    return rec


def _top_input(scheme, ops, info, like):
    """x whose rotation is +3/sqrt(B) in every coordinate: a spike signed by the diagonal."""
    diag = np.asarray(scheme.rotation_diagonal(ops, info, like).numpy())
    x = np.zeros(info.numel, np.float32)
    x[0] = 3.0 * np.sign(diag[0])
    return x.reshape(info.shape)


def _own_against_plain(hvd, torch, Compression, OPS, TensorInfo, n, r):
    """``subtract_own`` against the summing layout, both ops: every coordinate at the top
    level (the int32 sums of the own-lane words wrap at 2 ranks under Sum and 3 under
    Average), then a random tensor;
    the payload all-reduced in place (``hvd.allreduce_``, as ``DistributedOptimizer`` does), so
    the decode must use the ctx's copy of this rank's words. {op: [plain outs, own outs, words]}."""
    out = {}
    for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        runs = []
        for own in (False, True):
            comp = Compression.thc(rotation="full", saturation=False, subtract_own=own)
            info = TensorInfo("own", (4096,), "float32", n, r)
            inputs = [_top_input(comp.scheme, OPS, info, torch.zeros(1))] * 2 + [known_inputs(r, 9, 0).reshape(-1)[:4096]]
            outs = []
            for t, x in enumerate(inputs):
                payload, ctx = comp.compress(torch.tensor(x), name="own")
                hvd.allreduce_(payload, op=op, name=f"own.{op_name}.{own}.{t}")
                outs.append(np.array(comp.decompress(payload, ctx).numpy(), copy=True))
            runs.append((outs, int(payload.numel())))
        out[op_name] = [runs[0][0], runs[1][0], (runs[0][1], runs[1][1])]
    return out


def _spy_op(comp):
    """A list that fills with the TensorInfo.op of each decode of ``comp``'s scheme (its
    ``decompress_into``, which the step calls, and ``decompress`` calls)."""
    seen = []
    decompress_into = comp.scheme.decompress_into

    def spy(ops, payload, ctx, info, factor, into):
        seen.append(info.op)
        return decompress_into(ops, payload, ctx, info, factor, into)
    comp.scheme.decompress_into = spy
    return seen


def worker_torch():
    import horovod.torch as hvd
    import torch
    from hvd_gradcomp.base import TensorInfo
    from torch_backend import OPS, Compression
    hvd.init()
    torch.set_num_threads(1)
    r, n = hvd.rank(), hvd.size()
    ops = {"sum": hvd.Sum, "average": hvd.Average}
    out = {"rank": r, "size": n}

    # 1. Main tensor by hand: default THC and the simple adaptation (blocking), both ops.
    for label, spec in (("default", "thc"), ("simple", "thc:rotation=full,saturation=false,bits=2,range=current")):
        for op in ("sum", "average"):
            comp = Compression.from_spec(spec)
            recs = []
            for t in range(STEPS):
                recs.append(_hand_step(comp, torch.tensor(known_inputs(r, 0, t)), "main", ops[op], hvd))
                recs[-1]["saturated"] = int(comp.metrics()["main"]["saturated"])
            out[f"{label}_{op}"] = recs

    # 2. Top level everywhere (4 bits, full rotation, no saturation), Sum.
    comp = Compression.from_spec("thc:rotation=full,saturation=false")
    x = _top_input(comp.scheme, OPS, TensorInfo("top", (4096,), "float32", n, r), torch.zeros(1))
    out["top_sum"] = [_hand_step(comp, torch.tensor(x), "top", hvd.Sum, hvd) for _ in range(2)]

    # 3. Zeros give zeros (through Horovod, op known).
    for op in ("sum", "average"):
        comp = Compression.thc()
        out[f"zeros_{op}"] = [hvd.allreduce(torch.zeros(50, 100), name=f"zeros_{op}", op=ops[op],
                                            compression=comp).numpy().copy() for _ in range(3)]

    # 4. NaN on rank 1, inf on rank 0: NaN everywhere; every rank's whole state untouched.
    for label, bad_rank, bad in (("nan", 1, float("nan")), ("inf", 0, float("inf"))):
        comp = Compression.thc()
        for t in range(2):  # finite steps first: residual, ranges and step are set
            _hand_step(comp, torch.tensor(known_inputs(r, 1, t)), "t", hvd.Average, hvd)
        y = torch.tensor(known_inputs(r, 2))
        if r == bad_rank:
            y[3, 7] = bad
        res = _hand_step(comp, y, "t", hvd.Average, hvd)
        nxt = _hand_step(comp, torch.tensor(known_inputs(r, 3)), "t", hvd.Average, hvd)
        out[label] = {"rec": res, "next": nxt}

    # 5. A state with another step loaded on rank 1 only: zero output, realigned, then correct.
    comp = Compression.thc()
    recs = [_hand_step(comp, torch.tensor(known_inputs(r, 4, t)), "fp", hvd.Sum, hvd) for t in range(2)]
    if r == 1:
        saved = comp.state_dict()
        saved["tensors"]["fp"]["step"] = saved["tensors"]["fp"]["step"] + 7
        comp.load_state_dict(saved)
    for t in range(2, 5):
        recs.append(_hand_step(comp, torch.tensor(known_inputs(r, 4, t)), "fp", hvd.Sum, hvd))
        recs[-1]["realigned"] = int(comp.metrics()["fp"]["realigned"])
    out["mismatch"] = recs

    # 6. Tiny tensors travel as fp16, pre-scaled by 1/n: the routing of a plain thc
    # compressor (min_numel 1024) sends them to the fp16 scheme.
    tiny = Compression.thc()
    out["tiny"] = _hand_step(tiny, torch.linspace(-1, 1, 100) * (r + 1), "tiny", hvd.Sum, hvd)
    out["tiny_wire"] = tiny.wire_bytes()["tiny"].payload
    out["tiny_routes"] = tiny.routes()

    # 7. Sum == n * Average from identical states (same seed, same steps, same levels).
    for op in ("sum", "average"):
        comp = Compression.thc(bits=8)
        out[f"same_{op}"] = [_hand_step(comp, torch.tensor(known_inputs(r, 5, t)), "same", ops[op], hvd)["out"]
                             for t in range(2)]

    # 8. hvd.allreduce(..., compression=c): the adapter knows the op; wire == payload bytes.
    for op in ("sum", "average"):
        comp = Compression.thc()
        seen = _spy_op(comp)
        recs = []
        for t in range(STEPS):
            x = torch.tensor(known_inputs(r, 6, t))
            before = _state_np(comp, "known")
            got = hvd.allreduce(x, name="known", op=ops[op], compression=comp)
            recs.append({"x": x.numpy().copy(), "out": got.numpy().copy(), "before": before,
                         "after": _state_np(comp, "known")})
        out[f"known_{op}"] = {"steps": recs, "wire": comp.wire_bytes()["known"].payload, "ops": seen}

    # 9. DistributedOptimizer, default op (Average) and op=Sum, lr 0: synced vs decoded.
    for op in ("average", "sum"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
        kwargs = {} if op == "average" else {"op": hvd.Sum}
        comp = Compression.thc(bits=8)
        seen = _spy_op(comp)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                       named_parameters=net.named_parameters(), compression=comp, **kwargs)
        names = [name for name, _ in net.named_parameters()]
        steps = []
        for t in range(STEPS):
            gen = torch.Generator().manual_seed(100 + 10 * t + r)
            xb, yb = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            before = {k: _state_np(comp, k) for k in names}
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            local = [p.grad.numpy().copy() for p in net.parameters()]
            opt.step()
            steps.append({"local": local, "synced": [p.grad.numpy().copy() for p in net.parameters()],
                          "before": before, "after": {k: _state_np(comp, k) for k in names}})
        out[f"opt_{op}"] = {"names": names, "steps": steps, "ops": seen}

    out.update(drop_runs(hvd, Compression.from_spec, torch.tensor, _state_np))
    out["own"] = _own_against_plain(hvd, torch, Compression, OPS, TensorInfo, n, r)

    # 10. Training against fp16 (tests/parallel/test_training.py's workload).
    from tests.digits import train
    out["losses"] = {label: train(hvd, Compression.from_spec(spec), TRAIN_STEPS)
                     for label, spec in TRAIN_SPECS.items()}
    return out


def worker_wide():
    """3 or 4 ranks: top-level lanes at 2/4/8 bits, a random tensor, Sum and Average."""
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
            x = _top_input(comp.scheme, OPS, TensorInfo("top", (4096,), "float32", n, r), torch.zeros(1))
            out[f"top_{bits}_{op_name}"] = [_hand_step(comp, torch.tensor(x), "top", op, hvd) for _ in range(2)]
            comp = Compression.thc(bits=bits)
            out[f"rand_{bits}_{op_name}"] = [_hand_step(comp, torch.tensor(known_inputs(r, 7, t)), "rand", op, hvd)
                                             for t in range(STEPS)]
    comp = Compression.thc()
    seen = _spy_op(comp)
    known = []
    for t in range(STEPS):
        x = torch.tensor(known_inputs(r, 8, t))
        before = _state_np(comp, "known")
        got = hvd.allreduce(x, name="known", compression=comp)  # Average, op known
        known.append({"x": x.numpy().copy(), "out": got.numpy().copy(), "before": before,
                      "after": _state_np(comp, "known")})
    out["known_average"] = {"steps": known, "ops": seen}
    out["own"] = _own_against_plain(hvd, torch, Compression, OPS, TensorInfo, n, r)
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


# ---------------------------------------------------------------- 2 ranks, PyTorch

@pytest.mark.parametrize("label,bits,blocking,saturation", [("default", 4, False, True), ("simple", 2, True, False)])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_decoded_matches_float64_reference(torch2, label, bits, blocking, saturation, op):
    for t in range(STEPS):
        records = [res[f"{label}_{op}"][t] for res in torch2]
        ref, lay, _ = check_hand(records, bits, op, blocking, saturation)
        if not blocking and t == 0:
            assert (ref == 0).all() and all((rec["out"] == 0).all() for rec in records)
            for rec in records:  # the residual is the whole rotated input
                np.testing.assert_allclose(rec["after"]["residual"], rotated(rec["x"], rec["diag"], lay["block"]),
                                           rtol=0, atol=1e-5)
            continue
        # ...and approximates the sum / mean of what the ranks set out to send this step.
        target = sum(unrotated(rec["corrected"], rec["diag"], lay["block"], D) for rec in records)
        target /= (2 if op == "average" else 1)
        err = np.linalg.norm(records[0]["out"].reshape(-1) - target) / np.linalg.norm(target)
        assert err < {4: 0.3, 2: 1.3}[bits], (t, err)
        for rec in records:
            assert int(rec["after"]["step"]) == t + 1
            if saturation:
                assert 0 <= rec["saturated"] < 0.05 * lay["padded"]
            else:
                assert rec["saturated"] == 0  # this step's peak: nothing clipped


def test_top_level_on_two_ranks(torch2):
    records = [res["top_sum"][1] for res in torch2]
    ref, lay, summed = check_hand(records, 4, "sum", saturation=False)
    assert summed.max() == 2 * 15 and (summed < 30).sum() <= top_level_misses_allowed(2, 4, summed.size)


@pytest.mark.parametrize("op", ["sum", "average"])
def test_zeros_give_zeros(torch2, op):
    for res in torch2:
        for out in res[f"zeros_{op}"]:
            assert (out == 0).all()


@pytest.mark.parametrize("label", ["nan", "inf"])
def test_nonfinite_reaches_every_rank_and_spares_the_state(torch2, label):
    for res in torch2:
        rec = res[label]["rec"]
        assert np.isnan(rec["out"]).all()
        for field, value in rec["before"].items():  # the whole state, every field
            np.testing.assert_array_equal(rec["after"][field], value, err_msg=field)
        assert int(rec["after"]["step"]) == 2
    check_hand([res[label]["next"] for res in torch2], 4, "average")


def test_fingerprint_mismatch_gives_zero_then_recovers(torch2):
    runs = [res["mismatch"] for res in torch2]
    assert [int(rec["after"]["step"]) for rec in runs[1][:2]] == [1, 2]
    bad = [run_[2] for run_ in runs]
    lay = layout_of_record(bad[0], 4, 2)
    assert not fingerprint_ok([rec["own"] for rec in bad], lay)
    for rec in bad:
        assert (rec["out"] == 0).all() and rec["realigned"] == 1
        assert int(rec["after"]["step"]) == 0
        np.testing.assert_array_equal(rec["after"]["residual"], rec["corrected"])  # nothing applied
    for t in (3, 4):
        records = [run_[t] for run_ in runs]
        ref, _, _ = check_hand(records, 4, "sum")
        assert np.abs(ref).max() > 0.5
        assert all(rec["realigned"] == 1 and int(rec["after"]["step"]) == t - 2 for rec in records)


def test_tiny_tensor_goes_fp16(torch2):
    for res in torch2:
        assert res["tiny_routes"] == {"tiny": "fp16"}
        assert res["tiny"]["dtype"] == "float16" and res["tiny"]["own"].nbytes == res["tiny_wire"] == 200
        np.testing.assert_allclose(res["tiny"]["out"], np.linspace(-1, 1, 100) * 3, atol=3e-3)


def test_sum_is_n_times_average(torch2):
    for res in torch2:
        for total, mean in zip(res["same_sum"], res["same_average"]):
            np.testing.assert_allclose(total, 2 * mean, rtol=0, atol=1e-5 * max(1.0, np.abs(total).max()))
        assert np.abs(res["same_sum"][1]).max() > 1


@pytest.mark.parametrize("op", ["sum", "average"])
def test_allreduce_with_compression_knows_the_op(torch2, op):
    check_known([res[f"known_{op}"]["steps"] for res in torch2], op)
    assert all(res[f"known_{op}"]["ops"] == [op] * STEPS for res in torch2)
    lay = np_layout(4, 2, D, 1024)
    assert torch2[0][f"known_{op}"]["wire"] == 4 * lay["total"]


@pytest.mark.parametrize("op", ["average", "sum"])
def test_distributed_optimizer_sum_and_average(torch2, op):
    """Synced gradients == the mean / sum of the ranks' decoded gradients (THC on the two
    weights, 8192 and 1280 coordinates; fp16 on the biases, below min_numel: the routing sends
    them to the fp16 scheme, so THC's decompress sees the two weights only)."""
    runs = [res[f"opt_{op}"] for res in torch2]
    assert all(run_["ops"] == [op] * (2 * STEPS) for run_ in runs), [run_["ops"] for run_ in runs]
    names = runs[0]["names"]
    for t in range(STEPS):
        steps = [run_["steps"][t] for run_ in runs]
        for i, name in enumerate(names):
            synced = [st["synced"][i] for st in steps]
            np.testing.assert_array_equal(synced[0], synced[1])
            truth = sum(st["local"][i] for st in steps) / (2 if op == "average" else 1)
            if steps[0]["after"][name] is None:  # bias: fp16
                np.testing.assert_allclose(synced[0], truth, rtol=0, atol=2e-3 * np.abs(truth).max())
                continue
            if t == 0:
                assert (synced[0] == 0).all()
                continue
            per_rank = [{"x": st["local"][i], "before": st["before"][name], "after": st["after"][name]} for st in steps]
            ref = decoded_from_states(per_rank, op, 1024).reshape(synced[0].shape)
            np.testing.assert_allclose(synced[0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_training_matches_fp16(torch2):
    for res in torch2:
        losses = res["losses"]
        for label in ("thc_simple_current",):
            assert losses[label] <= 1.02 * losses["fp16"] + 0.005, (label, losses)
    assert torch2[0]["losses"] == torch2[1]["losses"]


# ---------------------------------------------------------------- 3 and 4 ranks

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_wide_worlds(torch3, torch4, bits, op):
    for results in (torch3, torch4):
        n = len(results)
        assert [res["size"] for res in results] == [n] * n
        _, lay, summed = check_hand([res[f"top_{bits}_{op}"][1] for res in results], bits, op, saturation=False)
        top = lay["L"]
        assert top == 2 ** bits - 1  # an explicit bits is honoured at every world size (issue 36)
        assert summed.max() == n * top and (summed < n * top).sum() <= top_level_misses_allowed(n, bits, summed.size)
        assert summed.min() >= n * (top - 1) and n * top < 2 ** lay["width"]
        for t in range(STEPS):
            ref, _, _ = check_hand([res[f"rand_{bits}_{op}"][t] for res in results], bits, op)
            assert (ref == 0).all() if t == 0 else np.abs(ref).max() > 0.1


def test_subtract_own_decodes_as_the_summing_layout(torch2, torch3, torch4):
    """``subtract_own`` under real Horovod (Gloo's int32 Sum and Average, which wrap), the
    payload reduced in place: every rank's output equals the summing layout's bit for bit,
    at every coordinate at the top level and on a random tensor, in fewer words at 2 and 3
    ranks."""
    for results in (torch2, torch3, torch4):
        n = len(results)
        for op in ("sum", "average"):
            for res in results:
                plain, own, (plain_words, own_words) = res["own"][op]
                assert own_words < plain_words if n <= 3 else own_words <= plain_words
                for t, (a, b) in enumerate(zip(plain, own)):
                    np.testing.assert_array_equal(a, b, err_msg=f"{n} ranks, {op}, step {t}")
                assert np.abs(own[1]).max() > 0.1 and np.abs(own[2]).max() > 0.01


def test_wide_worlds_known_average(torch3, torch4):
    for results in (torch3, torch4):
        check_known([res["known_average"]["steps"] for res in results], "average")
        assert all(res["known_average"]["ops"] == ["average"] * STEPS for res in results)


# ---------------------------------------------------------------- a sudden drop in scale

@pytest.mark.parametrize("spec,op", DROP_RUNS)
def test_drop_in_scale_settles_and_keeps_what_is_owed(torch2, spec, op):
    """After the gradients fall 1e6x, error feedback flushes at most the new gradient's own range
    a step, and nothing is lost (:func:`tests.parallel.thc_launch.check_drop`); PyTorch's run."""
    check_drop(torch2, spec, op)

