"""The DDP hook under ``torch.compile`` with compiled autograd and
``optimize_ddp = "python_reducer"`` (``torch_backend.ddp_compiled``), on two real Gloo ranks.

There DDP calls the hook per parameter as ``hook(state, (grad, param))``; the hook gathers the
gradients into buckets in ready order and writes the means at the end of backward. One launch
runs every scheme (fp16, thc, topkc, powersgd, signsgd) on the probe model of
tests/parallel/test_ddp.py (the gradient of ``p`` at step ``t`` on rank ``r`` is a seeded
tensor): each compiled model trains next to an eager DDP model with the same compressor spec.
Checked: the Python reducer's form was taken; ranks deliver identical gradients; compressing
each tensor alone (``per_tensor=True``) gives eager DDP's bits; bucketed, error feedback's
balance holds (delivered + the ranks' mean pending residual = the sum of the mean gradients)
and the result stays within the scheme's error of eager DDP's; a ``state_dict(gather=True)``
saved on rank 0 resumes a new compiled model exactly; several buckets a backward
(``bucket_cap_mb=0.01``); Lightning's ``comm_state`` form and ``no_sync()`` accumulation;
``find_unused_parameters=True`` is refused at ``register_comm_hook``. Compiling on two busy cores is slow: a generous timeout.
"""
import os

import numpy as np
import pytest

from tests.ddprun import run
from tests.parallel.ddp_probe import (SHAPES, AllReduceCounter as _Counter, grads_of, probe_cls as _probe_cls,
                                      probe_step as _step, residuals as _residuals)

SPECS = ["fp16", "thc", "topkc:0.1", "powersgd:2", "signsgd"]
STEPS = 4
RESUME = 2


