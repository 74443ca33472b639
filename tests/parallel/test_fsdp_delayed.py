"""Delayed gradient sync on FSDP2's all-reduce across replicas (``install(..., delay=1)``,
``torch_backend.fsdp_delayed``), on real Gloo processes.

The probe of tests/parallel/test_fsdp.py (the gradient of parameter ``p`` at step ``t`` on
rank ``r`` is a seeded tensor ``G_r,t[p]``; three FSDP modules: ``blk`` with two parameters,
``head`` with a padded matrix, the root with a vector below ``min_numel``).

Launches (each kills its process group at its timeout):
1. two ranks, a shard-only mesh of one rank per replica and ``replicate_group=`` (2 x 1);
2. four ranks, a 2 x 2 (replicate, shard) mesh;
   on both, for each spec: a blocking run and a delayed run drained mid-run; the delayed run
   applies at step t exactly (bit for bit) what the blocking run applies at step t - 1, zeros
   at step 0, the same on every rank; error feedback's balance (applied + the drained means +
   the replicas' mean residual = the sum of the mean gradients); exact resume from per-rank
   checkpoints (model, optimizer, compressor, held means) taken after ``drain()``; on 2 ranks
   also micro-batches with ``set_requires_all_reduce(False)``, a frozen parameter, a parameter
   unused in some steps (balance), a module not called in some steps, a loss scale changed
   between steps, and the refusals; on 4 ranks THC on a blocking ``install_reduce_scatter``
   under a delayed ``install``;
3. rank 1 raises at step 2 and leaves: rank 0 raises (its wait for that step fails) instead of
   hanging.
"""
import os

import numpy as np
import pytest

from tests.ddprun import run
from tests.parallel.delayed_failure import check_peer_raises, record
from tests.parallel.test_fsdp import SHAPES, _build, _key, _params, _residuals, _segments, _unshard, grads_of

STEPS = 6
DRAIN = 3  # drained (and checkpointed) after this many steps
SPECS = ["fp16", "thc", "topkc:0.1", "powersgd:2", "signsgd", "thc:error_feedback=false"]
GROUP_SPECS = ["topkc:0.1"]  # also per="group"


def _grads(model):
    return {n: (None if p.grad is None else p.grad.full_tensor().double().numpy().copy())
            for n, p in model.named_parameters()}


def _step(model, opt, rank, t, micro=1, uses=None):
    """One optimizer step of ``micro`` backward passes (FSDP's all-reduce on the last only);
    ``uses``: the parameters the forward uses (None: all). Returns the full gradients."""
    opt.zero_grad(set_to_none=True)
    for i in range(micro):
        if micro > 1:
            model.set_requires_all_reduce(i == micro - 1)
        grads = grads_of(rank, 100 * t + i)
        if uses is not None:  # (a forward that skips the others: _skipping)
            grads = {n: (g if n in uses else None) for n, g in grads.items()}
        model(grads).backward()
    out = _grads(model)
    opt.step()
    return out


def _np(d):
    return {k: v.double().numpy().copy() for k, v in d.items()}


