"""Delayed gradient sync on DDP (``register_comm_hook(..., delay=1)``,
``torch_backend.ddp_delayed``), on real Gloo processes (2 ranks).

The probe model of tests/parallel/test_ddp.py (the gradient of parameter ``p`` at step ``t``
on rank ``r`` is a seeded tensor ``G_r,t[p]``), with a forward that uses the parameters in
another order than they are registered, and ``bucket_cap_mb=0.01``: DDP starts with one
bucket and rebuilds it into two after the first step, so the held means must follow their
parameters across layouts.

Launches (each kills its process group at its timeout):
1. every case (fp16, thc, topkc, powersgd, signsgd, auto, routing rules,
   ``gradient_as_bucket_view``, a float16 model, a cast whose payload is the bucket itself,
   ``no_sync`` accumulation): a blocking run and a delayed run drained mid-run; the delayed
   run applies at step t exactly (bit for bit) what the blocking run applies at step t - 1,
   zeros at step 0, on every rank alike; error feedback's balance; exact resume from a rank-0
   checkpoint taken after ``drain()``; ``Join`` with uneven inputs (rank 1 joins two steps
   early: the same shift, its error feedback kept, THC's ``subtract_own`` included); a loss
   scale changed between steps; unused parameters (``find_unused_parameters``,
   ``static_graph``: what DDP drops is applied later, the balance holds); the refusals.
2. rank 1 raises at step 2 and leaves: rank 0 raises (the wait for that step fails) instead of
   hanging.
"""
import os

import numpy as np
import pytest

from tests.ddprun import run
from tests.parallel.delayed_failure import check_peer_raises, record
from tests.parallel.ddp_probe import SHAPES, grads_of, probe_cls as _probe_cls, residuals as _residuals

STEPS = 6
DRAIN = 3  # drained (and checkpointed) after this many steps
ROUTED = "v -> topkc:0.1; thc"  # w -> thc, v -> topkc, b -> fp16 (below min_numel)
CASES = {  # name: (spec, DDP options and per_tensor, float16 model)
    "fp16": ("fp16", {}, False),
    "thc": ("thc", {}, False),
    "topkc": ("topkc:0.1", {}, False),
    "powersgd": ("powersgd:2", {}, False),
    "signsgd": ("signsgd", {}, False),
    # adaptive (the scheme a tensor takes moves with the agreed figures); a link this slow
    # makes its choice independent of the measured codec times (as tests/core/test_half.py)
    "auto": ("auto:candidates=fp16|topkc:0.1,bandwidth_gbit=0.0001,latency_ms=0.1,warmup=3,every=4", {}, False),
    "routed": (ROUTED, {}, False),
    "thc bucket-view": ("thc", {"gradient_as_bucket_view": True}, False),
    "topkc per-tensor": ("topkc:0.1", {"per_tensor": True}, False),
    "fp16 half": ("fp16", {}, True),
    "float32 cast": ("none:dtype=float32", {}, False),  # the payload of this cast is the bucket itself
    "none half": ("none", {}, True),
}
ACCUMULATE = 2  # micro-batches per synchronised step in the no_sync case
ORDER = ("b", "w", "v")  # the forward's order: the ready order differs from DDP's first guess


def _probe(half=False):
    Probe = _probe_cls()

    class Reordered(Probe):
        def forward(self, grads):
            ps = dict(self.named_parameters())
            return sum((ps[n] * grads[n].to(ps[n].dtype)).sum() for n in ORDER if grads[n] is not None)

    m = Reordered()
    return m.half() if half else m


def _ddp(half=False, cap=0.01, **options):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(_probe(half), bucket_cap_mb=cap, **options)


def _grads(ddp):
    return {n: p.grad.detach().double().numpy().copy() for n, p in ddp.module.named_parameters()}


def _step(ddp, rank, t, accumulate=1):
    for p in ddp.parameters():
        p.grad = None
    for k in range(accumulate - 1):
        with ddp.no_sync():
            ddp(grads_of(rank, 100 * t + k)).backward()
    ddp(grads_of(rank, 100 * t + accumulate - 1)).backward()
    return _grads(ddp)


