"""Compressed update sync (``torch_backend.update_sync.UpdateSync``) on real ranks.

The probe model's loss is ``sum_p sum(p * G_r[p, t])``, so rank r's gradient of parameter p at
step t is ``G_r[p, t]``, a seeded normal tensor the test rebuilds; the inner optimizer is
plain SGD (lr 0.1), so the local change since a sync is ``-0.1 x`` the sum of the gradients
and the test recomputes every sync in float64. Parameters: ``w`` 64x64 (compressed), ``b`` 64
(fp16 below min_numel), ``v`` 32x64.

Two launches, one per engine, each running every check of :func:`_checks` (module-scoped):
Horovod on 2 ranks (``tests/hvdrun.py``) and ``torch.distributed`` Gloo on 2 ranks
(``tests/ddprun.py``):

- values against float64: FP32 (``none``) at H = 1 (``theta + mean change``) and at H = 3
  with the outer Nesterov SGD (lr 0.7, momentum 0.9), two syncs;
- ranks equal after each sync (bitwise), for ``topkc:0.1``, ``thc``, ``powersgd:2``, ``signsgd``
  and ``fp16`` at H = 1 and H = 2;
- error feedback's balance on the change (TopKC, H = 1): what the syncs delivered plus the
  ranks' mean pending residual is the ranks' mean total change, up to fp16 rounding;
- exact resume: TopKC at H = 2 with the outer optimizer, saved mid-interval (between syncs),
  resumed in new objects, bitwise equal to the run without the break;
- bytes per step, and the refusals (Horovod's optimizer either way round, a used compressor,
  a factory, every=0, a DDP model, the blocking variants on torch.distributed, Join, and, on
  Horovod, a sync while a rank is in ``hvd.join()``).
"""
import hashlib

import numpy as np
import pytest

from tests import ddprun, hvdrun

SHAPES = {"w": (64, 64), "b": (64,), "v": (32, 64)}
LR = 0.1
EQUAL_SPECS = ["topkc:0.1", "thc", "powersgd:2", "signsgd", "fp16"]


def grads_of(rank, step, scale=1.0):
    """The seeded gradients of ``rank`` at ``step`` (0-based): {name: float32 tensor}."""
    import torch
    g = torch.Generator().manual_seed(7919 * step + 131 * rank + 3)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _probe():
    import torch

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(5)
            for n, s in SHAPES.items():
                self.register_parameter(n, torch.nn.Parameter(torch.randn(s, generator=g)))

        def forward(self, grads):
            return sum((p * grads[n]).sum() for n, p in self.named_parameters())

    return Probe()


def _digest(model):
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _params(model):
    return {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}


def _residuals(comp):
    """{key: this rank's pending error feedback, float64 (None: no state)} (as test_ddp.py)."""
    from hvd_gradcomp import composite
    from torch_backend import OPS
    out = {}
    for key, info in comp.codec.tensors.infos.items():
        scheme = comp.table.routes[key].scheme
        r = composite.residual_of(scheme, OPS, comp.codec.store.read(key), info) if comp.codec.store.has(key) else None
        out[key] = None if r is None else r.double().numpy().copy()
    return out


def _train(sync, model, rank, steps, start=0, record=None):
    """``steps`` local steps from step ``start``; ``record(step)`` after each."""
    for t in range(start, start + steps):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        sync.step()
        if record is not None:
            record(t)