def _case(mesh, spec, tmp, group=None, per="param", micro=1):
    """{"blocking", "delayed": [gradients per step], "last": drained shards, "residuals",
    "continued", "resumed": [gradients of steps DRAIN..STEPS], their parameters}."""
    import torch
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.fsdp import install
    from torch_backend.fsdp_delayed import delayed_state
    rank = dist.get_rank()
    model, opt = _build(mesh)
    install(model, Compression.from_spec(spec), replicate_group=group, per=per)
    rec = {"blocking": [_step(model, opt, rank, t, micro) for t in range(STEPS)]}
    model, opt = _build(mesh)
    comp = install(model, Compression.from_spec(spec), replicate_group=group, per=per, delay=1)
    outs = []
    for t in range(STEPS):
        outs.append(_step(model, opt, rank, t, micro))
        if t + 1 == DRAIN:  # drained mid-run: changes nothing
            delayed_state(model).drain()
    rec.update(delayed=outs, last=_np(delayed_state(model).drain()), residuals=_residuals(comp))
    # per-rank checkpoints after drain(): a new model resumes exactly
    model, opt = _build(mesh)
    comp = install(model, Compression.from_spec(spec), replicate_group=group, per=per, delay=1)
    for t in range(DRAIN):
        _step(model, opt, rank, t, micro)
    pending = delayed_state(model)
    pending.drain()
    path = os.path.join(tmp, f"{spec}-{per}-{micro}-rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "comp": comp.state_dict(),
                "pending": pending.state_dict()}, path)
    dist.barrier()
    rec["continued"] = [_step(model, opt, rank, t, micro) for t in range(DRAIN, STEPS)]
    model2, opt2 = _build(mesh)
    comp2 = install(model2, Compression.from_spec(spec), replicate_group=group, per=per, delay=1)
    ckpt = torch.load(path, weights_only=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    comp2.load_state_dict(ckpt["comp"])
    delayed_state(model2).load_state_dict(ckpt["pending"])
    rec["resumed"] = [_step(model2, opt2, rank, t, micro) for t in range(DRAIN, STEPS)]
    rec["params"] = (_params(model), _params(model2))
    return rec


def _skipping(self, grads):
    """A probe leaf's forward that skips its parameters whose gradient is None."""
    return sum((p * grads[self.prefix + n]).sum() for n, p in self.named_parameters()
               if grads[self.prefix + n] is not None)


def _frozen_and_unused(shard, group, rank):
    """``head.v`` frozen (its module never reduced); ``blk.b`` used at even steps only (``blk``
    reduced without it at odd steps): {"blocking", "delayed": gradients per step, "last",
    "residuals 0", "residuals 1"} (thc)."""
    import types
    from torch_backend import Compression
    from torch_backend.fsdp import install
    from torch_backend.fsdp_delayed import delayed_state
    out = {}
    for delay in (0, 1):
        model, opt = _build(shard)
        model.head.v.requires_grad_(False)
        model.blk.forward = types.MethodType(_skipping, model.blk)
        comp = install(model, Compression.thc(), replicate_group=group, delay=delay)
        steps = []
        for t in range(STEPS):
            uses = set(SHAPES) - ({"blk.b"} if t % 2 else set())
            steps.append(_step(model, opt, rank, t, uses=uses))
        out["delayed" if delay else "blocking"] = steps
        if delay:
            out["last"] = _np(delayed_state(model).drain())
        out[f"residuals {delay}"] = _residuals(comp)
    return out


def _skipping_root(self, grads):
    """The probe root's forward, ``head`` skipped (not called) where its gradient is None."""
    out = (self.s * grads["s"]).sum() + self.blk(grads)
    return out + self.head(grads) if grads["head.v"] is not None else out


def _skipped_module(shard, group, rank):
    """``head`` (an FSDP module) not called at odd steps, so its hook is not either:
    {"blocking", "delayed", "last", "residuals 0", "residuals 1"} (thc)."""
    import types
    from torch_backend import Compression
    from torch_backend.fsdp import install
    from torch_backend.fsdp_delayed import delayed_state
    out = {}
    for delay in (0, 1):
        model, opt = _build(shard)
        model.forward = types.MethodType(_skipping_root, model)
        comp = install(model, Compression.thc(), replicate_group=group, delay=delay)
        out["delayed" if delay else "blocking"] = [
            _step(model, opt, rank, t, uses=set(SHAPES) - ({"head.v"} if t % 2 else set())) for t in range(STEPS)]
        if delay:
            out["last"] = _np(delayed_state(model).drain())
        out[f"residuals {delay}"] = _residuals(comp)
    return out


SCALES = [1024.0, 256.0, 256.0, 4096.0, 512.0, 1024.0]  # the loss scale of each step (powers of 2)


def _scaled(shard, group, rank, spec):
    """Blocking and delayed runs under a loss scale (a 0-d tensor, changed in place between
    steps as GradScaler's): {kind: [each step's gradients divided by its scale]}."""
    import torch
    from torch_backend import Compression
    from torch_backend.fsdp import install
    rec = {}
    for kind, delay in (("blocking", 0), ("delayed", 1)):
        model, opt = _build(shard)
        scale = torch.tensor(SCALES[0])
        install(model, Compression.from_spec(spec).set_loss_scale(scale), replicate_group=group, delay=delay)
        outs = []
        for t, s in enumerate(SCALES):
            scale.fill_(s)
            opt.zero_grad(set_to_none=True)
            (model(grads_of(rank, 100 * t)) * s).backward()
            outs.append({n: g / s for n, g in _grads(model).items()})
        rec[kind] = outs
    return rec


def _refusals(shard, group, rank):
    import torch
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    from torch_backend.fsdp_delayed import delayed_state
    from tests.hvdrun import value_error
    errors = {}
    model, _ = _build(shard)
    for bad in (2, -1, True, 1.0):
        errors[f"delay={bad!r}"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=group,
                                                               delay=bad))
    errors["overlap"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=group,
                                                    overlap=True, delay=1))
    errors["reduce-scatter"] = value_error(lambda: install_reduce_scatter(model, Compression.thc(), delay=1))
    errors["no delayed hook"] = value_error(lambda: delayed_state(model))
    errors["disagree"] = value_error(lambda: install(model, Compression.fp16(), replicate_group=group,
                                                     delay=rank % 2))
    install(model, Compression.fp16(), replicate_group=group, delay=1)
    errors["wrong key"] = value_error(lambda: delayed_state(model).load_state_dict(
        {"delay": 1, "means": {"nope[shard 0/1]": torch.zeros(3)}}))
    # blk.b has a gradient on rank 0 only: refused on every rank at that step's decode (drain)
    import types
    model, opt = _build(shard)
    model.blk.forward = types.MethodType(_skipping, model.blk)
    install(model, Compression.thc(), replicate_group=group, delay=1)
    _step(model, opt, rank, 0, uses=None if rank == 0 else set(SHAPES) - {"blk.b"})
    errors["some ranks"] = value_error(lambda: delayed_state(model).drain())
    return errors