def _run_case(spec, options, half, rank, tmp, name, accumulate=1):
    import torch
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.ddp import make_comm_hook, register_comm_hook
    from torch_backend.ddp_delayed import delayed_state
    options = dict(options)
    per = options.pop("per_tensor", False)  # the hook's option; the rest are DDP's
    blocking = _ddp(half, **options)
    register_comm_hook(blocking, Compression.from_spec(spec), per_tensor=per)
    rec = {"blocking": [_step(blocking, rank, t, accumulate) for t in range(STEPS)]}
    # delayed, through make_comm_hook (the bench's form), the buckets' layouts recorded
    delayed = _ddp(half, **options)
    comp = Compression.from_spec(spec)
    state, fn = make_comm_hook(delayed, comp, per_tensor=per, delay=1)
    layouts = []

    def recorded(state, bucket):
        layouts[-1].append([state.state.names[p] for p in bucket.parameters()])
        return fn(state, bucket)
    delayed.register_comm_hook(state, recorded)
    outs = []
    for t in range(STEPS):
        layouts.append([])
        outs.append(_step(delayed, rank, t, accumulate))
        if t + 1 == DRAIN:  # drained mid-run: changes nothing
            delayed_state(delayed).drain()
    last = delayed_state(delayed).drain()
    rec.update(delayed=outs, layouts=layouts, residuals=_residuals(comp),
               last={k: v.double().numpy().copy() for k, v in last.items()})
    # a checkpoint after drain(), saved on rank 0, resumes a new model exactly. (DDP's default
    # bucket size here: one bucket before and after its rebuild, so the resumed model's first
    # step groups the tensors as the continued model does; across layouts only each tensor's
    # error feedback carries over, as with the blocking hook, docs/ddp.md.)
    continued = _ddp(half, cap=None, **options)
    comp = register_comm_hook(continued, Compression.from_spec(spec), per_tensor=per, delay=1)
    path = os.path.join(tmp, f"{name}.pt")
    for t in range(DRAIN):
        _step(continued, rank, t, accumulate)
    pending = delayed_state(continued)
    pending.drain()
    saved = {"comp": comp.state_dict(gather=True), "pending": pending.state_dict()}
    if rank == 0:
        torch.save(saved, path)
    dist.barrier()
    rec["continued"] = [_step(continued, rank, t, accumulate) for t in range(DRAIN, STEPS)]
    resumed = _ddp(half, cap=None, **options)
    comp2 = register_comm_hook(resumed, Compression.from_spec(spec), per_tensor=per, delay=1)
    saved = torch.load(path, weights_only=True)
    comp2.load_state_dict(saved["comp"])
    delayed_state(resumed).load_state_dict(saved["pending"])
    rec["resumed"] = [_step(resumed, rank, t, accumulate) for t in range(DRAIN, STEPS)]
    return rec


JOIN_SPECS = ["fp16", "thc", "thc:subtract_own=true", "thc:error_feedback=false,subtract_own=true"]
EARLY = 2  # rank 1 joins this many steps before rank 0 ends its inputs
AFTER = 2  # steps on both ranks after Join


def _join_case(spec, rank):
    """Rank 0 runs STEPS steps under ``Join``, rank 1 STEPS - EARLY, then both AFTER more:
    {"blocking", "delayed": [each backward's gradients on this rank]}, the drained means."""
    from torch.distributed.algorithms.join import Join
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from torch_backend.ddp_delayed import delayed_state
    rec = {}
    for kind, delay in (("blocking", 0), ("delayed", 1)):
        ddp = _ddp()
        register_comm_hook(ddp, Compression.from_spec(spec), delay=delay)
        mine = range(STEPS if rank == 0 else STEPS - EARLY)
        with Join([ddp]):
            outs = [_step(ddp, rank, t) for t in mine]
        outs += [_step(ddp, rank, t) for t in range(STEPS, STEPS + AFTER)]
        rec[kind] = outs
        if delay:
            rec["last"] = {k: v.double().numpy().copy() for k, v in delayed_state(ddp).drain().items()}
    return rec


SCALED_SPECS = ["none", "thc"]
SCALES = [1024.0, 256.0, 256.0, 4096.0, 512.0, 1024.0]  # the loss scale of each step (powers of 2)


