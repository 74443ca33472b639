"""Horovod's grouped all-reduce (``hvd.DistributedOptimizer(..., num_groups=/groups=)``) sent as
buckets (:mod:`hvd_gradcomp.buckets`): one codec call per group and route, the payloads shared
out as one piece per tensor of the group, on two real Horovod (Gloo) ranks.

One launch: for each compressor, the probe model of tests/parallel/test_ddp.py (each rank's
gradient a seeded tensor) trained for a few steps without groups and with ``num_groups=1``.
Checked: the casts give the same bits grouped and not; every scheme's ranks apply identical
gradients and error feedback's balance holds (what was delivered plus the ranks' mean pending
error feedback is the sum of the ranks' mean gradients); the group's tensors of a route whose
scheme flattens form one flat group; a checkpoint of the grouped run loads into an ungrouped
one (``weights_only=True``) with the same totals.
"""
import numpy as np
import pytest

from tests.hvdrun import run
from tests.parallel.ddp_probe import SHAPES, grads_of, probe_cls as _probe_cls, residuals as _owed

SPECS = ["none", "fp16", "topkc:0.1", "thc", "signsgd", "powersgd:2", "topk:0.1"]
STEPS = 4


def _train(hvd, torch, comp, groups, steps, start=0, run=None):
    """``(outs, run)``: the gradients Horovod's optimizer delivered at each step; ``run`` (the
    model and optimizer) continues a run."""
    if run is None:
        model = _probe_cls()()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), compression=comp,
                                       num_groups=groups)
        run = (model, opt)
    model, opt = run
    outs = []
    for t in range(start, start + steps):
        opt.zero_grad()
        model(grads_of(hvd.rank(), t)).backward()
        opt.synchronize()
        outs.append({n: p.grad.detach().double().numpy().copy() for n, p in model.named_parameters()})
        with opt.skip_synchronize():
            opt.step()
    return outs, run


def worker(tmp):
    import io
    import torch
    import horovod.torch as hvd
    from torch_backend import Compression
    hvd.init()
    out = {}
    for spec in SPECS:
        for groups in (0, 1):
            comp = Compression.from_spec(spec)
            outs, run_ = _train(hvd, torch, comp, groups, STEPS)
            rec = {"outs": outs, "owed": _owed(comp), "groups": sorted(comp.codec.groups.groups),
                   "bytes": comp.bytes_per_step().payload}
            if groups:  # the grouped run's checkpoint into an ungrouped compressor
                buf = io.BytesIO()
                torch.save(comp.state_dict(), buf)
                buf.seek(0)
                other = Compression.from_spec(spec)
                other.load_state_dict(torch.load(buf, weights_only=True))
                rec["cross"] = _train(hvd, torch, other, 0, 2, start=STEPS)[0]
                rec["cross_owed"] = _owed(other)
                rec["cont"] = _train(hvd, torch, comp, 1, 2, start=STEPS, run=run_)[0]
                rec["cont_owed"] = _owed(comp)
            out[(spec, groups)] = rec
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(worker, np=2, args=(str(tmp_path_factory.mktemp("hb")),), timeout=600)


@pytest.mark.parametrize("spec", SPECS)
def test_grouped_values(results, spec):
    for groups in (0, 1):
        r0, r1 = results[0][(spec, groups)], results[1][(spec, groups)]
        for a, b in zip(r0["outs"], r1["outs"]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])
        for n, shape in SHAPES.items():
            truth = sum((grads_of(0, t)[n] + grads_of(1, t)[n]).double().numpy() / 2 for t in range(STEPS))
            total = sum(o[n] for o in r0["outs"])
            owed = [r["owed"].get(n) for r in (r0, r1)]
            if owed[0] is not None:
                total = total + (owed[0] + owed[1]).reshape(shape) / 2
            bound = STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5
            assert np.abs(total - truth).max() <= bound, (spec, groups, n)
    if spec in ("none", "fp16"):
        for a, b in zip(results[0][(spec, 0)]["outs"], results[0][(spec, 1)]["outs"]):
            for n in SHAPES:
                np.testing.assert_array_equal(a[n], b[n])
    flat = spec not in ("powersgd:2",)
    assert bool(results[0][(spec, 1)]["groups"]) == flat
    assert not results[0][(spec, 0)]["groups"]


@pytest.mark.parametrize("spec", SPECS)
def test_grouped_checkpoint_into_ungrouped(results, spec):
    """Delivered plus owed after two more steps: the same whether the grouped run continues or
    its checkpoint resumes without groups (each tensor's error feedback carried over)."""
    for n, shape in SHAPES.items():
        totals = []
        for outs, owed in (("cont", "cont_owed"), ("cross", "cross_owed")):
            t = 0.0
            for r in results:
                rec = r[(spec, 1)]
                t = t + sum(o[n] for o in rec[outs])  # n x the mean delivered ...
                if rec[owed].get(n) is not None:  # ... plus every rank's pending error feedback
                    t = t + rec[owed][n].reshape(shape)
            totals.append(t)
        bound = 2 * 2.0 ** -10 * np.abs(totals[0]).max() + 1e-5
        np.testing.assert_allclose(totals[1], totals[0], rtol=0, atol=bound, err_msg=n)