def two_worker(tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    mesh2d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    shard, group = mesh2d["shard"], mesh2d.get_group("replicate")
    out = {spec: _case(shard, spec, tmp, group) for spec in SPECS}
    for spec in GROUP_SPECS:
        out[f"{spec} per group"] = _case(shard, spec, tmp, group, per="group")
    out["thc micro"] = _case(shard, "thc", tmp, group, micro=2)
    out["frozen"] = _frozen_and_unused(shard, group, rank)
    out["skipped"] = _skipped_module(shard, group, rank)
    for spec in SCALED:
        out[f"scaled {spec}"] = _scaled(shard, group, rank, spec)
    out["errors"] = _refusals(shard, group, rank)
    return out


def four_worker(tmp):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {spec: _case(mesh, spec, tmp) for spec in ("fp16", "thc", "topkc:0.1", "powersgd:2")}
    out["topkc:0.1 per group"] = _case(mesh, "topkc:0.1", tmp, per="group")
    out["both"] = _both(mesh)
    return out


def _both(mesh):
    """THC on the reduce-scatter (blocking) and across the replicas, blocking and delayed:
    {"blocking", "delayed": gradients per step}."""
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    out = {}
    for delay in (0, 1):
        model, opt = _build(mesh)
        install_reduce_scatter(model, Compression.thc())
        install(model, Compression.thc(), delay=delay)
        out["delayed" if delay else "blocking"] = [_step(model, opt, dist.get_rank(), t) for t in range(STEPS)]
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(two_worker, np=2, args=(str(tmp_path_factory.mktemp("fsdpdelay2")),), timeout=500)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(four_worker, np=4, args=(str(tmp_path_factory.mktemp("fsdpdelay4")),), timeout=600)


SCALED = ["thc", "topkc:0.1"]
TWO = SPECS + [f"{s} per group" for s in GROUP_SPECS] + ["thc micro"]
FOUR = ["fp16", "thc", "topkc:0.1", "powersgd:2", "topkc:0.1 per group"]


def test_four_ranks_with_a_compressed_reduce_scatter(four):
    """install_reduce_scatter (blocking, THC) under install(delay=1) (THC): the blocking pair's
    gradients shifted by one step, bit for bit, the same on every rank."""
    check_shift(four, "both")


def check_shift(results, name):
    """Step t applies exactly the blocking run's step t - 1 (zeros at step 0), on every rank;
    the drained means are the blocking run's last step."""
    for r in results:
        rec = r[name]
        for n in SHAPES:
            np.testing.assert_array_equal(rec["delayed"][0][n], np.zeros(SHAPES[n]))
            for t in range(1, STEPS):
                np.testing.assert_array_equal(rec["delayed"][t][n], rec["blocking"][t - 1][n], err_msg=f"{n} step {t}")
        for a, b in zip(rec["delayed"], results[0][name]["delayed"]):  # replicas equal
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])
    spec = name.split(" ")[0]
    if spec in ("thc", "topkc:0.1", "powersgd:2"):  # compressed: not the plain mean
        world = len(results)
        truth = sum(grads_of(r, 0)["head.v"].double().numpy() for r in range(world)) / world
        assert np.abs(results[0][name]["delayed"][1]["head.v"] - truth).max() > 1e-3


