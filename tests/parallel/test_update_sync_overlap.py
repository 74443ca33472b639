"""Overlapped update sync (``UpdateSync(overlap=True, fragments=F, eager=...)``) on real ranks
(issue 49, item 2).

The probe model of :mod:`tests.parallel.test_update_sync` (rank r's gradient of parameter p at
step t is the seeded ``G_r[p, t]``, whatever the parameters; inner SGD, lr 0.1), so the
schedule of :mod:`torch_backend.update_sync_rounds` can be replayed in float64 here. Rank 1
starts from shifted parameters (the constructor broadcasts rank 0's). Fragments of the probe
at F = 2: ``[w]`` and ``[b, v]``.

One launch per engine (Horovod and Gloo, 2 ranks each), under a timeout that kills its ranks:

- values against the float64 replay: FP32 payloads, F = 1 at H = 1 (no outer optimizer) and
  H = 2 (outer Nesterov), F = 2 at H = 4, eager and not: ``theta`` and each rank's
  parameters after every sync point, then after ``synchronize()`` (the drain);
- ``theta`` bitwise equal on both ranks after each sync point for TopKC, THC, PowerSGD,
  SparseLoCo, signSGD and FP16 payloads; with ``eager=False`` and F = 1 the parameters too;
  after the drain the parameters equal ``theta`` on both ranks; a second ``synchronize()``
  changes nothing;
- exact resume: saved while a round is in flight (H = 4, F = 2, TopKC), resumed in new
  objects, bitwise equal to the run without the break, and a state refused by an UpdateSync
  with other overlap options;
- the refusals of the options.

A third and fourth launch (Gloo, Horovod): rank 1 raises in the middle of a round in flight;
rank 0 raises too (its wait on the round fails) instead of hanging.
"""
import numpy as np
import pytest

from tests import ddprun, hvdrun
from tests.parallel.test_update_sync import LR, SHAPES, _digest, _params, _probe, grads_of

# (every, fragments, eager, steps): values against the float64 replay
VALUE_RUNS = ((1, 1, True, 4), (2, 1, True, 8), (2, 1, False, 8), (4, 2, True, 12), (4, 2, False, 12))
FRAGMENTS = {1: [["w", "b", "v"]], 2: [["w"], ["b", "v"]]}
EQUAL_SPECS = ["topkc:0.1", "thc", "powersgd:2", "signsgd", "sparseloco:ratio=0.1,chunk=32", "fp16"]
EQUAL_RUNS = ((4, 2, True), (4, 2, False), (2, 1, False))  # (every, fragments, eager): a sync point every 2 steps


def _value_error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _init(backend):
    if backend == "horovod":
        import horovod.torch as hvd
        hvd.init()
        return hvd.rank()
    import torch.distributed as dist
    return dist.get_rank()


def _make(rank, spec="none", every=1, **kw):
    import torch
    from torch_backend import Compression, UpdateSync
    model = _probe()
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return model, UpdateSync(opt, model=model, compression=Compression.from_spec(spec), every=every, **kw)


def _theta(sync):
    return {n: t.detach().double().numpy().copy() for n, t in zip(SHAPES, sync.theta)}


def _train(sync, model, rank, steps, start=0, record=None):
    for t in range(start, start + steps):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        sync.step()
        if record is not None:
            record(t)


