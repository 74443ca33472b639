"""The compressors on FSDP2's all-reduce across replicas (``torch_backend.fsdp``), on real Gloo
processes.

The workers shard a probe model whose loss is ``sum(p * G_r[p])``, so rank ``r``'s gradient of
parameter ``p`` at step ``t`` is ``G_r[p]``, a seeded normal tensor every process can rebuild.
Its FSDP modules: ``blk`` (``w`` 64x64 and ``b`` 64: a group of two), ``head`` (``v`` 33x64:
one matrix, 33 rows so the last shard is padded) and the root (``s``, 10 values: fp16 below
``min_numel``). Each scheme runs with ``per="param"`` (a key per parameter shard), TopKC and
PowerSGD also with ``per="group"`` (a key per module shard: ``blk``'s is a vector). Ranks
``q * S + s`` of an R x S mesh hold shard ``s`` of replica ``q``; FSDP reduce-scatters (and
averages) within a replica, the hook compresses across replicas.

Checks, against float64 recomputed here: every rank ends with the same full gradients and
parameters (SGD); fp16 and TopKC equal the reference (tests/reference.py, on each replica's
flat shard) to float16 rounding; for every scheme error feedback's balance (what the steps
delivered plus the replicas' mean pending residual, mapped back from the shards to the
parameters, is the sum of the mean gradients over all ranks); keys and routes per shard;
exact resume of model,
optimizer and compressor from per-rank checkpoints; identical keys and routes on every
replica; the uncompressed route (fp32) equal to native HSDP bit for bit.

Launches (each kills its process group at its timeout):
1. two ranks, a shard-only mesh of one rank per replica and the replicas' group given
   (``replicate_group=``): the six default schemes; routing rules by parameter name (and by
   module path, per group); ``set_gradient_divide_factor``; ``set_requires_all_reduce(False)`` accumulation;
   ``MixedPrecisionPolicy(reduce_dtype=float16)``; ``CPUOffloadPolicy``; the refusals;
2. four ranks, a 2 x 2 (replicate, shard) DeviceMesh: the six schemes, fp32 against native
   HSDP, resume.

``examples/fsdp_digits.py`` under ``torchrun``: tests/parallel/test_fsdp_example.py.
"""
import math
import os

import numpy as np
import pytest

from tests.ddprun import run
from tests.reference import RefFp16, RefTopKC

SHAPES = {"s": (10,), "blk.w": (64, 64), "blk.b": (64,), "head.v": (33, 64)}
GROUPS = {"": ["s"], "blk": ["blk.w", "blk.b"], "head": ["head.v"]}  # FSDP module -> its parameters
SPECS = ["fp16", "topkc:0.1", "thc", "powersgd:2", "signsgd", "auto"]
GROUP_SPECS = ["topkc:0.1", "powersgd:2"]  # also run with per="group"
OVERLAP_SPECS = ["thc:error_feedback=false", "topkc:0.1"]  # also run with overlap=True (2 x 2 mesh)
STEPS = 4
RESUME = 2
LR = 0.1


def grads_of(rank, step):
    """The seeded gradients of global ``rank`` at ``step``: {name: float32 tensor}."""
    import torch
    g = torch.Generator().manual_seed(10007 * step + 101 * rank + 13)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _probe_cls():
    import torch

    class Leaf(torch.nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.prefix = prefix
            for n, s in SHAPES.items():
                if n.startswith(prefix):
                    self.register_parameter(n[len(prefix):], torch.nn.Parameter(torch.zeros(s)))

        def forward(self, grads):
            return sum((p * grads[self.prefix + n]).sum() for n, p in self.named_parameters())

    class Probe(torch.nn.Module):
        """loss = sum_p sum(p * G[p]): the gradient of p is G[p]."""

        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.zeros(SHAPES["s"]))
            self.blk, self.head = Leaf("blk."), Leaf("head.")

        def forward(self, grads):
            return (self.s * grads["s"]).sum() + self.blk(grads) + self.head(grads)

    return Probe