def _value_error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _checks(backend):
    import torch
    from torch_backend import Compression, UpdateSync
    torch.manual_seed(0)
    if backend == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    else:
        import torch.distributed as dist
        rank = dist.get_rank()
    out = {"rank": rank}

    def make(spec="none", every=1, **kw):
        model = _probe()
        if rank == 1:  # the constructor broadcasts rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return model, UpdateSync(opt, model=model, compression=Compression.from_spec(spec), every=every, **kw)

    # values: FP32 at H = 1 (2 syncs) and H = 3 with the outer Nesterov step (2 syncs)
    for every, steps in ((1, 2), (3, 6)):
        model, sync = make("none", every)
        out[f"start {every}"] = _params(model)
        seen = []
        _train(sync, model, rank, steps, record=lambda t: seen.append(_params(model)) if (t + 1) % every == 0 else None)
        out[f"values {every}"] = seen
        out[f"bytes {every}"] = tuple(sync.bytes_per_step())
    # ranks equal after each sync; error feedback's balance (TopKC, H = 1)
    for spec in EQUAL_SPECS:
        for every in (1, 2):
            model, sync = make(spec, every)
            digests = []
            _train(sync, model, rank, 4, record=lambda t: digests.append(_digest(model)) if (t + 1) % every == 0 else None)
            out[f"equal {spec} {every}"] = digests
    model, sync = make("topkc:0.1", 1)
    changes = []
    for t in range(4):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        sync.optimizer.step()  # the local step, then the sync by hand: the change is seen
        sync.local_steps += 1
        changes.append({n: (p.detach().double() - th.double()).numpy().copy()
                        for (n, p), th in zip(model.named_parameters(), sync._theta)})
        sync.synchronize()
    out["balance"] = {"start": out["start 1"], "end": _params(model), "changes": changes,
                      "residuals": _residuals(sync.compressor)}
    # exact resume, mid-interval (H = 2, outer optimizer): 3 steps, save, 5 more; or load and 5 more
    model, sync = make("topkc:0.1", 2)
    _train(sync, model, rank, 3)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, sync.state_dict())
    _train(sync, model, rank, 5, start=3)
    straight = _digest(model)
    model2, sync2 = make("topkc:0.1", 2)
    model2.load_state_dict(saved[0])
    sync2.load_state_dict(saved[1])
    _train(sync2, model2, rank, 5, start=3)
    out["resume"] = (straight, _digest(model2), saved[1]["local_steps"], sorted(saved[1]["compressor"]["tensors"]))
    out["resume other rank"] = _value_error(lambda: sync2.load_state_dict(dict(saved[1], rank=1 - rank)))
    out["resume every"] = _value_error(lambda: make("topkc:0.1", 3)[1].load_state_dict(saved[1]))
    # refusals (no collective before them: every rank raises alike)
    m = _probe()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    used = Compression.topkc(0.1)
    if backend == "torch":
        from torch_backend.engine import ProcessGroupEngine
        used.codec.bind_engine(ProcessGroupEngine())
    used.codec.encode(torch.randn(64, 64), "w")
    refusals = {
        "every": lambda: UpdateSync(opt, model=m, every=0),
        "used": lambda: UpdateSync(opt, model=m, compression=used),
        "factory": lambda: UpdateSync(opt, model=m, compression=Compression.fp16),
        "outer_momentum": lambda: UpdateSync(opt, model=m, every=2, outer_momentum=1.0),
        "not named": lambda: UpdateSync(opt, named_parameters=list(m.named_parameters())[:1]),
    }
    if backend == "horovod":
        refusals["hvd optimizer"] = lambda: UpdateSync(hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=LR), named_parameters=m.named_parameters()), model=m)
        refusals["wrapped by hvd"] = lambda: hvd.DistributedOptimizer(UpdateSync(opt, model=m),
                                                                      named_parameters=m.named_parameters())
    else:
        from torch.distributed.algorithms.join import Join
        from torch.nn.parallel import DistributedDataParallel as DDP
        refusals["blocking"] = lambda: UpdateSync(opt, model=m, compression="topkc:0.1,selection=current")
        ddp = DDP(_probe())
        refusals["ddp"] = lambda: UpdateSync(torch.optim.SGD(ddp.parameters(), lr=LR), model=ddp)
        _, joinable = make("fp16", 1)
        refusals["join"] = lambda: Join([joinable])
    out["refusals"] = {k: _value_error(f) for k, f in refusals.items()}
    if backend == "horovod":  # a rank in hvd.join(): the others' sync refuses, then they join too
        model, sync = make("topkc:0.1", 1)
        if rank == 1:
            hvd.join()
            out["join"] = None
        else:
            sync.zero_grad()
            model(grads_of(rank, 0)).backward()
            out["join"] = _value_error(sync.step)
            hvd.join()
        out["join residuals"] = _residuals(sync.compressor)  # nothing encoded before the refusal
        hvd.shutdown()
    return out


def _horovod_checks():
    return _checks("horovod")


def _torch_checks():
    return _checks("torch")


@pytest.fixture(scope="module", params=["horovod", "torch"])
def ranks(request):
    if request.param == "horovod":
        return request.param, hvdrun.run(_horovod_checks, np=2, timeout=300)
    return request.param, ddprun.run(_torch_checks, np=2, timeout=300)


def _reference(every, syncs, start):
    """float64 parameters after each sync: inner SGD on each rank, the mean change; H > 1: the
    outer SGD with Nesterov momentum (lr 0.7, momentum 0.9; torch's form, buffer = g at first)."""
    theta = {n: v.copy() for n, v in start.items()}
    buf, seq = {}, []
    for s in range(syncs):
        steps = range(s * every, (s + 1) * every)
        d = {n: sum(-LR * grads_of(r, t)[n].double().numpy() for r in (0, 1) for t in steps) / 2 for n in SHAPES}
        for n in SHAPES:
            if every == 1:
                theta[n] = theta[n] + d[n]
                continue
            g = -d[n]
            buf[n] = g.copy() if n not in buf else 0.9 * buf[n] + g
            theta[n] = theta[n] - 0.7 * (g + 0.9 * buf[n])
        seq.append({n: v.copy() for n, v in theta.items()})
    return seq


