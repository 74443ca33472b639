"""FSDP2's reduce-scatter compressed (``torch_backend.fsdp.install_reduce_scatter``), on real
Gloo processes.

The probe model of :mod:`tests.parallel.test_fsdp` (loss ``sum(p * G_r[p])``, so rank ``r``'s
gradient of ``p`` at step ``t`` is the seeded ``G_r[p]``): FSDP modules ``blk`` (``w`` 64x64 and
``b`` 64), ``head`` (``v`` 33x64: the last shard is padded) and the root (``s``, 10 values: fp16
below ``min_numel``). FSDP reduce-scatters (and averages) each module's flat gradient within the
shard group; the compressor sends each destination's chunk under the destination's keys.

Checks, against float64 recomputed here: every rank ends with the same full gradients and
parameters; fp16 and bf16 equal the mean gradient to their rounding, THC and signSGD within
their error; error feedback's balance (what the steps delivered, plus the mean over the
senders of what each still owes of each chunk, mapped from the chunks back to the parameters,
is the sum of the mean gradients); keys, routes and world per rank; exact resume of model,
optimizer and compressor from per-rank checkpoints; the uncompressed route (``none``) equal to
native FSDP bit for bit.

Launches (each kills its process group at its timeout):
1. two ranks, a 1-D mesh of 2 (FSDP without replicas): none, fp16, bf16, thc, signsgd (thc also
   ``per="group"``); ``set_gradient_divide_factor``; ``MixedPrecisionPolicy(reduce_dtype=
   float16)`` (THC) and ``reduce_dtype=bfloat16`` (signSGD); the refusals;
2. four ranks, a 2 x 2 (replicate, shard) mesh: fp16, thc, signsgd with FSDP's own all-reduce
   across replicas, and thc on both collectives (``install`` with a second compressor).
"""
import math
import os

import numpy as np
import pytest

from tests.ddprun import run
from tests.parallel.test_fsdp import SHAPES, _build, _params, _residuals, _segments, _step, _truth, grads_of

SPECS = ["none", "fp16", "bf16", "thc", "signsgd"]
SPECS4 = ["fp16", "thc", "signsgd"]
STEPS = 5
RESUME = 2


def _train(mesh, spec, tmp, per="param", both=False, resume=True, **kw):
    """STEPS steps with the reduce-scatter compressed by ``spec`` (``both``: HSDP's all-reduce
    compressed too, by a second compressor of ``spec``); then, from per-rank checkpoints,
    RESUME more steps of the continued and of a rebuilt run."""
    import torch
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    rank = dist.get_rank()

    def build():
        model, opt = _build(mesh, **kw)
        comp = install_reduce_scatter(model, Compression.from_spec(spec), per=per)
        other = install(model, Compression.from_spec(spec)) if both else None
        return model, opt, comp, other

    model, opt, comp, other = build()
    outs = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
    rec = {"outs": outs, "residuals": _residuals(comp), "routes": comp.routes(), "params": _params(model),
           "worlds": sorted({(i.world_size, i.rank) for i in comp.codec.tensors.infos.values()}),
           "dtypes": sorted({i.dtype for i in comp.codec.tensors.infos.values()})}
    if resume:
        path = os.path.join(tmp, f"{spec}-{per}-{both}-rank{rank}.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "comp": comp.state_dict(),
                    "other": other.state_dict() if other is not None else None}, path)
        dist.barrier()
        model2, opt2, comp2, other2 = build()
        ckpt = torch.load(path, weights_only=False)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["optim"])
        comp2.load_state_dict(ckpt["comp"])
        if other2 is not None:
            other2.load_state_dict(ckpt["other"])
        rec["resume"] = [(_step(model, opt, grads_of(rank, t)), _step(model2, opt2, grads_of(rank, t)))
                         for t in range(STEPS, STEPS + RESUME)]
        rec["resume_params"] = (_params(model), _params(model2))
    return rec