def check_last_and_balance(results, name, replicas, size):
    """The drained means are the blocking run's last step (unsharded); with error feedback,
    applied + drained + the replicas' mean residual = the sum of the mean gradients over all
    ranks."""
    per = "group" if name.endswith(" per group") else "param"
    micro = 2 if name.endswith(" micro") else 1
    world = replicas * size
    for n in SHAPES:
        last = _unshard(n, [results[s][name]["last"][_key(n, s, size)] for s in range(size)], size)  # (per parameter)
        np.testing.assert_array_equal(last, results[0][name]["blocking"][STEPS - 1][n], err_msg=n)
        if "error_feedback=false" in name:
            continue
        truth = sum(grads_of(r, 100 * t + i)[n].double().numpy()
                    for r in range(world) for t in range(STEPS) for i in range(micro)) / world
        total = sum(o[n] for o in results[0][name]["delayed"]) + last
        pending = []
        for s in range(size):
            parts = [results[q * size + s][name]["residuals"].get(_key(n, s, size, per)) for q in range(replicas)]
            pending.append(None if parts[0] is None else sum(_segments(n, p, size, per) for p in parts) / replicas)
        if pending[0] is not None:
            total = total + _unshard(n, pending, size)
        bound = STEPS * micro * 2.0 ** -10 * np.abs(truth).max() + 1e-5
        assert np.abs(total - truth).max() <= bound, (name, n, np.abs(total - truth).max())


def check_resume(results, name):
    for r in results:
        rec = r[name]
        for t, got, want in zip(range(DRAIN, STEPS), rec["resumed"], rec["continued"]):
            for n in SHAPES:
                np.testing.assert_array_equal(got[n], want[n], err_msg=f"{n} step {t}")
        for n in SHAPES:
            np.testing.assert_array_equal(rec["params"][0][n], rec["params"][1][n], err_msg=n)
        assert any(np.abs(x[n]).max() > 0 for x in rec["continued"] for n in SHAPES)


@pytest.mark.parametrize("name", TWO)
def test_two_ranks_applies_the_previous_steps_mean(two, name):
    check_shift(two, name)


@pytest.mark.parametrize("name", [n for n in TWO if n != "fp16"])
def test_two_ranks_balance(two, name):
    check_last_and_balance(two, name, replicas=2, size=1)


@pytest.mark.parametrize("name", TWO)
def test_two_ranks_resume(two, name):
    check_resume(two, name)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_applies_the_previous_steps_mean(four, name):
    check_shift(four, name)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_balance(four, name):
    check_last_and_balance(four, name, replicas=2, size=2)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_resume(four, name):
    check_resume(four, name)


def test_frozen_and_unused(two):
    """A frozen parameter (``head.v``): never sent, .grad None in both runs, nothing held. A
    parameter unused at odd steps (``blk.b``): .grad None there in both runs; its mean of an
    even step is held through the odd one and applied at the next even step; the others shift
    by one step exactly; error feedback's balance of every trainable parameter holds with the
    held means."""
    for r in two:
        rec = r["frozen"]
        for t in range(STEPS):
            assert rec["blocking"][t]["head.v"] is None and rec["delayed"][t]["head.v"] is None
            assert (rec["blocking"][t]["blk.b"] is None) == (rec["delayed"][t]["blk.b"] is None) == bool(t % 2)
            for n in ("s", "blk.w"):
                want = np.zeros(SHAPES[n]) if t == 0 else rec["blocking"][t - 1][n]
                np.testing.assert_array_equal(rec["delayed"][t][n], want, err_msg=f"{n} step {t}")
            if t % 2 == 0:
                want = np.zeros(SHAPES["blk.b"]) if t == 0 else rec["blocking"][t - 2]["blk.b"]
                np.testing.assert_array_equal(rec["delayed"][t]["blk.b"], want, err_msg=f"blk.b step {t}")
        assert "head.v[shard 0/1]" not in rec["last"]
        assert r["frozen"]["residuals 1"].get("head.v[shard 0/1]") is None
    for n in ("s", "blk.w", "blk.b"):
        used = [t for t in range(STEPS) if n != "blk.b" or t % 2 == 0]
        truth = sum(grads_of(r, 100 * t)[n].double().numpy() for r in range(2) for t in used) / 2
        for delay in (0, 1):
            runs = two[0]["frozen"]["delayed" if delay else "blocking"]
            total = sum(o[n] for o in runs if o[n] is not None)
            if delay:
                total = total + two[0]["frozen"]["last"][_key(n, 0, 1)].reshape(SHAPES[n])
            parts = [r["frozen"][f"residuals {delay}"].get(_key(n, 0, 1)) for r in two]
            if parts[0] is not None:
                total = total + ((parts[0] + parts[1]) / 2).reshape(SHAPES[n])
            assert np.abs(total - truth).max() <= STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5, (n, delay)
    # blk.b's mean of step 4 waits through step 5 (unused) and is drained: it was held
    np.testing.assert_array_equal(two[0]["frozen"]["last"][_key("blk.b", 0, 1)].reshape(SHAPES["blk.b"]),
                                  two[0]["frozen"]["blocking"][4]["blk.b"])