def _compiled(make, spec, per_tensor=False, cap=None):
    """A DDP probe built and compiled under the Python reducer, with ``spec``'s hook
    (``cap``: DDP's ``bucket_cap_mb``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = DDP(make(), **({} if cap is None else {"bucket_cap_mb": cap}))
    comp = register_comm_hook(ddp, Compression.from_spec(spec), per_tensor=per_tensor)
    return ddp, torch.compile(ddp), comp


def _run(ddp, compiled, steps):
    import torch
    with torch._dynamo.config.patch(compiled_autograd=True):
        return [_step(compiled, grads_of(torch.distributed.get_rank(), t)) for t in steps]


def compiled_worker(tmp):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from tests.hvdrun import value_error
    rank = dist.get_rank()
    Probe = _probe_cls()
    out = {}
    for spec in SPECS:
        rec = {}
        for per_tensor in (True, False):  # the bucketed model last: it goes on below
            torch._dynamo.reset()
            eager = DDP(Probe())
            register_comm_hook(eager, Compression.from_spec(spec), per_tensor=per_tensor)
            rec[("eager", per_tensor)] = [_step(eager, grads_of(rank, t)) for t in range(STEPS)]
            ddp, compiled, comp = _compiled(Probe, spec, per_tensor)
            rec[("compiled", per_tensor)] = _run(ddp, compiled, range(STEPS))
            rec[("form", per_tensor)] = type(ddp._comm_hooks[0][1].ready).__name__
            rec[("owed", per_tensor)] = _residuals(comp)
        # small buckets (10 kB: w alone, then v and b, the last one sent at the end of backward)
        torch._dynamo.reset()
        small, small_compiled, small_comp = _compiled(Probe, spec, cap=0.01)
        with _Counter() as counter:
            rec["small"] = _run(small, small_compiled, range(STEPS))
        rec["small owed"] = _residuals(small_comp)
        rec["small calls"] = len(counter.calls)
        # exact resume (bucketed): a checkpoint saved on rank 0 into a new compiled model
        path = os.path.join(tmp, f"{spec}.pt")
        state = comp.state_dict(gather=True)
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
        ddp2, compiled2, comp2 = _compiled(Probe, spec, per_tensor=False)
        comp2.load_state_dict(torch.load(path, weights_only=True))
        rec["resume"] = (_run(ddp, compiled, range(STEPS, STEPS + RESUME)),
                         _run(ddp2, compiled2, range(STEPS, STEPS + RESUME)))
        out[spec] = rec
    # Lightning's form: the state made from the module (bound at the first backward), and
    # no_sync() accumulation (DDP calls no hook; the synced step sends the sum of two steps)
    from torch_backend.ddp import comm_state, hook
    torch._dynamo.reset()
    module = Probe()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = DDP(module)
    ddp.register_comm_hook(comm_state(module, Compression.fp16()), hook)
    compiled = torch.compile(ddp)
    out["comm_state"] = _run(ddp, compiled, range(STEPS))
    with torch._dynamo.config.patch(compiled_autograd=True):
        for p in ddp.parameters():
            p.grad = None
        with ddp.no_sync():
            compiled(grads_of(rank, 0)).backward()
        compiled(grads_of(rank, 1)).backward()
    out["no_sync"] = {n: p.grad.detach().double().numpy().copy() for n, p in module.named_parameters()}
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        unused = DDP(Probe(), find_unused_parameters=True)
    out["unused"] = value_error(lambda: register_comm_hook(unused, Compression.fp16()))
    return out


@pytest.fixture(scope="module")
def compiled():
    import tempfile
    with tempfile.TemporaryDirectory(prefix="ddp-compiled-") as tmp:
        yield run(compiled_worker, np=2, args=(tmp,), timeout=1500)


def _balance(outs, owed, spec):
    """Error feedback's balance, float64: delivered + mean pending residual = sum of means."""
    for n, shape in SHAPES.items():
        truth = sum((grads_of(0, t)[n] + grads_of(1, t)[n]).double().numpy() / 2 for t in range(STEPS))
        delivered = sum(o[n] for o in outs)
        pending = [o.get(n) for o in owed]
        if pending[0] is not None:
            delivered = delivered + (pending[0] + pending[1]).reshape(shape) / 2
        bound = STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5
        assert np.abs(delivered - truth).max() <= bound, (spec, n)


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_values(compiled, spec):
    r0, r1 = compiled[0][spec], compiled[1][spec]
    for per_tensor in (False, True):
        assert r0[("form", per_tensor)] == "ReadyBuckets"  # the hook saw (grad, param)
        for a, b in zip(r0[("compiled", per_tensor)], r1[("compiled", per_tensor)]):
            for n in SHAPES:  # every rank applies the same gradient
                np.testing.assert_array_equal(a[n], b[n])
        _balance(r0[("compiled", per_tensor)], [r0[("owed", per_tensor)], r1[("owed", per_tensor)]], spec)
    # each tensor alone: eager DDP's bits
    for a, b in zip(r0[("compiled", True)], r0[("eager", True)]):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])
    # bucketed: within the scheme's error of eager DDP's (whose buckets may be ordered otherwise)
    for n in SHAPES:
        truth = sum((grads_of(0, t)[n] + grads_of(1, t)[n]).double().numpy() / 2 for t in range(STEPS))
        ours = sum(o[n] for o in r0[("compiled", False)])
        theirs = sum(o[n] for o in r0[("eager", False)])
        error = np.linalg.norm(theirs - truth) + 2.0 ** -10 * np.linalg.norm(truth) * STEPS
        assert np.linalg.norm(ours - truth) <= 2 * error + 1e-5, (spec, n)


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_small_buckets(compiled, spec):
    """Several buckets a backward (bucket_cap_mb=0.01), the last sent by the final callback."""
    r0, r1 = compiled[0][spec], compiled[1][spec]
    for a, b in zip(r0["small"], r1["small"]):
        for n in SHAPES:
            np.testing.assert_array_equal(a[n], b[n])
    _balance(r0["small"], [r0["small owed"], r1["small owed"]], spec)
    if spec in ("fp16", "topkc:0.1"):  # one payload dtype: one all-reduce per bucket, two buckets
        assert r0["small calls"] == 2 * STEPS, r0["small calls"]
    if spec == "fp16":  # a cast: the same bits in any layout
        for a, b in zip(r0["small"], r0[("eager", False)]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_resume(compiled, spec):
    for r in compiled:
        continued, resumed = r[spec]["resume"]
        for a, b in zip(continued, resumed):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])


def test_compiled_comm_state_and_no_sync(compiled):
    """A state of comm_state (Lightning's form) gives register_comm_hook's bits; under
    no_sync() the synced step averages the two steps' summed gradients."""
    for r in compiled:
        for a, b in zip(r["comm_state"], r["fp16"][("compiled", False)]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])
        for n in SHAPES:
            truth = sum((grads_of(q, 0)[n] + grads_of(q, 1)[n]).double().numpy() for q in (0, 1)) / 2
            np.testing.assert_allclose(r["no_sync"][n], truth, rtol=2e-3, atol=2e-3)


def test_compiled_refusal(compiled):
    for r in compiled:
        assert "find_unused_parameters=True is not supported" in r["unused"]