def _scaled_case(spec, rank):
    """Blocking and delayed runs under a loss scale (a 0-d tensor, changed in place between
    steps as GradScaler's): {kind: [each step's gradients divided by its scale]}."""
    import torch
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    rec = {}
    for kind, delay in (("blocking", 0), ("delayed", 1)):
        ddp = _ddp()
        scale = torch.tensor(SCALES[0])
        register_comm_hook(ddp, Compression.from_spec(spec).set_loss_scale(scale), delay=delay)
        outs = []
        for t, s in enumerate(SCALES):
            scale.fill_(s)
            for p in ddp.parameters():
                p.grad = None
            (ddp(grads_of(rank, 100 * t)) * s).backward()
            outs.append({n: g / s for n, g in _grads(ddp).items()})
        rec[kind] = outs
    return rec


USES = {  # the parameters each rank's forward uses at step t (None: all)
    "sometimes": lambda rank, t: {"w", "b"} if t in (1, 3) else ({"w", "v"} if (rank, t) == (0, 2) else None),
    "never v": lambda rank, t: {"w", "b"},
}
UNUSED = {  # name: (spec, DDP options, uses)
    "unused thc": ("thc", {"find_unused_parameters": True}, "sometimes"),
    "unused fp16": ("fp16", {"find_unused_parameters": True}, "sometimes"),
    "unused topkc bucket-view": ("topkc:0.1", {"find_unused_parameters": True, "gradient_as_bucket_view": True},
                                 "sometimes"),
    "static thc": ("thc", {"static_graph": True}, "never v"),
}


def _unused_case(spec, options, uses, rank):
    """Delayed steps where some parameters go unused (:data:`USES`): {"delayed": [each step's
    gradients, zeros where DDP left .grad None], "last", "residuals", "truth": the ranks'
    mean gradients summed over the steps (a parameter contributes zero where unused)}."""
    import torch
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from torch_backend.ddp_delayed import delayed_state
    ddp = _ddp(**options)
    comp = register_comm_hook(ddp, Compression.from_spec(spec), delay=1)
    used = USES[uses]
    outs, truth = [], {n: np.zeros(s) for n, s in SHAPES.items()}
    for t in range(STEPS):
        for p in ddp.parameters():
            p.grad = None
        for r in (0, 1):
            for n, g in grads_of(r, 100 * t).items():
                if used(r, t) is None or n in used(r, t):
                    truth[n] += g.double().numpy() / 2
        grads = grads_of(rank, 100 * t)
        names = used(rank, t)
        if names is not None:  # the unused ones out of the forward
            grads = {n: (g if n in names else None) for n, g in grads.items()}
        ddp(grads).backward()
        outs.append({n: (np.zeros(p.shape) if p.grad is None else p.grad.detach().double().numpy().copy())
                     for n, p in ddp.module.named_parameters()})
    last = delayed_state(ddp).drain()
    return {"delayed": outs, "last": {k: v.double().numpy().copy() for k, v in last.items()},
            "residuals": _residuals(comp), "truth": truth}


def values_worker(tmp):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from torch_backend.ddp_delayed import delayed_state
    from tests.hvdrun import value_error
    rank = dist.get_rank()
    out = {name: _run_case(spec, options, half, rank, tmp, name) for name, (spec, options, half) in CASES.items()}
    out["thc no_sync"] = _run_case("thc", {}, False, rank, tmp, "no_sync", accumulate=ACCUMULATE)
    errors = {}
    for bad in (2, -1, True, 1.0, "1"):
        errors[f"delay={bad!r}"] = value_error(lambda: register_comm_hook(_ddp(), Compression.thc(), delay=bad))
    sparse = DDP(torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True)))
    errors["sparse"] = value_error(lambda: register_comm_hook(sparse, Compression.thc(), delay=1))
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        compiled = DDP(_probe())
    errors["compiled"] = value_error(lambda: register_comm_hook(compiled, Compression.thc(), delay=1))
    errors["disagree"] = value_error(lambda: register_comm_hook(_ddp(), Compression.thc(), delay=rank))
    errors["no delayed hook"] = value_error(lambda: delayed_state(_ddp()))
    ddp = _ddp()
    register_comm_hook(ddp, Compression.thc(), delay=1)
    errors["wrong name"] = value_error(lambda: delayed_state(ddp).load_state_dict(
        {"delay": 1, "means": {"nope": torch.zeros(3)}}))
    for spec in JOIN_SPECS:
        out[f"join {spec}"] = _join_case(spec, rank)
    for spec in SCALED_SPECS:
        out[f"scaled {spec}"] = _scaled_case(spec, rank)
    for name, (spec, options, uses) in UNUSED.items():
        out[name] = _unused_case(spec, options, uses, rank)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def values(tmp_path_factory):
    return run(values_worker, np=2, args=(str(tmp_path_factory.mktemp("delayed")),), timeout=600)