def two_worker(tmp):
    """Launch 1 (module docstring): 2 ranks, a 1-D mesh of 2."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    from tests.hvdrun import value_error
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    out = {spec: _train(mesh, spec, tmp) for spec in SPECS}
    out["thc per group"] = _train(mesh, "thc", tmp, per="group")
    out["thc own"] = _train(mesh, "thc:subtract_own=true", tmp, resume=False)
    model, opt = _build(mesh)  # native FSDP
    out["native"] = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
    # set_gradient_divide_factor(1): FSDP's PreMulSum(1) -> the sum over the ranks
    model, opt = _build(mesh)
    for m in (model, model.blk, model.head):
        m.set_gradient_divide_factor(1.0)
    install_reduce_scatter(model, Compression.thc())
    out["factor"] = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
    # float16 reduction (FSDP pre- and post-divides, op Sum)
    model, opt = _build(mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))
    comp = install_reduce_scatter(model, Compression.thc())
    out["reduce fp16"] = ([_step(model, opt, grads_of(rank, t)) for t in range(STEPS)], _residuals(comp),
                          sorted({i.dtype for i in comp.codec.tensors.infos.values()}))
    # bfloat16 reduction (FSDP's op Avg), signSGD
    model, opt = _build(mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    comp = install_reduce_scatter(model, Compression.signsgd())
    out["reduce bf16"] = ([_step(model, opt, grads_of(rank, t)) for t in range(STEPS)], _residuals(comp),
                          sorted({i.dtype for i in comp.codec.tensors.infos.values()}))
    # refusals, on every rank
    errors = {}
    model, _ = _build(mesh)
    for spec in ("topkc:0.1", "powersgd:2", "auto", "topk:0.1", "thc:range=current", "*.w -> topkc:0.1; thc"):
        errors[spec] = value_error(lambda: install_reduce_scatter(model, Compression.from_spec(spec)))
    errors["per"] = value_error(lambda: install_reduce_scatter(model, Compression.thc(), per="bucket"))
    try:
        install_reduce_scatter(torch.nn.Linear(2, 2), Compression.thc())
    except TypeError as e:
        errors["not fsdp"] = str(e)
    comp = install_reduce_scatter(model, Compression.thc())
    errors["twice"] = value_error(lambda: install_reduce_scatter(model, Compression.thc()))
    errors["bound"] = value_error(lambda: install_reduce_scatter(_build(mesh)[0], comp))
    errors["bound to install"] = value_error(lambda: install(_build(mesh)[0], comp,
                                                             replicate_group=dist.group.WORLD))
    mesh2d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    errors["one rank"] = value_error(lambda: install_reduce_scatter(_build(mesh2d["shard"])[0], Compression.thc()))
    out["errors"] = errors
    return out


def four_worker(tmp):
    """Launch 2 (module docstring): 4 ranks, a 2 x 2 (replicate, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {spec: _train(mesh, spec, tmp) for spec in SPECS4}
    out["thc both"] = _train(mesh, "thc", tmp, both=True)
    out["thc own both"] = _train(mesh, "thc:subtract_own=true", tmp, both=True, resume=False)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(two_worker, np=2, args=(str(tmp_path_factory.mktemp("fsdprs2")),), timeout=500)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(four_worker, np=4, args=(str(tmp_path_factory.mktemp("fsdprs4")),), timeout=600)


def _key(name, shard, size, per="param"):
    owner = name if per == "param" else (name.rpartition(".")[0] or "<root>")
    return f"{owner}[shard {shard}/{size}]"


def _unshard(name, parts, size):
    d0, rest = SHAPES[name][0], math.prod(SHAPES[name][1:])
    rows = -(-d0 // size)
    return np.concatenate([p.reshape(rows, rest) for p in parts])[:d0].reshape(SHAPES[name])


# The casts: the largest error of one step's delivered mean gradient, relative to its largest
# value (their rounding). THC and signSGD deliver with error feedback (THC's first step sends
# nothing, and what is owed arrives later): the L2 error of each step from the third on (THC)
# and of the sum over the steps, relative to the truth's L2 norm; measured 0.25-0.32 (THC,
# steps 2-4) and 0.2 / 0.6 (THC / signSGD, sum), with margin. Error feedback's balance, checked
# too, is exact.
STEP_ERROR = {"none": 1e-6, "fp16": 2e-3, "bf16": 1e-2}
STEP_L2 = {"thc": 0.45}
TOTAL_L2 = {"thc": 0.4, "signsgd": 0.9}


def check_values(results, spec, replicas, size):
    world = replicas * size
    per = "group" if spec.endswith(" per group") else "param"
    recs = [r[spec] for r in results]
    scheme = spec.removesuffix(" per group").removesuffix(" both")
    for rec in recs[1:]:  # every rank: the same full gradients and parameters
        for a, b in zip(recs[0]["outs"], rec["outs"]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        for n in SHAPES:
            np.testing.assert_array_equal(recs[0]["params"][n], rec["params"][n], err_msg=n)
    for rank, rec in enumerate(recs):  # bound to the shard group; every chunk's key, on every rank
        assert rec["worlds"] == [(size, rank % size)], rec["worlds"]
        assert set(rec["routes"]) == {_key(n, s, size, per) for n in SHAPES for s in range(size)}, rec["routes"]
        assert rec["routes"] == recs[0]["routes"]
    routes = recs[0]["routes"]
    if scheme not in ("none", "fp16", "bf16"):  # compressed (s is below min_numel: fp16)
        assert routes[_key("head.v", 0, size, per)].startswith(scheme), routes
        assert routes[_key("s", 0, size, per)] == ("fp16" if scheme == "thc" else scheme)
    truth = _truth(world, range(STEPS))
    for n in SHAPES:
        route = routes[_key(n, 0, size, per)].partition(":")[0]
        outs = [o[n] for o in recs[0]["outs"]]
        if route in STEP_ERROR:
            for t in range(STEPS):
                err = np.abs(outs[t] - truth[n][t]).max() / np.abs(truth[n][t]).max()
                assert err <= STEP_ERROR[route], (spec, n, t, err)
            continue
        for t in range(2, STEPS) if route in STEP_L2 and not spec.endswith(" both") else ():
            err = np.linalg.norm(outs[t] - truth[n][t]) / np.linalg.norm(truth[n][t])
            assert err <= STEP_L2[route], (spec, n, t, err)
        err = np.linalg.norm(sum(outs) - sum(truth[n])) / np.linalg.norm(sum(truth[n]))
        # compressed, within its error (compressed twice, "both": each compression's error
        # feedback holds back its part, THC's first step sends nothing on either collective)
        assert 1e-3 < err <= TOTAL_L2[route] * (2 if spec.endswith(" both") else 1), (spec, n, err)
    # error feedback's balance, float64: delivered + the senders' mean pending residual = the sum
    # over steps of the mean gradient over all ranks (with install's all-reduce compressed too,
    # its own residuals would join: checked in test_fsdp.py)
    if spec.endswith(" both"):
        return
    owing = False
    for n in SHAPES:
        want = sum(truth[n])
        delivered = sum(o[n] for o in recs[0]["outs"])
        pending = []
        for shard in range(size):
            parts = [rec["residuals"].get(_key(n, shard, size, per)) for rec in recs]
            total = 0.0
            for p in parts:
                if p is not None:
                    total = total + _segments(n, p, size, per)
                    owing = owing or np.abs(p).max() > 0
            pending.append(total / world if not np.isscalar(total) else None)
        if pending[0] is not None:
            delivered = delivered + _unshard(n, pending, size)
        bound = STEPS * 2.0 ** -9 * np.abs(want).max() + 1e-5
        assert np.abs(delivered - want).max() <= bound, (spec, n, np.abs(delivered - want).max())
    assert owing == (scheme in ("thc", "signsgd"))  # the casts keep no error feedback


def check_resume(results, spec):
    for rec in (r[spec] for r in results):
        for before, after in rec["resume"]:
            for n in SHAPES:
                np.testing.assert_array_equal(before[n], after[n], err_msg=f"{spec} {n}")
        for n in SHAPES:
            np.testing.assert_array_equal(rec["resume_params"][0][n], rec["resume_params"][1][n])


ALL2 = SPECS + ["thc per group"]


@pytest.mark.parametrize("spec", ALL2)
def test_two_ranks_values(two, spec):
    check_values(two, spec, replicas=1, size=2)


@pytest.mark.parametrize("spec", ALL2)
def test_two_ranks_resume(two, spec):
    check_resume(two, spec)


def test_subtract_own_trains_as_thc(two, four):
    """``thc:subtract_own=true`` on FSDP2's reduce-scatter (each destination decodes with the
    words it sent for its own chunk) and, at 2 x 2, on HSDP's all-reduce across replicas too:
    the same full gradients and parameters as ``thc`` bit for bit."""
    for results, own, plain in ((two, "thc own", "thc"), (four, "thc own both", "thc both")):
        for r in results:
            for a, b in zip(r[own]["outs"], r[plain]["outs"]):
                for n in SHAPES:
                    np.testing.assert_array_equal(a[n], b[n], err_msg=n)
            for n in SHAPES:
                np.testing.assert_array_equal(r[own]["params"][n], r[plain]["params"][n], err_msg=n)


def test_none_is_native(two):
    for r in two:
        for ours, native in zip(r["none"]["outs"], r["native"]):
            for n in SHAPES:
                np.testing.assert_array_equal(ours[n], native[n], err_msg=n)


def test_divide_factor(two):
    """FSDP's own factor 1 (PreMulSum(1)): the compressed sum over both ranks."""
    for r in two:
        for n in SHAPES:
            total = sum(o[n] for o in r["factor"])
            want = sum(sum(grads_of(q, t)[n].double().numpy() for q in range(2)) for t in range(STEPS))
            assert np.abs(total - want).max() <= 0.5 * np.abs(want).max(), n
            np.testing.assert_array_equal(r["factor"][-1][n], two[0]["factor"][-1][n])
        assert np.abs(r["factor"][1]["blk.w"] - 2 * r["thc"]["outs"][1]["blk.w"]).max() <= 1e-5 * np.abs(
            r["factor"][1]["blk.w"]).max()


def test_reduce_fp16(two):
    """MixedPrecisionPolicy(reduce_dtype=float16): the chunks are float16 when compressed, and the
    ranks agree."""
    outs, _, dtypes = two[0]["reduce fp16"]
    assert dtypes == ["float16"]
    for a, b in zip(outs, two[1]["reduce fp16"][0]):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])
    truth = _truth(2, range(STEPS))
    for t in range(2, STEPS):
        err = np.linalg.norm(outs[t]["blk.w"] - truth["blk.w"][t]) / np.linalg.norm(truth["blk.w"][t])
        assert err <= STEP_L2["thc"], (t, err)
    # balance: FSDP pre-divides the float16 input by 2 and sums (Sum): the residuals are in
    # the input's units, so delivered + their sum is the sum of the mean gradients (to float16)
    for n in ("blk.w", "head.v"):
        pending = [sum(r["reduce fp16"][1][_key(n, shard, 2)] for r in two) for shard in range(2)]
        delivered = sum(o[n] for o in outs) + _unshard(n, pending, 2)
        want = sum(truth[n])
        assert np.abs(delivered - want).max() <= 4 * STEPS * 2.0 ** -10 * np.abs(want).max(), n


def test_reduce_bf16(two):
    """MixedPrecisionPolicy(reduce_dtype=bfloat16): bfloat16 chunks, the ranks agree, and error
    feedback balances to bfloat16 rounding (the residuals in the input's units, FSDP's Avg
    dividing the decoded sum by 2)."""
    outs, _, dtypes = two[0]["reduce bf16"]
    assert dtypes == ["bfloat16"]
    for a, b in zip(outs, two[1]["reduce bf16"][0]):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])
    truth = _truth(2, range(STEPS))
    for n in SHAPES:
        pending = [sum(r["reduce bf16"][1][_key(n, shard, 2)] for r in two) / 2 for shard in range(2)]
        delivered = sum(o[n] for o in outs) + _unshard(n, pending, 2)
        want = sum(truth[n])
        assert np.abs(delivered - want).max() <= 2 * STEPS * 2.0 ** -7 * np.abs(want).max(), n