def test_a_module_skipped_in_some_steps(two):
    """``head`` not called at odd steps (its hook neither): its .grad is None there in both
    runs, its mean of an even step stays in flight through the odd one and is applied at the
    next even step; the other modules shift by one step exactly; the balance holds."""
    for r in two:
        rec = r["skipped"]
        for t in range(STEPS):
            assert (rec["blocking"][t]["head.v"] is None) == (rec["delayed"][t]["head.v"] is None) == bool(t % 2)
            for n in ("s", "blk.w", "blk.b"):
                want = np.zeros(SHAPES[n]) if t == 0 else rec["blocking"][t - 1][n]
                np.testing.assert_array_equal(rec["delayed"][t][n], want, err_msg=f"{n} step {t}")
            if t % 2 == 0:
                want = np.zeros(SHAPES["head.v"]) if t == 0 else rec["blocking"][t - 2]["head.v"]
                np.testing.assert_array_equal(rec["delayed"][t]["head.v"], want, err_msg=f"head.v step {t}")
        np.testing.assert_array_equal(rec["last"][_key("head.v", 0, 1)].reshape(SHAPES["head.v"]),
                                      rec["blocking"][4]["head.v"])
    n = "head.v"
    truth = sum(grads_of(r, 100 * t)[n].double().numpy() for r in range(2) for t in range(0, STEPS, 2)) / 2
    rec = two[0]["skipped"]
    total = sum(o[n] for o in rec["delayed"] if o[n] is not None) + rec["last"][_key(n, 0, 1)].reshape(SHAPES[n])
    parts = [r["skipped"]["residuals 1"].get(_key(n, 0, 1)) for r in two]
    if parts[0] is not None:
        total = total + ((parts[0] + parts[1]) / 2).reshape(SHAPES[n])
    assert np.abs(total - truth).max() <= STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5


@pytest.mark.parametrize("spec", SCALED)
def test_loss_scale_changed_between_steps(two, spec):
    """Under a loss scale changed between steps, the delayed run's unscaled gradient at step
    t is exactly the blocking run's at step t - 1 (the held mean is re-scaled to the scale of
    the step that applies it)."""
    for r in two:
        rec = r[f"scaled {spec}"]
        for n in SHAPES:
            np.testing.assert_array_equal(rec["delayed"][0][n], np.zeros(SHAPES[n]))
            for t in range(1, len(SCALES)):
                np.testing.assert_array_equal(rec["delayed"][t][n], rec["blocking"][t - 1][n], err_msg=f"{n} step {t}")


def test_refusals(two):
    for r in two:
        e = r["errors"]
        for bad in (2, -1, True, 1.0):
            assert e[f"delay={bad!r}"].startswith("install: delay must be 0 (blocking) or 1"), bad
        assert "delay=1 and overlap=True together are not supported" in e["overlap"]
        assert "install_reduce_scatter: delay=1 is not supported" in e["reduce-scatter"]
        assert "has no FSDP all-reduce hook installed with delay=1" in e["no delayed hook"]
        assert "rank 0 installs delay=0, rank 1 delay=1; every rank must install the same delay" in e["disagree"]
        assert "'nope[shard 0/1]' (3 values) is not a shard of this rank's layout" in e["wrong key"]
        assert "parameter 'blk.b' has a gradient on some ranks only in this backward" in e["some ranks"]


def failing_worker(tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch_backend import Compression
    from torch_backend.fsdp import install
    from torch_backend.fsdp_delayed import delayed_state
    rank = dist.get_rank()
    where = "install"
    try:
        mesh2d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        model, opt = _build(mesh2d["shard"])
        install(model, Compression.thc(), replicate_group=mesh2d.get_group("replicate"), delay=1)
        for t in range(5):
            where = t
            if rank == 1 and t == 2:
                raise ValueError("rank 1 stops at step 2")
            _step(model, opt, rank, t)
        where = "drain"
        delayed_state(model).drain()
        where = "done"
    finally:
        record(tmp, rank, where)


def test_a_rank_that_raises_makes_its_peer_raise(tmp_path):
    """Rank 1 raises at step 2 and exits; rank 0, which posted step 2 without waiting, raises
    at its next wait for it (step 3's hooks) instead of hanging (the launch's timeout would
    raise TimeoutError)."""
    check_peer_raises(failing_worker, tmp_path)