def _checks(backend):
    import torch
    torch.manual_seed(0)
    rank = _init(backend)
    out = {"rank": rank}
    for every, frags, eager, steps in VALUE_RUNS:
        model, sync = _make(rank, "none", every, overlap=True, fragments=frags, eager=eager)
        period, seen = every // frags, []
        start = _params(model)
        _train(sync, model, rank, steps,
               record=lambda t: seen.append((_theta(sync), _params(model))) if (t + 1) % period == 0 else None)
        in_flight = sync.in_flight
        sync.synchronize()
        out[f"values {every} {frags} {eager}"] = {"start": start, "seen": seen, "in flight": in_flight,
                                                  "drained": (_theta(sync), _params(model))}
    for spec in EQUAL_SPECS:
        for every, frags, eager in EQUAL_RUNS:
            model, sync = _make(rank, spec, every, overlap=True, fragments=frags, eager=eager)
            digests = []
            _train(sync, model, rank, 8, record=lambda t: digests.append(
                (_digest_list(sync.theta), _digest(model))) if (t + 1) % 2 == 0 else None)
            sync.synchronize()
            drained = (_digest_list(sync.theta), _digest(model))
            sync.synchronize()
            out[f"equal {spec} {every} {frags} {eager}"] = {"seen": digests, "drained": drained,
                                            "again": (_digest_list(sync.theta), _digest(model))}
    # exact resume with a round in flight: 5 steps (sync points at 2 and 4), save, 7 more
    model, sync = _make(rank, "topkc:0.1", 4, overlap=True, fragments=2)
    _train(sync, model, rank, 5)
    in_flight = sync.in_flight
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, sync.state_dict())
    _train(sync, model, rank, 7, start=5)
    sync.synchronize()
    straight = (_digest(model), _digest_list(sync.theta))
    model2, sync2 = _make(rank, "topkc:0.1", 4, overlap=True, fragments=2)
    model2.load_state_dict(saved[0])
    sync2.load_state_dict(saved[1])
    _train(sync2, model2, rank, 7, start=5)
    sync2.synchronize()
    out["resume"] = {"in flight": in_flight, "straight": straight,
                     "resumed": (_digest(model2), _digest_list(sync2.theta)),
                     "saved ready": saved[1]["overlap"]["ready"] is not None}
    out["resume refused"] = [
        _value_error(lambda: _make(rank, "topkc:0.1", 4, overlap=True, fragments=1)[1].load_state_dict(saved[1])),
        _value_error(lambda: _make(rank, "topkc:0.1", 4)[1].load_state_dict(saved[1])),
    ]
    out["refusals"] = {
        "divides": _value_error(lambda: _make(rank, "fp16", 4, overlap=True, fragments=3)),
        "needs overlap": _value_error(lambda: _make(rank, "fp16", 4, fragments=2)),
        "too many": _value_error(lambda: _make(rank, "fp16", 4, overlap=True, fragments=4)),
        "overlap type": _value_error(lambda: _make(rank, "fp16", 4, overlap="yes")),
    }
    if backend == "horovod":
        import horovod.torch as hvd
        hvd.shutdown()
    return out


def _digest_list(tensors):
    import hashlib
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def _horovod_checks():
    return _checks("horovod")


def _torch_checks():
    return _checks("torch")


@pytest.fixture(scope="module", params=["horovod", "torch"])
def ranks(request):
    if request.param == "horovod":
        return request.param, hvdrun.run(_horovod_checks, np=2, timeout=240)
    return request.param, ddprun.run(_torch_checks, np=2, timeout=180)


def _replay(every, frags, eager, steps, start):
    """The float64 schedule (update_sync_rounds' module docs) on both ranks: per sync point
    ``(theta, [params of rank 0, of rank 1])``, then the drain's."""
    names = FRAGMENTS[frags]
    period = every // frags
    p = [{n: v.copy() for n, v in start.items()} for _ in (0, 1)]  # rank 0's, broadcast
    anchor = [{n: v.copy() for n, v in start.items()} for _ in (0, 1)]
    theta = {n: v.copy() for n, v in start.items()}
    buf, flight, turn, seen = {}, None, 0, []

    def outer(n, mean):
        if every == 1:
            theta[n] = theta[n] + mean
            return
        g = -mean
        buf[n] = g.copy() if n not in buf else 0.9 * buf[n] + g
        theta[n] = theta[n] - 0.7 * (g + 0.9 * buf[n])

    def apply(ready):
        frag, deltas = ready
        for n in frag:
            old = theta[n].copy()
            outer(n, (deltas[0][n] + deltas[1][n]) / 2)
            for r in (0, 1):
                if eager:
                    shift = theta[n] - old - deltas[r][n]
                    p[r][n] = p[r][n] + shift
                    anchor[r][n] = anchor[r][n] + shift
                else:
                    p[r][n], anchor[r][n] = theta[n].copy(), theta[n].copy()

    for t in range(steps):
        for r in (0, 1):
            g = grads_of(r, t)
            for n in SHAPES:
                p[r][n] = p[r][n] - LR * g[n].double().numpy()
        if (t + 1) % period:
            continue
        ready, frag = flight, names[turn]
        deltas = [{n: p[r][n] - anchor[r][n] for n in frag} for r in (0, 1)]
        for r in (0, 1):
            for n in frag:
                anchor[r][n] = p[r][n].copy()
        flight, turn = (frag, deltas), (turn + 1) % frags
        if ready is not None:
            apply(ready)
        seen.append(({n: v.copy() for n, v in theta.items()}, [{n: v.copy() for n, v in q.items()} for q in p]))
    # the drain: the round in flight, then every fragment's remaining change
    deltas = [{n: p[r][n] - anchor[r][n] for n in SHAPES} for r in (0, 1)]
    if flight is not None:
        apply(flight)
    for n in SHAPES:
        outer(n, (deltas[0][n] + deltas[1][n]) / 2)
    return seen, {n: v.copy() for n, v in theta.items()}