NAMES = list(CASES) + ["thc no_sync"]


@pytest.mark.parametrize("name", NAMES)
def test_applies_the_previous_steps_mean(values, name):
    """Step t applies exactly the blocking run's step t - 1 (zeros at step 0), on every rank."""
    for r in values:
        rec = r[name]
        for n in SHAPES:
            np.testing.assert_array_equal(rec["delayed"][0][n], np.zeros(SHAPES[n]))
            for t in range(1, STEPS):
                np.testing.assert_array_equal(rec["delayed"][t][n], rec["blocking"][t - 1][n], err_msg=f"{n} step {t}")
            np.testing.assert_array_equal(rec["last"][n], rec["blocking"][STEPS - 1][n])  # the drained mean
        for a, b in zip(rec["delayed"], values[0][name]["delayed"]):  # replicas equal
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])
    if name in ("thc", "topkc", "powersgd"):  # compressed: not the plain mean
        truth = (grads_of(0, 0)["w"] + grads_of(1, 0)["w"]).double().numpy() / 2
        assert np.abs(values[0][name]["delayed"][1]["w"] - truth).max() > 1e-3


@pytest.mark.parametrize("name", ["fp16", "thc", "routed"])
def test_bucket_rebuild_is_exercised(values, name):
    """DDP's first step has one bucket, the later steps the two it rebuilt (another layout)."""
    layouts = values[0][name]["layouts"]
    assert len(layouts[0]) == 1 and sorted(layouts[0][0]) == sorted(SHAPES)
    assert all(len(step) == 2 for step in layouts[1:]), layouts
    assert layouts[1] == layouts[-1] != layouts[0]


@pytest.mark.parametrize("name", ["thc", "topkc", "powersgd", "signsgd", "auto", "routed", "thc bucket-view"])
def test_error_feedback_balance(values, name):
    """What the steps applied, plus the drained mean of the last step, plus the ranks' mean
    pending residual, is the sum of the ranks' mean gradients (fp16 rounding aside)."""
    r0, r1 = values[0][name], values[1][name]
    for n, shape in SHAPES.items():
        truth = sum((grads_of(0, 100 * t)[n] + grads_of(1, 100 * t)[n]).double().numpy() / 2 for t in range(STEPS))
        total = sum(o[n] for o in r0["delayed"]) + r0["last"][n]
        pending = [r["residuals"].get(n) for r in (r0, r1)]
        if pending[0] is not None:
            total = total + (pending[0] + pending[1]).reshape(shape) / 2
        bound = STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5
        assert np.abs(total - truth).max() <= bound, (name, n)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "auto"])
def test_resume_after_drain_is_exact(values, name):
    """A checkpoint taken after ``drain()`` (the compressor's state and the held means) resumes
    a new model bit for bit (draining mid-run changes nothing: the first test). Not ``auto``,
    whose first step after a load is a float32 sync step by design (docs/auto.md; the
    blocking hook's test_ddp.py::test_resume checks its totals instead)."""
    for r in values:
        rec = r[name]
        for t, got, want in zip(range(DRAIN, STEPS), rec["resumed"], rec["continued"]):
            for n in SHAPES:
                np.testing.assert_array_equal(got[n], want[n], err_msg=f"{n} step {t}")
        assert any(np.abs(x[n]).max() > 0 for x in rec["continued"] for n in SHAPES)


def test_refusals(values):
    for r in values:
        e = r["errors"]
        for bad in (2, -1, True, 1.0, "1"):
            assert e[f"delay={bad!r}"].startswith(f"register_comm_hook: delay must be 0 (blocking) or 1"), bad
        assert "sparse gradients (module '0', sparse=True) are not supported" in e["sparse"]
        assert "compiled DDP (optimize_ddp='python_reducer')" in e["compiled"]
        assert "registers delay=0, rank 1 delay=1; every rank must register the same delay" in e["disagree"]
        assert "has no hook registered with delay=1" in e["no delayed hook"]
        assert "'nope' (shape [3]) is not a parameter" in e["wrong name"]


