"""FSDP2: ranks that disagree on the compressor, and compressor states of another mesh (issue
47, items 5 and 6), on real Gloo processes: one launch of 4 ranks.

Item 5: ``install`` and ``install_reduce_scatter`` gather a fingerprint of the compressor (its
canonical spec, ``per``, the frozen parameters) with the layout, once, and refuse a difference
with the same ValueError on every rank, naming both; then a correct install still trains (no
rank left in a collective).

Item 6: a compressor's state is per mesh (its keys name the shard rank and the shard group's
size). A state saved on a 2 x 2 mesh and loaded into 4 x 1 (``install``) or 1 x 4
(``install_reduce_scatter``) is refused on every rank, rank 0 included (whose saved rank
matches), before anything is loaded; with ``rank=`` given explicitly the keys that fit load
and the others are dropped with a warning naming them; the same mesh resumes as before.
"""
import warnings

import pytest

from tests.ddprun import run

SHAPES = {"w": (64, 64), "b": (64,), "v": (48, 64)}


def _probe_cls():
    import torch

    class Leaf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(SHAPES["w"]))
            self.b = torch.nn.Parameter(torch.zeros(SHAPES["b"]))

        def forward(self, g):
            return (self.w * g["w"]).sum() + (self.b * g["b"]).sum()

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = Leaf()
            self.v = torch.nn.Parameter(torch.zeros(SHAPES["v"]))

        def forward(self, g):
            return self.blk(g) + (self.v * g["v"]).sum()

    return Probe


