"""UpdateSync under AMP's GradScaler, its count check, and ``synchronize()`` with nothing to
sync, on real ranks (issue 47, items 2 and 3).

The probe model of :mod:`tests.parallel.test_update_sync` (rank r's gradient of parameter p at
step t is the seeded ``G_r[p, t]``; inner SGD, lr 0.1). One launch per engine (Horovod on 2
ranks, ``torch.distributed`` Gloo on 2 ranks), each under a timeout that kills its ranks:

- the ordinary AMP loop (``scaler.scale(loss).backward(); scaler.step(sync);
  scaler.update()``) with one inf in rank 1's gradient at step 2, at H = 1 and H = 2 (FP32
  payloads; at H = 2 also with a fused inner SGD, which gets the scaler's flags): no hang;
  the ranks' parameters equal after each sync and equal to a float64 run in which rank 1
  skips that inner step (its change lacks it) while the sync comes at the same call on both
  ranks; rank 1's scale backed off, rank 0's not. Before the fix rank 1's sync fell one step
  behind rank 0's, and the launch hung, or failed when rank 1 finished first;
- the count check: a rank that calls ``synchronize()`` alone mid-interval, and a rank that
  skips a ``step()`` by hand (then the final ``synchronize()`` on both), raise ValueError on
  every rank, naming UpdateSync and each rank's sync number and step count;
- ``synchronize()`` with no step since the last sync (H = 3 with the outer Nesterov step;
  right after construction and twice after a sync) leaves the parameters and ``theta``
  bitwise unchanged (before the fix the outer momentum moved them).
"""
import numpy as np
import pytest

from tests import ddprun, hvdrun
from tests.parallel.test_update_sync import LR, SHAPES, _digest, _params, _probe, grads_of

INF_STEP, STEPS = 2, 6
AMP_RUNS = ((1, False), (2, False), (2, True))  # (H, fused inner SGD: the scaler's flags passed on)