def _build(mesh, **kw):
    """The probe, ``fully_shard``-ed module by module on ``mesh``, and its SGD."""
    import torch
    from torch.distributed.fsdp import fully_shard
    model = _probe_cls()()
    fully_shard(model.blk, mesh=mesh, **kw)
    fully_shard(model.head, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def _step(model, opt, grads, micro=1):
    """One optimizer step (``micro`` backward passes, FSDP's all-reduce on the last only when
    ``micro`` > 1); returns the full gradients {name: float64 array}."""
    opt.zero_grad(set_to_none=True)
    for i in range(micro):
        if micro > 1:
            model.set_requires_all_reduce(i == micro - 1)
        model(grads[i] if micro > 1 else grads).backward()
    out = {n: p.grad.full_tensor().double().numpy().copy() for n, p in model.named_parameters()}
    opt.step()
    return out


def _params(model):
    return {n: p.detach().full_tensor().double().numpy().copy() for n, p in model.named_parameters()}


def _residuals(comp):
    """{key: this rank's pending error feedback, float64, flat, or None} of every shard seen
    (``error_feedback``: the tensor's own state, or its slice of a codec group's)."""
    out = {}
    for key in comp.routes():
        r = comp.error_feedback(key)
        out[key] = None if r is None else r.double().numpy().reshape(-1).copy()
    return out


def _train(mesh, spec, tmp, replicate_group=None, resume=True, per="param"):
    """STEPS steps of ``spec`` (``per`` as install takes it); then, from per-rank checkpoints of model, optimizer and
    compressor, RESUME more steps of the continued and of a rebuilt run."""
    import torch
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.fsdp import install
    rank = dist.get_rank()
    model, opt = _build(mesh)
    comp = install(model, Compression.from_spec(spec), replicate_group=replicate_group, per=per)
    outs = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
    rec = {"outs": outs, "residuals": _residuals(comp), "routes": comp.routes(), "params": _params(model),
           "worlds": sorted({(i.world_size, i.rank) for i in comp.codec.tensors.infos.values()})}
    if resume:
        path = os.path.join(tmp, f"{spec}-{per}-rank{rank}.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "comp": comp.state_dict()}, path)
        dist.barrier()
        model2, opt2 = _build(mesh)
        comp2 = install(model2, Compression.from_spec(spec), replicate_group=replicate_group, per=per)
        ckpt = torch.load(path, weights_only=False)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["optim"])
        comp2.load_state_dict(ckpt["comp"])
        rec["resume"] = [(_step(model, opt, grads_of(rank, t)), _step(model2, opt2, grads_of(rank, t)))
                         for t in range(STEPS, STEPS + RESUME)]
        rec["resume_params"] = (_params(model), _params(model2))
        rec["owed"] = (_residuals(comp), _residuals(comp2))  # after the resumed steps
    return rec


def two_worker(tmp):
    """Launch 1 (module docstring): 2 ranks, a shard-only mesh of 1 + replicate_group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch_backend import Compression
    from torch_backend.fsdp import install
    from tests.hvdrun import value_error
    rank = dist.get_rank()
    mesh2d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    shard, group = mesh2d["shard"], mesh2d.get_group("replicate")
    out = {spec: _train(shard, spec, tmp, replicate_group=group) for spec in SPECS}
    for spec in GROUP_SPECS:
        out[f"{spec} per group"] = _train(shard, spec, tmp, replicate_group=group, per="group")
    # routing rules: by parameter name; per group: by module path where a group holds several
    for per, rules in (("param", "head.v -> topkc:0.1; *.w -> thc; fp16"),
                       ("group", "head.v -> topkc:0.1; blk -> thc; fp16")):
        model, opt = _build(shard)
        comp = install(model, Compression.from_spec(rules), replicate_group=group, per=per)
        _step(model, opt, grads_of(rank, 0))
        out[f"rules {per}"] = comp.routes()
    # set_gradient_divide_factor(1): the sum over all ranks, as native HSDP's
    model, opt = _build(shard)
    model.set_gradient_divide_factor(1.0)
    for m in (model.blk, model.head):
        m.set_gradient_divide_factor(1.0)
    install(model, Compression.none(), replicate_group=group)
    out["factor"] = _step(model, opt, grads_of(rank, 0))
    # set_requires_all_reduce(False) for the first of two micro-batches, fp32 and topkc
    for spec in ("none", "topkc:0.1"):
        model, opt = _build(shard)
        comp = install(model, Compression.from_spec(spec), replicate_group=group)
        out[f"accumulate {spec}"] = (_step(model, opt, [grads_of(rank, 0), grads_of(rank, 1)], micro=2),
                                     _residuals(comp))
    # float16 reduction; CPU offload
    model, opt = _build(shard, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))
    comp = install(model, Compression.thc(), replicate_group=group)
    out["reduce fp16"] = ([_step(model, opt, grads_of(rank, t)) for t in range(STEPS)], _residuals(comp),
                          {k: i.dtype for k, i in comp.codec.tensors.infos.items() if k in comp.routes()})
    model, opt = _build(shard, offload_policy=CPUOffloadPolicy(pin_memory=False))
    install(model, Compression.topkc(0.1), replicate_group=group)
    out["offload"] = [_step(model, opt, grads_of(rank, t)) for t in range(2)]
    # refusals, on every rank
    errors = {}
    model, _ = _build(shard)
    errors["no group"] = value_error(lambda: install(model, Compression.fp16()))
    errors["per"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=group, per="bucket"))
    try:
        install(model, Compression.topkc, replicate_group=group)
    except TypeError as e:
        errors["factory"] = str(e)
    try:
        install(torch.nn.Linear(2, 2), Compression.fp16(), replicate_group=group)
    except TypeError as e:
        errors["not fsdp"] = str(e)
    errors["blocking"] = value_error(lambda: install(
        model, Compression.from_spec("topkc:ratio=0.1,selection=current"), replicate_group=group))
    comp = install(model, Compression.fp16(), replicate_group=group)
    errors["twice"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=group))
    errors["bound"] = value_error(lambda: install(_build(shard)[0], comp, replicate_group=group))
    model, opt = _build(shard)
    install(model, Compression.fp16(), replicate_group=group, overlap=True)
    model.blk.w.register_post_accumulate_grad_hook(lambda p: None)
    errors["overlap hook"] = value_error(lambda: _step(model, opt, grads_of(rank, 0)))
    model, _ = _build(mesh2d)
    errors["other group"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=mesh2d.get_group("shard")))
    out["errors"] = errors
    return out


def four_worker(tmp):
    """Launch 2 (module docstring): 4 ranks, a 2 x 2 (replicate, shard) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {spec: _train(mesh, spec, tmp) for spec in SPECS}
    for spec in GROUP_SPECS:
        out[f"{spec} per group"] = _train(mesh, spec, tmp, per="group")
    out["none"] = _train(mesh, "none", tmp, resume=False)
    model, opt = _build(mesh)  # native HSDP, no hook
    out["native"] = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
    out.update(_overlap_runs(mesh, rank))
    return out


def _overlap_runs(mesh, rank):
    """{name: [blocking run, overlap=True run]}, each (gradients of every step, parameters):
    STEPS steps, one of two micro-batches (the all-reduce on the last), one of two backwards
    accumulated into .grad; float32 and float16 reduction."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch_backend import Compression
    from torch_backend.fsdp import install
    out = {}
    for spec in OVERLAP_SPECS:
        for reduce_dtype in (None, torch.float16):
            runs = []
            for overlap in (False, True):
                kw = {} if reduce_dtype is None else {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}
                model, opt = _build(mesh, **kw)
                install(model, Compression.from_spec(spec), overlap=overlap)
                steps = [_step(model, opt, grads_of(rank, t)) for t in range(STEPS)]
                steps.append(_step(model, opt, [grads_of(rank, 0), grads_of(rank, 1)], micro=2))
                opt.zero_grad(set_to_none=True)
                for t in (2, 3):
                    model(grads_of(rank, t)).backward()
                steps.append({n: p.grad.full_tensor().double().numpy().copy() for n, p in model.named_parameters()})
                late = model._get_fsdp_state()._fsdp_param_groups[0]._all_reduce_hook.late
                runs.append((steps, _params(model), None if late is None else late.finished))
            out[f"overlap {spec} {reduce_dtype}"] = runs
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(two_worker, np=2, args=(str(tmp_path_factory.mktemp("fsdp2")),), timeout=500)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(four_worker, np=4, args=(str(tmp_path_factory.mktemp("fsdp4")),), timeout=600)


def _truth(world, steps):
    """{name: [mean over all ranks of the gradient, per step]} (float64)."""
    return {n: [sum(grads_of(r, t)[n].double().numpy() for r in range(world)) / world for t in steps]
            for n in SHAPES}


def _shard_input(name, replica, shard, size, step):
    """What the hook of replica ``replica``, shard ``shard`` of ``size`` receives for the
    parameter ``name``: the replica's ranks' mean gradient, padded on dim 0 to a multiple of
    ``size``, rows of the shard, flat (float64)."""
    d0 = SHAPES[name][0]
    rows = -(-d0 // size)
    mean = sum(grads_of(replica * size + s, step)[name].double().numpy() for s in range(size)) / size
    padded = np.zeros((rows * size,) + SHAPES[name][1:])
    padded[:d0] = mean
    return padded[shard * rows:(shard + 1) * rows].reshape(-1)


def _unshard(name, parts, size):
    """The parameter ``name``'s full array from its shards' flat segments ``parts[s]``."""
    d0, rest = SHAPES[name][0], math.prod(SHAPES[name][1:])
    rows = -(-d0 // size)
    full = np.concatenate([p.reshape(rows, rest) for p in parts])[:d0]
    return full.reshape(SHAPES[name])


def _segments(name, flat, size, per="param"):
    """The segment of parameter ``name`` in the flat tensor of its key: per parameter the
    whole; per group its part of the module's flat shard."""
    if per == "param":
        return flat
    module = name.rpartition(".")[0]
    offset = 0
    for other in GROUPS[module]:
        numel = -(-SHAPES[other][0] // size) * math.prod(SHAPES[other][1:])
        if other == name:
            return flat[offset:offset + numel]
        offset += numel
    raise KeyError(name)


def _key(name, shard, size, per="param"):
    """The compressor's key of parameter ``name``'s shard (per="group": its module's)."""
    owner = name if per == "param" else (name.rpartition(".")[0] or "<root>")
    return f"{owner}[shard {shard}/{size}]"


def check_values(results, spec, replicas, size):
    world = replicas * size
    per = "group" if spec.endswith(" per group") else "param"
    recs = [r[spec] for r in results]
    spec = spec.removesuffix(" per group")
    for rec in recs[1:]:  # every rank: the same full gradients and parameters
        for a, b in zip(recs[0]["outs"], rec["outs"]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        for n in SHAPES:
            np.testing.assert_array_equal(recs[0]["params"][n], rec["params"][n], err_msg=n)
    for rank, rec in enumerate(recs):  # bound to the replicas' group, keys per shard
        assert rec["worlds"] == [(replicas, rank // size)], rec["worlds"]
        assert set(rec["routes"]) == {_key(n, rank % size, size, per) for n in SHAPES}
        assert rec["routes"] == recs[rank % size]["routes"]  # replicas agree
    truth = _truth(world, range(STEPS))
    np.testing.assert_allclose(recs[0]["params"]["blk.w"], -LR * sum(recs[0]["outs"][t]["blk.w"] for t in range(STEPS)),
                               rtol=1e-5, atol=1e-6)
    if spec in ("fp16", "topkc:0.1"):  # the reference on each replica's shard of each key
        tensors = [[n] for n in SHAPES] if per == "param" else list(GROUPS.values())
        for names in tensors:
            for shard in range(size):
                numel = sum(_shard_input(n, 0, shard, size, 0).size for n in names)
                ref = RefFp16(replicas) if spec == "fp16" or numel < 1024 else RefTopKC(numel, replicas, 0.1, 256)
                for t in range(STEPS):
                    inputs = [np.concatenate([_shard_input(n, q, shard, size, t) for n in names])
                              for q in range(replicas)]
                    want = ref.step(inputs, "sum") / replicas
                    for n in names:
                        rows = -(-SHAPES[n][0] // size)
                        full = recs[0]["outs"][t][n].reshape(SHAPES[n][0], -1)
                        padded = np.zeros((rows * size, full.shape[1]))
                        padded[:SHAPES[n][0]] = full
                        mine = padded[shard * rows:(shard + 1) * rows].reshape(-1)
                        np.testing.assert_allclose(mine, _segments(n, want, size, per), rtol=2e-3, atol=1e-6,
                                                   err_msg=f"{spec} {n} shard {shard} step {t}")
    # error feedback's balance, float64: delivered + the replicas' mean pending residual = the
    # sum over steps of the mean gradient over all ranks
    for n in SHAPES:
        want = sum(truth[n])
        delivered = sum(o[n] for o in recs[0]["outs"])
        pending = []
        for shard in range(size):
            parts = [recs[q * size + shard]["residuals"].get(_key(n, shard, size, per)) for q in range(replicas)]
            pending.append(None if parts[0] is None else sum(_segments(n, p, size, per) for p in parts) / replicas)
        if pending[0] is not None:
            delivered = delivered + _unshard(n, pending, size)
        bound = STEPS * 2.0 ** -10 * np.abs(want).max() + 1e-5
        assert np.abs(delivered - want).max() <= bound, (spec, n, np.abs(delivered - want).max())
    if spec not in ("fp16", "auto"):  # compressed (head.v's shard is a matrix: every scheme takes it)
        assert not recs[0]["routes"][_key("head.v", 0, size, per)].startswith("fp16")
        assert np.abs(recs[0]["outs"][0]["head.v"] - truth["head.v"][0]).max() > 1e-2
    if spec == "powersgd:2":  # per parameter the 64x64 matrix too; per group its module is a vector
        assert recs[0]["routes"][_key("blk.w", 0, size, per)] == ("fp16" if per == "group" else "powersgd:rank=2")


def check_resume(results, spec, replicas, size):
    """Exact resume; for ``auto``, whose first step after a load is a float32 sync step (every
    rank flushes what it owes), the resumed run has delivered plus still owes exactly what the
    continued run has (up to fp16 rounding)."""
    if spec == "auto":
        for n in SHAPES:
            totals = []
            for run in (0, 1):
                total = replicas * sum(step[run][n] for step in results[0][spec]["resume"])
                for q in range(replicas):
                    parts = [results[q * size + s][spec]["owed"][run].get(_key(n, s, size)) for s in range(size)]
                    if parts[0] is not None:
                        total = total + _unshard(n, [_segments(n, p, size) for p in parts], size)
                totals.append(total)
            bound = 2.0 ** -10 * RESUME * np.abs(totals[0]).max()
            np.testing.assert_allclose(totals[1], totals[0], rtol=0, atol=bound, err_msg=n)
        return
    for rec in (r[spec] for r in results):
        for before, after in rec["resume"]:
            for n in SHAPES:
                np.testing.assert_array_equal(before[n], after[n], err_msg=f"{spec} {n}")
        for n in SHAPES:
            np.testing.assert_array_equal(rec["resume_params"][0][n], rec["resume_params"][1][n])


ALL = SPECS + [f"{s} per group" for s in GROUP_SPECS]


@pytest.mark.parametrize("spec", ALL)
def test_two_ranks_values(two, spec):
    check_values(two, spec, replicas=2, size=1)


@pytest.mark.parametrize("spec", ALL)
def test_two_ranks_resume(two, spec):
    check_resume(two, spec, replicas=2, size=1)


@pytest.mark.parametrize("spec", ALL)
def test_four_ranks_values(four, spec):
    check_values(four, spec, replicas=2, size=2)


@pytest.mark.parametrize("spec", ALL)
def test_four_ranks_resume(four, spec):
    check_resume(four, spec, replicas=2, size=2)


@pytest.mark.parametrize("spec", OVERLAP_SPECS)
@pytest.mark.parametrize("reduce_dtype", ["None", "torch.float16"])
def test_overlap_equals_blocking(four, spec, reduce_dtype):
    """install(overlap=True): every step's gradients (plain steps, micro-batches with the
    all-reduce on the last, two backwards accumulated) and the parameters equal the blocking
    hook's bit for bit, on every rank of the 2 x 2 mesh."""
    for r in four:
        (steps, params, _), (steps_late, params_late, finished) = r[f"overlap {spec} {reduce_dtype}"]
        assert len(steps) == len(steps_late) == STEPS + 2
        # finished late: 3 groups x (STEPS + 1 + 2) backwards with the all-reduce on
        assert finished == 3 * (STEPS + 3), finished
        for a, b in zip(steps, steps_late):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        for n in SHAPES:  # gradients were delivered (THC's first step sends none: no ranges yet)
            assert all(np.abs(a[n]).max() > 0 for a in steps[1:]), n
        for n in SHAPES:
            np.testing.assert_array_equal(params[n], params_late[n], err_msg=n)


def test_uncompressed_is_native_hsdp(four):
    for r in four:
        for ours, native in zip(r["none"]["outs"], r["native"]):
            for n in SHAPES:
                np.testing.assert_array_equal(ours[n], native[n], err_msg=n)


def test_rules(two):
    for r in two:
        assert r["rules param"] == {"s[shard 0/1]": "fp16", "blk.w[shard 0/1]": "thc", "blk.b[shard 0/1]": "fp16",
                                    "head.v[shard 0/1]": "topkc:ratio=0.1"}, r["rules param"]
        assert r["rules group"] == {"<root>[shard 0/1]": "fp16", "blk[shard 0/1]": "thc",
                                    "head[shard 0/1]": "topkc:ratio=0.1"}, r["rules group"]


def test_divide_factor(two):
    """With FSDP's own factor (1: a sum) the hook sums: the total is the sum over all ranks."""
    want = {n: sum(grads_of(r, 0)[n].double().numpy() for r in range(2)) for n in SHAPES}
    for r in two:
        for n in SHAPES:
            np.testing.assert_allclose(r["factor"][n], want[n], rtol=1e-6, atol=1e-6)


def test_accumulation(two):
    """set_requires_all_reduce(False) on the first micro-batch: the step's gradient is the mean
    of both micro-batches' (none exactly; topkc: delivered + pending residual)."""
    want = {n: sum(grads_of(r, t)[n].double().numpy() for r in range(2) for t in (0, 1)) / 2 for n in SHAPES}
    for r in two:
        out, _ = r["accumulate none"]
        for n in SHAPES:
            np.testing.assert_allclose(out[n], want[n], rtol=1e-6, atol=1e-6)
    for n in SHAPES:
        out = two[0]["accumulate topkc:0.1"][0][n]
        parts = [r["accumulate topkc:0.1"][1].get(_key(n, 0, 1)) for r in two]
        if parts[0] is not None:
            out = out + _segments(n, (parts[0] + parts[1]) / 2, 1).reshape(SHAPES[n])
        assert np.abs(out - want[n]).max() <= 2.0 ** -9 * np.abs(want[n]).max() + 1e-5, n


def test_reduce_fp16(two):
    """MixedPrecisionPolicy(reduce_dtype=float16): the shards are float16 when compressed,
    the ranks agree, and error feedback balances to float16 rounding."""
    outs, _, dtypes = two[0]["reduce fp16"]
    assert set(dtypes.values()) == {"float16"}
    for a, b in zip(outs, two[1]["reduce fp16"][0]):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])
    truth = _truth(2, range(STEPS))
    for n in SHAPES:
        delivered = sum(o[n] for o in outs)
        parts = [r["reduce fp16"][1].get(_key(n, 0, 1)) for r in two]
        if parts[0] is not None:
            delivered = delivered + _segments(n, (parts[0] + parts[1]) / 2, 1).reshape(SHAPES[n])
        want = sum(truth[n])
        assert np.abs(delivered - want).max() <= 4 * STEPS * 2.0 ** -10 * np.abs(want).max() + 1e-4, n


def test_offload(two):
    """CPUOffloadPolicy: the same gradients as the two-rank topkc run without it."""
    for r in two:
        for a, b in zip(r["offload"], r["topkc:0.1"]["outs"]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])


def test_refusals(two):
    for r in two:
        e = r["errors"]
        assert "shard-only mesh of 1 ranks; pass replicate_group=" in e["no group"]
        assert e["per"] == "install: per must be 'param' or 'group', got 'bucket'"
        assert "pass Compression.topkc() (with options, if any)" in e["factory"]
        assert "expected a module sharded by fully_shard (an FSDPModule), got Linear" in e["not fsdp"]
        assert "blocking two-round variants" in e["blocking"]
        assert "has an all-reduce hook already" in e["twice"]
        assert "is already bound to" in e["bound"]
        assert "by its 2-D mesh; pass replicate_group=None" in e["other group"]
        assert "has a post-accumulate-grad hook" in e["overlap hook"]
