"""Routing, grouped all-reduce, rank-0 checkpoints and sparse gradients in PyTorch: 2 real
Horovod ranks (Gloo), one launch for every check below.

Known gradients (loss = sum_i <p_i, C_i>, SGD lr 1): each parameter ends at
``init - sum of decompressed outputs``.

1. A routed compressor (``Compression.rules``) under ``hvd.DistributedOptimizer`` gives every
   parameter exactly (bitwise) what a plain compressor of its route gives the same gradients
   through ``hvd.allreduce(name=<parameter name>)``; routes, wire bytes and state follow.
2. ``groups=2`` (plain thc, plain powersgd, the routed compressor) changes no value.
3. Rank-0 checkpoint: ``state_dict(gather=True)``, saved by rank 0 only, loaded on every rank,
   resumes exactly (bitwise) as 6 uninterrupted steps (thc, topkc and powersgd error
   feedback); rank 0's per-rank dict loaded on rank 1 is refused; a gathered state of 3 ranks
   loaded on 2 keeps rank 0's agreed fields with zero residuals; a route that differs from the
   checkpoint's is refused at the tensor's first compress.
4. ``route()`` that differs between ranks raises on every rank, naming both.
5. A sparse embedding gradient: one warning naming it, its bytes in ``bytes_per_step().sparse``
   and ``metrics()``; in the ``groups=`` path a clear ValueError.
"""
import logging
import os

import numpy as np
import pytest

from tests.hvdrun import LogRecords, run, value_error

# name -> shape; routes under RULES: embed -> topkc (rule 1), fc.weight -> powersgd (rule 2,
# numel >= 1500), fc.bias -> fp16 (rule 0), mid.weight -> thc (default, 512 >= 256),
# norm.weight and head.weight -> fp16 (below min_numel=256).
SHAPES = {"embed.weight": (40, 32), "fc.weight": (48, 32), "fc.bias": (48,), "mid.weight": (16, 32),
          "norm.weight": (32,), "head.weight": (4, 48)}
RULES = [("*.bias", "fp16"), ("*embed*", "topkc:ratio=0.25,chunk=8"), ("numel>=1500", "powersgd:2")]
ROUTED = "*.bias -> fp16; *embed* -> topkc:ratio=0.25,chunk=8; numel>=1500 -> powersgd:rank=2; thc:min_numel=256"
EXPECTED_ROUTES = {"embed.weight": "topkc:ratio=0.25,chunk=8", "fc.weight": "powersgd:rank=2",
                   "fc.bias": "fp16", "mid.weight": "thc", "norm.weight": "fp16", "head.weight": "fp16"}
# The plain compressor each route equals (min_numel=1: the routing already decided).
PLAIN = {"topkc:ratio=0.25,chunk=8": "topkc:ratio=0.25,chunk=8,min_numel=1", "powersgd:rank=2": "powersgd:rank=2",
         "fp16": "fp16", "thc": "thc:min_numel=1"}


def grad_of(name, rank, step):
    seed = [sorted(SHAPES).index(name), rank, step]
    return np.random.default_rng(seed).standard_normal(SHAPES[name]).astype(np.float32)


def init_of(name):
    return np.random.default_rng([7, sorted(SHAPES).index(name)]).standard_normal(SHAPES[name]).astype(np.float32)


def _module(torch, params=None):
    root = torch.nn.Module()
    for name in sorted(SHAPES):
        mod, leaf = name.split(".")
        if not hasattr(root, mod):
            setattr(root, mod, torch.nn.Module())
        value = init_of(name) if params is None else params[name]
        setattr(getattr(root, mod), leaf, torch.nn.Parameter(torch.tensor(value)))
    return root