def test_values_against_float64(ranks):
    _, (r0, r1) = ranks
    for every, syncs in ((1, 2), (3, 2)):
        assert len(r0[f"values {every}"]) == syncs
        # rank 1 started from its own (shifted) parameters: the constructor broadcast rank 0's
        for n in SHAPES:
            np.testing.assert_array_equal(r0[f"start {every}"][n], r1[f"start {every}"][n])
        for got0, got1, want in zip(r0[f"values {every}"], r1[f"values {every}"],
                                    _reference(every, syncs, r0[f"start {every}"])):
            for n in SHAPES:
                np.testing.assert_array_equal(got0[n], got1[n])
                np.testing.assert_allclose(got0[n], want[n], rtol=1e-5, atol=1e-5)


def test_ranks_equal_after_each_sync(ranks):
    _, (r0, r1) = ranks
    for spec in EQUAL_SPECS:
        for every in (1, 2):
            d0, d1 = r0[f"equal {spec} {every}"], r1[f"equal {spec} {every}"]
            assert len(d0) == 4 // every and d0 == d1, (spec, every)
            assert len(set(d0)) == len(d0)  # and the parameters moved


def test_error_feedback_balance_on_the_change(ranks):
    # per sync t and rank r: delta_r(t) + e_r(t-1) = C_r(t) + e_r(t), theta(t) = theta(t-1) +
    # mean_r C_r(t); so theta(T) - theta(0) + mean_r e_r(T) = sum_t mean_r delta_r(t), up to the
    # fp16 rounding of the sent values and their sum (relative 2**-11 each, per sync)
    _, (r0, r1) = ranks
    b0, b1 = r0["balance"], r1["balance"]
    for n, shape in SHAPES.items():
        np.testing.assert_array_equal(b0["end"][n], b1["end"][n])
        truth = sum((c0[n] + c1[n]) / 2 for c0, c1 in zip(b0["changes"], b1["changes"]))
        delivered = b0["end"][n] - b0["start"][n]
        pending = [b["residuals"].get(n) for b in (b0, b1)]
        assert (pending[0] is None) == (n == "b")  # b goes as fp16 (below min_numel): no residual
        if pending[0] is not None:
            assert np.abs(pending[0]).max() > 1e-3  # TopKC held part of the change back
            delivered = delivered + (pending[0] + pending[1]).reshape(shape) / 2
        bound = 4 * 2.0 ** -10 * np.abs(truth).max() + 1e-6
        assert np.abs(delivered - truth).max() <= bound, n


def test_exact_resume_mid_interval(ranks):
    _, results = ranks
    for r in results:
        straight, resumed, local_steps, keys = r["resume"]
        assert straight == resumed and local_steps == 1 and keys == ["v", "w"]
        assert "state of rank" in r["resume other rank"] and "every=2" in r["resume every"]
    assert results[0]["resume"][0] == results[1]["resume"][0]


def test_bytes_per_step(ranks):
    _, (r0, _) = ranks
    numel = sum(int(np.prod(s)) for s in SHAPES.values())
    assert r0["bytes 1"][0] == 4 * numel  # FP32 (none) payloads, one all-reduce per tensor
    assert r0["bytes 3"][0] == 4 * numel // 3  # per optimizer step: a sync every 3


def test_refusals(ranks):
    backend, results = ranks
    for r in results:
        ref = r["refusals"]
        assert ref["every"].startswith("ValueError: UpdateSync: every must be an integer >= 1")
        assert "has already compressed tensors" in ref["used"]
        assert ref["factory"].startswith("TypeError:") and "pass Compression.fp16()" in ref["factory"]
        assert "outer_momentum must be in [0, 1)" in ref["outer_momentum"]
        assert "is not among the named parameters" in ref["not named"]
        if backend == "horovod":
            assert ref["hvd optimizer"].startswith("TypeError: UpdateSync: the optimizer is wrapped by hvd.DistributedOptimizer")
            assert "never inside it" in ref["wrapped by hvd"]
            assert r["join residuals"] == {}
        else:
            assert "blocking two-round variants" in ref["blocking"]
            assert "DistributedDataParallel model" in ref["ddp"] and "two synchronisations" in ref["ddp"]
            assert "does not support uneven inputs" in ref["join"]
    if backend == "horovod":
        assert results[0]["join"].startswith("ValueError: UpdateSync: only 1 of 2 ranks took part in sync 1")
