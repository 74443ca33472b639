"""SparseLoCo on an all-reduce (hvd_gradcomp/sparseloco.py) on real ranks: one
``torch.distributed`` Gloo launch of 2 ranks (``tests/ddprun.py``, whose timeout kills the
launch's whole process group), every check in :func:`_checks`:

- scheme level, 5 steps of a 3000-coordinate tensor, each rank's own input: the payload is
  summed by ``dist.all_reduce`` (int32 Sum); every rank's decoded output is the same, and
  equals the sum of each rank's decoded chunks (the rows each rank decoded for itself,
  gathered in the parent) to float64 rounding, on the chunks every rank selected alike;
  the summed level lanes equal the sum of each rank's own levels exactly;
- ``UpdateSync(opt, compression="sparseloco:...", every=2, outer_lr=1, outer_momentum=0)``:
  ranks bitwise equal after every sync, and an exact resume from a checkpoint taken between
  syncs (compressor state and all) against the run without the break; with ``overlap=True,
  fragments=2`` the synced parameters bitwise equal on every rank and moving.
"""
import hashlib

import numpy as np

from tests import ddprun

D, STEPS = 3000, 5
SPEC = "sparseloco:ratio=0.1,chunk=32"


def _input(rank, step):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(D, generator=g) * (1.0 + rank)


def _probe():
    import torch
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _train(sync, model, rank, start, steps):
    import torch
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(77 * t + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        sync.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        sync.step()


def _checks():
    import torch
    import torch.distributed as dist
    from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
    from hvd_gradcomp.registry import make_scheme, parse_spec
    from torch_backend import OPS, UpdateSync
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "steps": []}
    name, options = parse_spec(SPEC)[:2]
    scheme = make_scheme(name, **options)
    info = TensorInfo("w", (D,), "float32", n, rank, "sum")
    state = scheme.init(OPS, info, torch.zeros(1))
    for step in range(STEPS):
        payload, ctx = compress_tensor(scheme, OPS, _input(rank, step), state, info)
        own_words = payload[:scheme.layout(info).level_words].clone()
        dist.all_reduce(payload)  # int32 Sum over the real ranks
        decoded, state = finish_tensor(scheme, OPS, payload, ctx, state, info)
        out["steps"].append({"idx": ctx.idx.numpy().copy(), "sent": ctx.sent.double().numpy().copy(),
                             "levels": ctx.levels.numpy().copy(), "own_words": own_words.numpy().copy(),
                             "out": decoded.numpy().copy()})

    def make(**kw):
        model = _probe()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, UpdateSync(opt, model=model, compression=SPEC, outer_lr=1.0, outer_momentum=0.0,
                                 backend="torch", **dict({"every": 2}, **kw))

    model, sync = make()
    digests = []
    for t in range(0, 8, 2):
        _train(sync, model, rank, t, 2)
        digests.append(_digest(model))
    out["equal"] = digests
    model, sync = make()
    _train(sync, model, rank, 0, 3)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, sync.state_dict())
    _train(sync, model, rank, 3, 5)
    straight = _digest(model)
    model2, sync2 = make()
    model2.load_state_dict(saved[0])
    sync2.load_state_dict(saved[1])
    _train(sync2, model2, rank, 3, 5)
    out["resume"] = (straight, _digest(model2))
    # overlapped, in 2 fragments: the synced parameters equal on every rank after each point
    model, sync = make(every=4, overlap=True, fragments=2)
    thetas = []
    for t in range(0, 12, 2):
        _train(sync, model, rank, t, 2)
        h = hashlib.sha256()
        for th in sync.theta:
            h.update(th.detach().numpy().tobytes())
        thetas.append(h.hexdigest())
    out["overlap"] = thetas
    return out


def test_sparseloco_on_gloo():
    from hvd_gradcomp.base import TensorInfo
    from hvd_gradcomp.registry import make_scheme, parse_spec
    results = ddprun.run(_checks, np=2, timeout=300)
    name, options = parse_spec(SPEC)[:2]
    scheme = make_scheme(name, **options)
    lay = scheme.layout(TensorInfo("w", (D,), "float32", 2, 0, "sum"))
    C = options["chunk"]
    nonzero = 0
    for step in range(STEPS):
        a, b = (r["steps"][step] for r in results)
        np.testing.assert_array_equal(a["idx"], b["idx"])  # agreed chunks
        np.testing.assert_array_equal(a["out"], b["out"])  # one result on every rank
        # the level lanes sum exactly: each rank's own levels, recovered from its own words
        for r in (a, b):
            w = r["own_words"].astype(np.int64) & 0xFFFFFFFF
            lv = np.concatenate([(w >> (lay.levels.guard + j * lay.levels.width)) & ((1 << lay.levels.width) - 1)
                                 for j in range(lay.levels.lanes)])[:lay.selected * C]
            np.testing.assert_array_equal(lv, r["levels"])
        # the all-reduced decode is the sum of each rank's decoded chunks
        full = np.zeros((lay.chunks, C))
        full[a["idx"]] = a["sent"] + b["sent"]
        if scheme.config.interleave:  # chunk j, position i is coordinate i m + j
            full = full.T
        np.testing.assert_allclose(a["out"], full.reshape(-1)[:D], rtol=1e-6, atol=1e-6)
        nonzero += int(np.count_nonzero(a["out"]))
    assert nonzero > 0
    assert results[0]["equal"] == results[1]["equal"]
    assert results[0]["overlap"] == results[1]["overlap"] and len(set(results[0]["overlap"])) > 2
    for r in results:
        assert r["resume"][0] == r["resume"][1]