def _train(hvd, torch, comp, steps, start=0, params=None, **opt_kwargs):
    module = _module(torch, params)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=1.0),
                                   named_parameters=module.named_parameters(), compression=comp, **opt_kwargs)
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = sum((p * torch.tensor(grad_of(n, hvd.rank(), step))).sum() for n, p in module.named_parameters())
        loss.backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def worker(path):
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    out = {"rank": hvd.rank()}
    records = LogRecords()
    logging.getLogger("hvd_gradcomp").addHandler(records)

    # 1. Routed training against plain compressors per route, via hvd.allreduce.
    comp = Compression.rules(RULES, default="thc", min_numel=256)
    out["spec"] = comp.spec
    out["routed"] = _train(hvd, torch, comp, 3)
    out["routes"] = comp.routes()
    out["wire"] = {k: tuple(w) for k, w in comp.wire_bytes().items()}
    out["bytes"] = tuple(comp.bytes_per_step())
    out["state_keys"] = sorted(comp.state_dict()["tensors"])
    refs = {n: Compression.from_spec(PLAIN[EXPECTED_ROUTES[n]]) for n in SHAPES}
    params = {n: torch.tensor(init_of(n)) for n in SHAPES}
    for step in range(3):
        for n in sorted(SHAPES):
            g = torch.tensor(grad_of(n, hvd.rank(), step))
            params[n] = params[n] - hvd.allreduce(g, name=n, compression=refs[n], op=hvd.Average)
    out["reference"] = {n: v.numpy().copy() for n, v in params.items()}
    out["reference_wire"] = {n: tuple(refs[n].wire_bytes()[n]) for n in SHAPES}

    # 2. groups=2 changes no value.
    out["groups"] = {}
    for spec in ("thc", "powersgd:2", ROUTED):
        plain = _train(hvd, torch, Compression.from_spec(spec), 3)
        grouped = _train(hvd, torch, Compression.from_spec(spec), 3, groups=2)
        out["groups"][spec] = all(np.array_equal(plain[n], grouped[n]) for n in SHAPES)

    # 3. Rank-0 checkpoint of the routed compressor (thc, topkc and powersgd error feedback).
    full = _train(hvd, torch, Compression.from_spec(ROUTED), 6)
    first = Compression.from_spec(ROUTED)
    half = _train(hvd, torch, first, 3)
    gathered = first.state_dict(gather=True)
    per_rank = first.state_dict()
    if hvd.rank() == 0:
        torch.save({"params": {n: torch.tensor(v) for n, v in half.items()}, "compressor": gathered}, path)
    hvd.barrier()
    saved = torch.load(path)  # weights_only: the gathered state is tensors, dicts, lists, str, int
    resumed_comp = Compression.from_spec(ROUTED)
    resumed_comp.load_state_dict(saved["compressor"])
    resumed = _train(hvd, torch, resumed_comp, 3, start=3, params={n: v.numpy() for n, v in saved["params"].items()})
    out["resume_equal"] = {n: bool(np.array_equal(full[n], resumed[n])) for n in SHAPES}
    out["gathered_layout"] = (gathered["world_size"], [p["rank"] for p in gathered["ranks"]],
                              sorted(gathered["ranks"][0]["routes"].items()))
    # The usual habit with a per-rank dict: rank 0's, loaded everywhere.
    rank0 = hvd.broadcast_object(per_rank, root_rank=0, name="rank0_state")
    out["naive"] = value_error(lambda: Compression.from_spec(ROUTED).load_state_dict(rank0))
    out["naive_forced"] = value_error(lambda: Compression.from_spec(ROUTED).load_state_dict(rank0, rank=0))
    # Elastic: a gathered state of 3 ranks loaded on 2.
    three = dict(gathered, world_size=3, ranks=gathered["ranks"] + [gathered["ranks"][1]])
    elastic = Compression.from_spec(ROUTED)
    elastic.load_state_dict(three)
    loaded = elastic.state_dict()["tensors"]
    out["elastic"] = {key: {f: (v.numpy().copy(), gathered["ranks"][0]["tensors"][key][f].numpy().copy())
                            for f, v in fields.items()} for key, fields in loaded.items()}
    # A route that differs from the checkpoint's: head.weight was fp16 (192 < 256), now 512.
    moved = Compression.from_spec(ROUTED)
    moved.load_state_dict(gathered)
    out["route_mismatch"] = value_error(lambda: moved.compress(torch.zeros(16, 32), name="head.weight"))
    out["spec_mismatch"] = value_error(lambda: Compression.thc().load_state_dict(gathered))

    # 4. route(): the same table on every rank, or a ValueError on every rank.
    comp = Compression.rules(RULES, default="thc", min_numel=256)
    out["route_table"] = comp.route(_module(torch).named_parameters())
    name = "fc.bias" if hvd.rank() == 0 else "embed.bias2"  # rule 0 on rank 0, rule 1 on rank 1
    out["route_differs"] = value_error(lambda: comp.route([(name, torch.zeros(48))]))
    out["no_name"] = value_error(lambda: Compression.rules(RULES).compress(torch.ones(8)))
    small = Compression.topk(0.5, min_numel=100)
    for numel in (64, 128):
        hvd.allreduce(torch.ones(numel), name=f"t{numel}", compression=small)
    out["topk_min_numel"] = (small.routes(), {k: tuple(w) for k, w in small.wire_bytes().items()}, small.spec)

    # 5. A sparse embedding gradient.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 4))
    named = [("emb.weight", model[0].weight), ("lin.weight", model[1].weight), ("lin.bias", model[1].bias)]
    comp = Compression.thc()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=comp)
    before = len(records.messages)
    for step in range(2):
        opt.zero_grad()
        ids = torch.tensor([[1, 2, 3], [4, 5, 6 + hvd.rank()]])
        model(ids).sum().backward()
        opt.step()
    out["sparse"] = {"bytes": tuple(comp.bytes_per_step()), "per_tensor": comp.sparse_bytes(),
                     "metrics": comp.metrics().get("emb.weight"),
                     "warnings": [m for m in records.messages[before:] if "emb.weight" in m],
                     "weights_equal": float(model[0].weight.detach().abs().sum())}
    # A fresh model: the first optimizer's hooks must not fire (and post collectives) again.
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 4))
    named = [("emb.weight", model[0].weight), ("lin.weight", model[1].weight), ("lin.bias", model[1].bias)]
    grouped = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                       compression=Compression.thc(), groups=1)  # kept: it owns the hooks
    out["sparse_groups"] = value_error(lambda: model(torch.tensor([[1, 2]])).sum().backward())
    del grouped
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("ckpt"), "rank0.pt")
    return run(worker, np=2, args=(path,), timeout=300)