def test_refusals(two):
    for r in two:
        e = r["errors"]
        assert "routes tensors to topkc:ratio=0.1, which cannot be reduce-scattered: its agreed chunk " \
               "scores are a float sum" in e["topkc:0.1"], e["topkc:0.1"]
        assert "cannot be reduce-scattered: its payload is a low-rank factor" in e["powersgd:2"], e["powersgd:2"]
        assert "auto" in e["auto"] and "cannot be reduce-scattered" in e["auto"], e["auto"]
        assert "topk:ratio=0.1, which cannot be reduce-scattered: its finish reads" in e["topk:0.1"], e["topk:0.1"]
        assert "blocking two-round variants" in e["thc:range=current"], e["thc:range=current"]
        assert "topkc:ratio=0.1, which cannot be reduce-scattered" in e["*.w -> topkc:0.1; thc"]
        assert "Schemes that can: none, fp16, bf16, thc, signsgd" in e["topkc:0.1"]
        assert e["per"] == "install_reduce_scatter: per must be 'param' or 'group', got 'bucket'"
        assert "expected a module sharded by fully_shard (an FSDPModule), got Linear" in e["not fsdp"]
        assert "has a custom reduce-scatter already (_ScatterComm" in e["twice"], e["twice"]
        assert "is already bound to" in e["bound"] and "is already bound to" in e["bound to install"]
        assert "is sharded over 1 rank: FSDP reduce-scatters nothing there" in e["one rank"], e["one rank"]


@pytest.mark.parametrize("spec", SPECS4 + ["thc both"])
def test_four_ranks_values(four, spec):
    check_values(four, spec, replicas=2, size=2)


@pytest.mark.parametrize("spec", SPECS4 + ["thc both"])
def test_four_ranks_resume(four, spec):
    check_resume(four, spec)