def test_values_against_float64(ranks):
    _, (r0, r1) = ranks
    for every, frags, eager, steps in VALUE_RUNS:
        key = f"values {every} {frags} {eager}"
        got0, got1 = r0[key], r1[key]
        assert got0["in flight"] and got1["in flight"]
        seen, drained = _replay(every, frags, eager, steps, got0["start"])
        assert len(got0["seen"]) == len(seen) == steps // (every // frags)
        for (th0, p0), (th1, p1), (th, (q0, q1)) in zip(got0["seen"], got1["seen"], seen):
            for n in SHAPES:
                np.testing.assert_array_equal(th0[n], th1[n])
                np.testing.assert_allclose(th0[n], th[n], rtol=1e-5, atol=1e-5, err_msg=f"{key} theta {n}")
                np.testing.assert_allclose(p0[n], q0[n], rtol=1e-5, atol=1e-5, err_msg=f"{key} rank 0 {n}")
                np.testing.assert_allclose(p1[n], q1[n], rtol=1e-5, atol=1e-5, err_msg=f"{key} rank 1 {n}")
        for got in (got0, got1):
            th, p = got["drained"]
            for n in SHAPES:
                np.testing.assert_array_equal(p[n], th[n])
                np.testing.assert_array_equal(th[n], got0["drained"][0][n])
                np.testing.assert_allclose(th[n], drained[n], rtol=1e-5, atol=1e-5)


def test_ranks_equal_after_each_applied_round(ranks):
    _, (r0, r1) = ranks
    for spec in EQUAL_SPECS:
        for every, frags, eager in EQUAL_RUNS:
            key = f"equal {spec} {every} {frags} {eager}"
            e0, e1 = r0[key], r1[key]
            thetas0 = [d[0] for d in e0["seen"]]
            assert len(thetas0) == 4 and thetas0 == [d[0] for d in e1["seen"]], key
            assert len(set(thetas0)) >= 3, key  # theta moved (THC may deliver nothing at its first round)
            if not eager and frags == 1:  # the parameters too, once a round was applied (F > 1: only
                # the applied fragment's)
                assert [d[1] for d in e0["seen"][1:]] == [d[1] for d in e1["seen"][1:]], key
            else:  # each rank's own change kept beside theta
                assert all(a != b for a, b in zip([d[1] for d in e0["seen"]], [d[1] for d in e1["seen"]])), key
            assert e0["drained"] == e1["drained"]
            assert e0["again"] == e0["drained"] and e1["again"] == e1["drained"]


def test_exact_resume_with_a_round_in_flight(ranks):
    _, results = ranks
    for r in results:
        assert r["resume"]["in flight"] and r["resume"]["saved ready"]
        assert r["resume"]["straight"] == r["resume"]["resumed"]
        a, b = r["resume refused"]
        assert "saved with overlap with fragments=2, eager=True, this one has overlap with fragments=1" in a, a
        assert "this one has no overlap" in b, b
    assert results[0]["resume"]["straight"] == results[1]["resume"]["straight"]


def test_refusals(ranks):
    _, results = ranks
    for r in results:
        ref = r["refusals"]
        assert "fragments must be an integer >= 1 that divides every=4" in ref["divides"]
        assert "fragments=2 needs overlap=True" in ref["needs overlap"]
        assert "fragments=4 but the optimizer has only 3 parameters" in ref["too many"]
        assert "overlap must be True or False" in ref["overlap type"]


def _raises_mid_round(backend):
    """Rank 1 raises after step 5 (H = 4, F = 2: the round posted at step 4 is in flight)."""
    rank = _init(backend)
    model, sync = _make(rank, "topkc:0.1", 4, overlap=True, fragments=2)
    for t in range(12):
        if rank == 1 and t == 5:
            raise RuntimeError("rank 1 failed in its forward")
        _train(sync, model, rank, 1, start=t)
    return "finished"


def _horovod_raises():
    return _raises_mid_round("horovod")


def _torch_raises():
    return _raises_mid_round("torch")


@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_a_rank_that_raises_makes_its_peers_raise(backend):
    launch = hvdrun.run if backend == "horovod" else ddprun.run
    fn = _horovod_raises if backend == "horovod" else _torch_raises
    with pytest.raises(Exception) as info:
        launch(fn, np=2, timeout=120)
    assert not isinstance(info.value, TimeoutError), info.value
    cause = info.value.__cause__
    if backend == "horovod":  # hvdrun: one dict per rank that raised, the first to raise first
        errors = {int(e["rank"]): (e["type"], e["message"], e["traceback"]) for e in cause.errors}
    else:  # ddprun: the ranks that raised; the exception is the lowest rank's
        errors = {r: None for r in cause.errors}
        errors[cause.rank] = (type(info.value).__name__, str(info.value), cause.worker_traceback)
    assert sorted(errors) == [0, 1], (sorted(errors), str(info.value)[:2000])
    # rank 0 raised too: its count check or its wait on the round failed when rank 1 went away
    kind, message, trace = errors[0]
    assert "rank 1 failed in its forward" not in message and "update_sync" in trace, (kind, message)
    assert kind not in ("ValueError", "TypeError"), (kind, message)