def test_routed_training_equals_plain_compressor_per_route(results):
    for r in results:
        assert r["spec"] == ROUTED
        assert r["routes"] == EXPECTED_ROUTES
        for n in SHAPES:
            assert np.array_equal(r["routed"][n], r["reference"][n]), n
        assert r["wire"] == r["reference_wire"]
        assert r["bytes"] == (sum(w[0] for w in r["wire"].values()), 0, 0, 0, 0)
        assert r["state_keys"] == ["embed.weight", "fc.weight", "mid.weight"]  # fp16 routes keep none
    assert all(np.array_equal(results[0]["routed"][n], results[1]["routed"][n]) for n in SHAPES)


def test_groups_change_no_value(results):
    for r in results:
        assert r["groups"] == {"thc": True, "powersgd:2": True, ROUTED: True}


def test_rank0_checkpoint_resumes_exactly(results):
    for r in results:
        assert r["resume_equal"] == {n: True for n in SHAPES}
        world, ranks, routes = r["gathered_layout"]
        assert (world, ranks) == (2, [0, 1]) and dict(routes) == EXPECTED_ROUTES


def test_rank0_per_rank_dict_refused_on_other_ranks(results):
    assert results[0]["naive"] is None and results[0]["naive_forced"] is None
    message = results[1]["naive"]
    assert message.startswith("load_state_dict: this state_dict holds rank 0's state") and "gather=True" in message
    assert results[1]["naive_forced"] is None  # rank=0 on purpose


def test_elastic_load_keeps_agreed_fields_and_resets_residuals(results):
    for r in results:
        assert set(r["elastic"]) == {"embed.weight", "fc.weight", "mid.weight"}
        for key, fields in r["elastic"].items():
            for field, (got, saved) in fields.items():
                if field == "residual":
                    assert got.shape == saved.shape and not got.any() and saved.any(), key
                else:
                    np.testing.assert_array_equal(got, saved, err_msg=f"{key} {field}")


def test_route_and_spec_mismatch_refused(results):
    for r in results:
        assert r["route_mismatch"].endswith("tensor 'head.weight' was routed to 'fp16' in the checkpoint, and this "
                                            "compressor routes it to 'thc' (default); load the checkpoint into a "
                                            "compressor whose rules route it alike")
        assert r["spec_mismatch"].startswith(f"state_dict was saved by compressor {ROUTED!r}")


def test_route_table_and_rank_dependent_routing(results):
    for r in results:
        assert r["route_table"] == [(n, EXPECTED_ROUTES[n]) for n in sorted(SHAPES)]
        message = r["route_differs"]
        assert "the ranks route parameter 0 differently" in message
        assert "rank 0: 'fc.bias' -> fp16 (rule 0 '*.bias')" in message
        assert "rank 1: 'embed.bias2' -> topkc:ratio=0.25,chunk=8 (rule 1 '*embed*')" in message
        assert "rules match tensor names, and this tensor has none" in r["no_name"]
        routes, wire, spec = r["topk_min_numel"]
        assert routes == {"t64": "fp16", "t128": "topk:ratio=0.5"} and spec == "topk:ratio=0.5,min_numel=100"
        assert wire == {"t64": (128, 0, 0), "t128": (512, 0, 0)}


def test_sparse_gradient_counted_and_warned_once(results):
    # This rank's part: 6 lookups, int64 indices [1, 6] and float32 values [6, 8].
    nbytes = 6 * 8 + 6 * 8 * 4
    for r in results:
        s = r["sparse"]
        payload, side, collectives, sparse, sparse_collectives = s["bytes"]
        assert (sparse, sparse_collectives) == (nbytes, 2) and payload > 0 and side == collectives == 0
        assert s["per_tensor"] == {"emb.weight": nbytes}
        assert s["metrics"] == {"sparse_bytes": nbytes, "sparse_steps": 2}
        assert len(s["warnings"]) == 1 and "Horovod's sparse path sends its indices and values uncompressed" in s["warnings"][0]
        assert "sparse_as_dense=True" in r["sparse_groups"] and "'emb.weight'" in r["sparse_groups"]
    assert results[0]["sparse"]["weights_equal"] == results[1]["sparse"]["weights_equal"]