def _value_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
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

    def make(spec="none", every=1, fused=False):
        model = _probe()
        opt = torch.optim.SGD(model.parameters(), lr=LR, fused=fused)
        return model, UpdateSync(opt, model=model, compression=Compression.from_spec(spec), every=every)

    # the ordinary AMP loop, one inf on rank 1 at INF_STEP
    for every, fused in AMP_RUNS:
        model, sync = make("none", every, fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        start, seen = _params(model), []
        for t in range(STEPS):
            sync.zero_grad()
            grads = grads_of(rank, t)
            if rank == 1 and t == INF_STEP:
                grads["w"][3, 5] = float("inf")
            scaler.scale(model(grads)).backward()
            scaler.step(sync)
            scaler.update()
            if (t + 1) % every == 0:
                seen.append(_params(model))
        sync.synchronize()  # the last step synced already: nothing to do
        out[f"amp {every} {fused}"] = {"start": start, "seen": seen, "final": _params(model),
                               "scale": scaler.get_scale(), "counts": (sync.syncs, sync.steps)}
    # the count check: rank 0 syncs alone mid-interval (H = 2, after 3 steps)
    model, sync = make("fp16", 2)
    for t in range(3):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        sync.step()
    if rank == 0:
        out["alone"] = _value_error(sync.synchronize)
    else:
        sync.zero_grad()
        model(grads_of(rank, 3)).backward()
        out["alone"] = _value_error(sync.step)
    # ... and rank 1 skips a step() by hand (H = 1), then both call synchronize() at the end
    model, sync = make("fp16", 1)
    error = None
    for t in range(4):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        if rank == 1 and t == 1:
            continue
        error = _value_error(sync.step)
        if error is not None:
            break
    out["skipped by hand"] = (t, error if error is not None else _value_error(sync.synchronize))
    # synchronize() with no step since the last sync: nothing changes (H = 3, outer Nesterov)
    model, sync = make("topkc:0.1", 3)
    digests = [_digest(model)]
    sync.synchronize()  # right after construction
    digests.append(_digest(model))
    for t in range(3):
        sync.zero_grad()
        model(grads_of(rank, t)).backward()
        sync.step()
    digests.append(_digest(model))
    thetas = [np.concatenate([t.detach().numpy().ravel() for t in sync.theta])]
    for _ in range(2):
        sync.synchronize()
        digests.append(_digest(model))
        thetas.append(np.concatenate([t.detach().numpy().ravel() for t in sync.theta]))
    out["noop"] = {"digests": digests, "thetas": thetas, "syncs": sync.syncs}
    if backend == "horovod":
        hvd.shutdown()
    return out


def _horovod_checks():
    return _checks("horovod")


def _torch_checks():
    return _checks("torch")


@pytest.fixture(scope="module", params=["horovod", "torch"])
def ranks(request):
    if request.param == "horovod":
        return request.param, hvdrun.run(_horovod_checks, np=2, timeout=180)
    return request.param, ddprun.run(_torch_checks, np=2, timeout=120)


def _reference(every, start):
    """float64 parameters after each sync: rank 1's inner step at INF_STEP skipped; H = 2:
    the outer Nesterov SGD (lr 0.7, momentum 0.9)."""
    theta = {n: v.copy() for n, v in start.items()}
    buf, seq = {}, []
    for s in range(STEPS // every):
        steps = range(s * every, (s + 1) * every)
        d = {n: sum(-LR * grads_of(r, t)[n].double().numpy() for r in (0, 1) for t in steps
                    if not (r == 1 and t == INF_STEP)) / 2 for n in SHAPES}
        for n in SHAPES:
            if every == 1:
                theta[n] = theta[n] + d[n]
                continue
            g = -d[n]
            buf[n] = g.copy() if n not in buf else 0.9 * buf[n] + g
            theta[n] = theta[n] - 0.7 * (g + 0.9 * buf[n])
        seq.append({n: v.copy() for n, v in theta.items()})
    return seq


def test_amp_loop_with_an_inf_on_one_rank(ranks):
    _, (r0, r1) = ranks
    for every, fused in AMP_RUNS:
        a0, a1 = r0[f"amp {every} {fused}"], r1[f"amp {every} {fused}"]
        assert a0["counts"] == a1["counts"] == (STEPS // every, STEPS)
        assert a1["scale"] == a0["scale"] / 2  # rank 1 found the inf and backed off
        want = _reference(every, a0["start"])
        assert len(a0["seen"]) == len(want)
        for got0, got1, ref in zip(a0["seen"], a1["seen"], want):
            for n in SHAPES:
                np.testing.assert_array_equal(got0[n], got1[n])
                np.testing.assert_allclose(got0[n], ref[n], rtol=1e-5, atol=1e-5)
        for n in SHAPES:
            np.testing.assert_array_equal(a0["final"][n], a0["seen"][-1][n])


def test_count_mismatch_raises_on_every_rank(ranks):
    _, (r0, r1) = ranks
    for r in (r0, r1):
        msg = r["alone"]
        assert msg is not None and msg.startswith("UpdateSync: the ranks are at different syncs"), msg
        assert "rank 0: sync 2 after 3 steps" in msg and "rank 1: sync 2 after 4 steps" in msg, msg
        assert "scaler.step(sync)" in msg
    # rank 1 skipped step() at t = 1: its syncs pair one step off until the end, where its
    # final synchronize() (nothing to sync, only the check) meets rank 0's fourth sync
    # rank 0's fourth sync meets rank 1's final synchronize() (rank 1 had one step fewer)
    for r in (r0, r1):
        last, msg = r["skipped by hand"]
        assert last == 3 and msg is not None, msg
        assert "rank 0: sync 4 after 4 steps, rank 1: sync 4 after 3 steps" in msg, msg


def test_synchronize_with_nothing_to_sync_changes_nothing(ranks):
    _, results = ranks
    for r in results:
        d = r["noop"]["digests"]
        assert d[0] == d[1]  # right after construction
        assert d[2] != d[1] and d[2] == d[3] == d[4]  # after the sync at step 3, twice more
        for theta in r["noop"]["thetas"][1:]:
            np.testing.assert_array_equal(theta, r["noop"]["thetas"][0])
        assert r["noop"]["syncs"] == 1
    assert results[0]["noop"]["digests"] == results[1]["noop"]["digests"]