def failing_worker(tmp):
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from torch_backend.ddp_delayed import delayed_state
    rank = dist.get_rank()
    where = "register"
    try:
        ddp = _ddp()
        register_comm_hook(ddp, Compression.thc(), delay=1)
        for t in range(5):
            where = t
            if rank == 1 and t == 2:
                raise ValueError("rank 1 stops at step 2")
            _step(ddp, rank, t)
        where = "drain"
        delayed_state(ddp).drain()
        where = "done"
    finally:
        record(tmp, rank, where)


def test_a_rank_that_raises_makes_its_peer_raise(tmp_path):
    """Rank 1 raises at step 2 and exits; rank 0, which posted step 2 without waiting, raises
    at its next wait for it (step 3's hook) instead of hanging (the launch's timeout would
    raise TimeoutError)."""
    check_peer_raises(failing_worker, tmp_path)


@pytest.mark.parametrize("spec", JOIN_SPECS)
def test_join_with_uneven_inputs(values, spec):
    """Under ``Join`` (rank 1 out of inputs two steps early) and after it, rank 0 applies at
    each step exactly the blocking run's previous step (which rank 1's kept error feedback
    decides after Join), rank 1 the same means as rank 0 at the same step, and both ranks
    drain the same last mean (the blocking run's last step)."""
    r0, r1 = values[0][f"join {spec}"], values[1][f"join {spec}"]
    steps1 = list(range(STEPS - EARLY)) + list(range(STEPS, STEPS + AFTER))  # rank 1's steps among rank 0's
    assert len(r0["delayed"]) == STEPS + AFTER and len(r1["delayed"]) == len(steps1)
    for n in SHAPES:
        np.testing.assert_array_equal(r0["delayed"][0][n], np.zeros(SHAPES[n]))
        for t in range(1, STEPS + AFTER):
            np.testing.assert_array_equal(r0["delayed"][t][n], r0["blocking"][t - 1][n], err_msg=f"{n} step {t}")
        for k, t in enumerate(steps1):
            np.testing.assert_array_equal(r1["delayed"][k][n], r0["delayed"][t][n], err_msg=f"{n} step {t}")
        for r in (r0, r1):
            np.testing.assert_array_equal(r["last"][n], r0["blocking"][-1][n])
    if spec == "fp16":  # rank 1's zeros during Join: rank 0's mean is its own gradient's half
        half = grads_of(0, 100 * (STEPS - 1))["w"].double().numpy() / 2
        np.testing.assert_allclose(r0["blocking"][STEPS - 1]["w"], half, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(UNUSED))
def test_unused_parameters_balance(values, name):
    """With parameters unused at some steps (on one rank, or on both: DDP drops what the hook
    delivered), what the steps applied, plus the drained mean, plus the ranks' mean residual,
    is the sum of the mean gradients; replicas equal."""
    r0, r1 = values[0][name], values[1][name]
    for n, shape in SHAPES.items():
        for a, b in zip(r0["delayed"], r1["delayed"]):
            np.testing.assert_array_equal(a[n], b[n])
        np.testing.assert_array_equal(r0["last"][n], r1["last"][n])
        truth = r0["truth"][n]
        total = sum(o[n] for o in r0["delayed"]) + r0["last"][n]
        pending = [r["residuals"].get(n) for r in (r0, r1)]
        if pending[0] is not None:
            total = total + (pending[0] + pending[1]).reshape(shape) / 2
        bound = STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5
        assert np.abs(total - truth).max() <= bound, (name, n, np.abs(total - truth).max())
    if name != "static thc":  # v's step-0 mean reached .grad only at step 2 (unused at step 1)
        assert not r0["delayed"][1]["v"].any() and r0["delayed"][2]["v"].any()


@pytest.mark.parametrize("spec", SCALED_SPECS)
def test_loss_scale_changed_between_steps(values, spec):
    """Under a loss scale changed between steps, the delayed run's unscaled gradient at step
    t is exactly the blocking run's at step t - 1 (the held mean is re-scaled to the scale of
    the step that applies it)."""
    for r in values:
        rec = r[f"scaled {spec}"]
        for n in SHAPES:
            for t in range(1, len(SCALES)):
                np.testing.assert_array_equal(rec["delayed"][t][n], rec["blocking"][t - 1][n], err_msg=f"{n} step {t}")