def _grads(rank, step):
    import torch
    gen = torch.Generator().manual_seed(1009 * step + 17 * rank + 3)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _build(mesh, frozen=()):
    import torch
    from torch.distributed.fsdp import fully_shard
    model = _probe_cls()()
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    fully_shard(model.blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _train(model, opt, steps, rank):
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        model(_grads(rank, t)).backward()
        opt.step()
    return {n: p.grad.full_tensor().double().numpy().copy() for n, p in model.named_parameters()}


def _error(fn):
    """``(type name, message)`` of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares them
        return type(e).__name__, str(e)
    return None


def worker(tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    # item 5: replicas (ranks 0, 2 and 1, 3) with other specs; shard ranks (0, 1 and 2, 3) too
    model, _ = _build(mesh)
    out["install spec"] = _error(lambda: install(model, Compression.from_spec("thc" if rank < 2 else "topkc:0.1")))
    model, _ = _build(mesh)
    out["scatter spec"] = _error(lambda: install_reduce_scatter(
        model, Compression.from_spec("thc" if rank % 2 == 0 else "thc:bits=2")))
    model, _ = _build(mesh)
    out["install per"] = _error(lambda: install(model, Compression.thc(), per="param" if rank < 2 else "group"))
    model, _ = _build(mesh, frozen=("blk.b",) if rank == 3 else ())
    out["install frozen"] = _error(lambda: install(model, Compression.thc()))
    model, opt = _build(mesh)  # after the refusals: a correct install trains
    install_reduce_scatter(model, Compression.thc())
    install(model, Compression.topkc(0.1))
    out["after"] = _train(model, opt, 2, rank)
    # item 6: states saved on the 2 x 2 mesh (the last model's: both compressors, 2 steps)
    rs, ar = _compressors(model)
    saved_rs, saved_ar = rs.state_dict(), ar.state_dict()
    model, opt = _build(mesh)  # the same mesh: loads as before
    rs2, ar2 = install_reduce_scatter(model, Compression.thc()), install(model, Compression.topkc(0.1))
    out["same mesh"] = (_error(lambda: rs2.load_state_dict(saved_rs)), _error(lambda: ar2.load_state_dict(saved_ar)))
    wide = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    model, opt = _build(wide)
    ar3 = install(model, Compression.topkc(0.1))
    out["install, 4 x 1"] = _error(lambda: ar3.load_state_dict(saved_ar))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["install, 4 x 1, rank="] = _error(lambda: ar3.load_state_dict(saved_ar, rank=saved_ar["rank"]))
    out["warned"] = [str(w.message) for w in caught if "drops" in str(w.message)]
    out["kept"] = sorted(ar3.state_dict()["tensors"])
    out["trains"] = _train(model, opt, 1, rank)
    tall = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    model, _ = _build(tall)
    rs3 = install_reduce_scatter(model, Compression.thc())
    out["scatter, 1 x 4"] = _error(lambda: rs3.load_state_dict(saved_rs))
    early = Compression.topkc(0.1)  # loaded before install (rank= given: it is this file's rank)
    early.load_state_dict(saved_ar, rank=saved_ar["rank"])
    model, _ = _build(wide)
    out["loaded before install"] = _error(lambda: install(model, early))
    return out


def _compressors(model):
    """(install_reduce_scatter's, install's) compressors of ``model``'s root parameter group."""
    g = model._get_fsdp_state()._fsdp_param_groups[0]
    return g._reduce_scatter_comm.compressor, g._all_reduce_hook.compressor


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(worker, np=4, args=(str(tmp_path_factory.mktemp("fsdp-agree")),), timeout=480)


@pytest.mark.parametrize("case,caller,a,b", [
    ("install spec", "install", "'thc'", "'topkc:ratio=0.1'"),
    ("scatter spec", "install_reduce_scatter", "'thc'", "'thc:bits=2'"),
    ("install per", "install", "per='param'", "per='group'"),
    ("install frozen", "install", "[True, True]", "[True, False]"),
])
def test_mismatch_refused_on_every_rank(four, case, caller, a, b):
    errors = [r[case] for r in four]
    for rank, err in enumerate(errors):
        assert err is not None, f"{case}: rank {rank} installed without an error"
        kind, message = err
        assert kind == "ValueError", err
        assert message.startswith(f"{caller}: the ranks of the "), message
        assert a in message and b in message, message
    # the same message on both ranks of each group
    groups = [(0, 2), (1, 3)] if caller == "install" else [(0, 1), (2, 3)]
    for i, j in groups:
        assert errors[i] == errors[j]


def test_trains_after_refusals(four):
    import numpy as np
    for r in range(1, 4):
        for n in four[0]["after"]:
            np.testing.assert_array_equal(four[r]["after"][n], four[0]["after"][n])


def test_same_mesh_loads(four):
    assert all(r["same mesh"] == (None, None) for r in four), [r["same mesh"] for r in four]


@pytest.mark.parametrize("case,caller,saved,here", [
    ("install, 4 x 1", "install", "[shard ", "[shard 0/1]"),
    ("scatter, 1 x 4", "install_reduce_scatter", "/2]", "/4]"),
    ("loaded before install", "install", "[shard ", "[shard 0/1]"),
])
def test_state_of_another_mesh_refused_on_every_rank(four, case, caller, saved, here):
    for rank, r in enumerate(four):
        err = r[case]
        assert err is not None, f"{case}: rank {rank} loaded a state of another mesh without an error"
        kind, message = err
        assert kind == "ValueError", err
        assert "never makes" in message and "per mesh" in message and "rank=" in message, message
        assert caller in message and saved in message and here in message, message


def test_explicit_rank_drops_with_a_warning(four):
    for rank, r in enumerate(four):
        assert r["install, 4 x 1, rank="] is None, r["install, 4 x 1, rank="]
        assert len(r["warned"]) == 1, r["warned"]
        shard = rank % 2  # the file's shard rank on the 2 x 2 mesh
        assert f"'blk.w[shard {shard}/2]'" in r["warned"][0] and "[shard 0/1]" not in r["warned"][0].split("drops")[1]
        assert r["kept"] == [], r["kept"]  # nothing of the 2 x 2 layout is waiting
    for r in four[1:]:  # and it trains (4 replicas agree)
        for n in r["trains"]:
            assert (r["trains"][n] == four[0]["trains"][n]).all()
