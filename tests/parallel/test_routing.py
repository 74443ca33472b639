"""Routing, grouped all-reduce, rank-0 checkpoints and sparse gradients under real Horovod
(2 ranks, Gloo), in both frameworks: one PyTorch launch and one TensorFlow launch, each running
every check of its part.

PyTorch (``worker``, ``results``). Known gradients (loss = sum_i <p_i, C_i>, SGD lr 1): each
parameter ends at ``init - sum of decompressed outputs``.

1. A routed compressor (``Compression.rules``) under ``hvd.DistributedOptimizer`` gives every
   parameter exactly (bitwise) what a plain compressor of its route gives the same gradients
   through ``hvd.allreduce(name=<parameter name>)``; routes, wire bytes and state follow.
2. ``groups=2`` (plain powersgd, the routed compressor) changes no value; plain thc's group
   goes as one bucket (other values).
3. Rank-0 checkpoint: ``state_dict(gather=True)``, saved by rank 0 only, loaded on every rank,
   resumes exactly (bitwise) as 6 uninterrupted steps (thc, topkc and powersgd error
   feedback); rank 0's per-rank dict loaded on rank 1 is refused; a gathered state of 3 ranks
   loaded on 2 keeps rank 0's agreed fields with zero residuals; a route that differs from the
   checkpoint's is refused at the tensor's first compress.
4. ``route()`` that differs between ranks raises on every rank, naming both. A vector PowerSGD
   does not accept goes as fp16 (bitwise what ``Compression.fp16()`` sends), also when a
   checkpoint recorded powersgd for it (and its warm-up counter: dropped); with
   ``uncompressed_dtype=float32`` as a float32
   payload, also for float16 and bfloat16 gradients (summed in float32, cast back).
5. A sparse embedding gradient: one warning naming it, its bytes in ``bytes_per_step().sparse``
   and ``metrics()``; in the ``groups=`` path a clear ValueError.

TensorFlow (``worker_tf``, ``results_tf``; its constants ``TF_*``). Known gradients (loss =
sum_i <v_i, C_i>, SGD lr 1) through ``hvd.DistributedGradientTape`` inside ``tf.function``;
keys are positions ``grad_<j>`` in the sorted variable list.

1. Rules on variable names without ``route()`` raise at the first trace, on every rank, naming
   the variable; with ``route()`` every variable gets the scheme its rule names, and its
   values equal a plain compressor of that route through ``hvd.allreduce(name="grad_<j>")``.
2. ``num_groups=2`` (plain thc: int32 with fp16; plain powersgd: float32 with fp16; the routed
   compressor) gives the values of the ungrouped run; the mixed groups travel as float64 or
   float32 (``wire_bytes`` says so, one warning per group).
3. Variable names that differ between ranks so that the routes differ: ``route()`` raises on
   every rank.
4. An ``IndexedSlices`` gradient (no ``sparse_as_dense``): one warning naming it, its bytes in
   ``bytes_per_step().sparse`` and ``metrics()``, counted in graph.
5. Rank-0 checkpoint: ``state_dict(gather=True)`` pickled by rank 0, loaded on every rank,
   resumes exactly as 6 uninterrupted steps.
"""
import logging
import os
import pickle

import numpy as np
import pytest

from tests.backends import requires_backend
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
    # PowerSGD refuses a vector (accepts): routed to fp16, bitwise what fp16 sends; a
    # checkpoint that recorded powersgd for it still loads.
    psgd, fp16 = Compression.powersgd(2), Compression.fp16()
    bias = torch.arange(48, dtype=torch.float32) * (0.1 + hvd.rank())
    out["refused"] = (hvd.allreduce(bias, name="p.bias", compression=psgd).numpy(),
                      hvd.allreduce(bias, name="p.bias", compression=fp16).numpy(),
                      psgd.routes(), {k: tuple(w) for k, w in psgd.wire_bytes().items()},
                      psgd.route([("p.bias", bias), ("p.weight", torch.zeros(48, 32))]))
    resumed = Compression.powersgd(2)
    resumed.load_state_dict({"spec": "powersgd:rank=2", "tensors": {}, "routes": {"p.bias": "powersgd:rank=2"},
                             "rank": hvd.rank(), "world_size": hvd.size()})
    out["refused_resume"] = hvd.allreduce(bias, name="p.bias", compression=resumed).numpy()
    # A checkpoint from before the routing took refused tensors away from PowerSGD (81348b7):
    # its warm-up wrapper kept a counter for the vector, the state of the scheme that now
    # refuses it; it is dropped (fp16 keeps none), whether the vector was seen before the
    # load or not, and not saved again.
    old = {"spec": "powersgd:rank=2,fp16_warmup=2", "routes": {"p.bias": "powersgd:rank=2,fp16_warmup=2"},
           "tensors": {"p.bias": {"warmup": torch.tensor(-1)}}, "rank": hvd.rank(), "world_size": hvd.size()}
    out["old_warmup"] = []
    for seen in (False, True):
        comp = Compression.powersgd(2, fp16_warmup=2)
        if seen:
            hvd.allreduce(bias, name="p.bias", compression=comp)
        comp.load_state_dict(old)
        out["old_warmup"].append((hvd.allreduce(bias, name="p.bias", compression=comp).numpy(), comp.routes(),
                                  sorted(comp.state_dict()["tensors"])))
    # With uncompressed_dtype=float32 the refused vector travels as float32 whatever its dtype
    # (Horovod's PyTorch collectives refuse bfloat16): its sum in float32, cast back; wire 4 d.
    out["refused_float32"] = {}
    for dtype in ("float16", "bfloat16", "float32"):
        wide = Compression.from_spec("powersgd:2,uncompressed_dtype=float32")
        got = hvd.allreduce(bias.to(getattr(torch, dtype)), name="p.bias", compression=wide, op=hvd.Sum)
        out["refused_float32"][dtype] = (str(got.dtype), got.float().numpy(), wide.routes(),
                                         {k: tuple(w) for k, w in wide.wire_bytes().items()})

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
    """PyTorch groups= where each route has one tensor a group (PowerSGD's matrices, the routed
    compressor) change no value; thc's tensors of a group go as one flat vector (buckets.py:
    other values, within THC's error; tests/parallel/test_horovod_buckets.py)."""
    for r in results:
        assert r["groups"] == {"thc": False, "powersgd:2": True, ROUTED: True}


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
        by_psgd, by_fp16, routes, wire, table = r["refused"]
        assert np.array_equal(by_psgd, by_fp16) and np.array_equal(r["refused_resume"], by_fp16)
        assert routes == {"p.bias": "fp16"} and wire == {"p.bias": (96, 0, 0)}
        assert table == [("p.bias", "fp16"), ("p.weight", "powersgd:rank=2")]
        for got, routes, saved in r["old_warmup"]:
            assert np.array_equal(got, by_fp16) and routes == {"p.bias": "fp16"} and saved == []
        import torch
        for dtype, (got_dtype, got, routes, wire) in r["refused_float32"].items():
            rounded = sum((torch.arange(48, dtype=torch.float32) * (0.1 + rank)).to(getattr(torch, dtype)).double()
                          for rank in range(2))  # float64 reference of the ranks' values
            assert got_dtype == f"torch.{dtype}", dtype
            np.testing.assert_array_equal(got, rounded.to(getattr(torch, dtype)).float().numpy(), err_msg=dtype)
            assert routes == {"p.bias": "none:dtype=float32"} and wire == {"p.bias": (192, 0, 0)}, dtype


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


# ---------------------------------------------------------------- TensorFlow
# Sorted names -> keys grad_0..grad_5.
TF_SHAPES = {"dense_bias": (48,), "dense_kernel": (48, 32), "emb_table": (40, 32), "head_kernel": (4, 48),
          "mid_kernel": (16, 32), "norm_scale": (32,)}
TF_NAMES = sorted(TF_SHAPES)
TF_RULES = [("*bias*", "fp16"), ("emb*", "topkc:ratio=0.25,chunk=8"), ("numel>=1500", "powersgd:2")]
TF_ROUTED = "*bias* -> fp16; emb* -> topkc:ratio=0.25,chunk=8; numel>=1500 -> powersgd:rank=2; thc:min_numel=256"
TF_EXPECTED_ROUTES = {"grad_0": "fp16", "grad_1": "powersgd:rank=2", "grad_2": "topkc:ratio=0.25,chunk=8",
                   "grad_3": "fp16", "grad_4": "thc", "grad_5": "fp16"}


def tf_grad_of(name, rank, step):
    seed = [TF_NAMES.index(name), rank, step, 5]
    return np.random.default_rng(seed).standard_normal(TF_SHAPES[name]).astype(np.float32)


def tf_init_of(name):
    return np.random.default_rng([11, TF_NAMES.index(name)]).standard_normal(TF_SHAPES[name]).astype(np.float32)


def _train_tf(hvd, tf, comp, steps, start=0, values=None, groups=None, route=False):
    variables = [tf.Variable(tf_init_of(n) if values is None else values[n], name=n) for n in TF_NAMES]
    if route:
        comp.route(variables)

    @tf.function
    def step(consts):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, consts)])
        grads = hvd.DistributedGradientTape(tape, compression=comp, num_groups=groups or 0).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(g)

    for s in range(start, start + steps):
        step([tf.constant(tf_grad_of(n, hvd.rank(), s)) for n in TF_NAMES])
    return {n: v.numpy().copy() for n, v in zip(TF_NAMES, variables)}


def worker_tf(path):
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    out = {"rank": hvd.rank()}
    records = LogRecords()
    logging.getLogger("hvd_gradcomp").addHandler(records)

    # 1. Names need route(); then each variable goes as its rule says.
    out["unrouted"] = value_error(lambda: _train_tf(hvd, tf, Compression.rules(TF_RULES, default="thc", min_numel=256), 1))
    comp = Compression.rules(TF_RULES, default="thc", min_numel=256)
    out["routed"] = _train_tf(hvd, tf, comp, 3, route=True)
    out["routes"] = comp.routes()
    out["spec"] = comp.spec
    refs = {f"grad_{j}": Compression.from_spec(PLAIN[TF_EXPECTED_ROUTES[f"grad_{j}"]]) for j in range(len(TF_NAMES))}
    values = {n: tf_init_of(n) for n in TF_NAMES}
    for s in range(3):
        for j, n in enumerate(TF_NAMES):
            key = f"grad_{j}"
            reduced = hvd.allreduce(tf.constant(tf_grad_of(n, hvd.rank(), s)), name=key, compression=refs[key],
                                    op=hvd.Average)
            values[n] = values[n] - reduced.numpy()
    out["reference"] = values

    # 2. num_groups=2.
    out["groups"] = {}
    for spec in ("thc", "powersgd:2", TF_ROUTED):
        plain_comp, grouped_comp = Compression.from_spec(spec), Compression.from_spec(spec)
        needs_route = spec == TF_ROUTED
        before = len(records.messages)
        plain = _train_tf(hvd, tf, plain_comp, 3, route=needs_route)
        grouped = _train_tf(hvd, tf, grouped_comp, 3, groups=2, route=needs_route)
        out["groups"][spec] = {
            "max_diff": max(float(np.abs(plain[n] - grouped[n]).max()) for n in TF_NAMES),
            "equal": all(np.array_equal(plain[n], grouped[n]) for n in TF_NAMES),
            "wire": {k: tuple(w) for k, w in plain_comp.wire_bytes().items()},
            "grouped_wire": {k: tuple(w) for k, w in grouped_comp.wire_bytes().items()},
            "warnings": [m for m in records.messages[before:] if "grouped all-reduce" in m]}

    # 3. Names that differ between ranks, routed differently.
    odd = tf.Variable(tf.zeros((48,)), name="x_bias" if hvd.rank() == 0 else "emb_x")
    out["route_differs"] = value_error(lambda: Compression.rules(TF_RULES).route([odd]))

    # 4. IndexedSlices.
    table = tf.Variable(tf.ones((50, 8)), name="table")
    w = tf.Variable(tf.ones((8, 4)), name="w")
    comp = Compression.thc()

    @tf.function
    def sparse_step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.gather(table, ids), w))
        grads = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [table, w])
        table.assign_sub(0.1 * tf.convert_to_tensor(grads[0]))
        w.assign_sub(0.1 * grads[1])

    before = len(records.messages)
    for _ in range(2):
        sparse_step(tf.constant([1, 2, 3, 4, 5, 6 + hvd.rank()]))
    out["sparse"] = {"bytes": tuple(comp.bytes_per_step()), "per_tensor": comp.sparse_bytes(),
                     "metrics": comp.metrics().get("grad_0"),
                     "warnings": [m for m in records.messages[before:] if "sparse gradient" in m]}

    # 5. Rank-0 checkpoint.
    full = _train_tf(hvd, tf, Compression.from_spec(TF_ROUTED), 6, route=True)
    first = Compression.from_spec(TF_ROUTED)
    half = _train_tf(hvd, tf, first, 3, route=True)
    gathered = first.state_dict(gather=True)
    if hvd.rank() == 0:
        with open(path, "wb") as f:
            pickle.dump({"values": half, "compressor": gathered}, f)
    hvd.allreduce(tf.constant(0.0), name="barrier")
    with open(path, "rb") as f:
        saved = pickle.load(f)
    comp = Compression.from_spec(TF_ROUTED)
    comp.load_state_dict(saved["compressor"])
    resumed = _train_tf(hvd, tf, comp, 3, start=3, values=saved["values"], route=True)
    out["resume_equal"] = {n: bool(np.array_equal(full[n], resumed[n])) for n in TF_NAMES}
    return out


@pytest.fixture(scope="module")
def results_tf(tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("ckpt"), "rank0.pkl")
    return run(worker_tf, np=2, args=(path,), timeout=420)


@requires_backend("tensorflow")
def test_name_rules_need_route_and_follow_it(results_tf):
    for r in results_tf:
        assert "call compressor.route(variables) on every rank" in r["unrouted"]
        assert "variable 'dense_bias:0' (gradient 'grad_0') was not given to route()" in r["unrouted"]
        assert r["spec"] == TF_ROUTED and r["routes"] == TF_EXPECTED_ROUTES
        for n in TF_NAMES:
            np.testing.assert_allclose(r["routed"][n], r["reference"][n], rtol=1e-6, atol=1e-6, err_msg=n)
    for n in TF_NAMES:
        assert np.array_equal(results_tf[0]["routed"][n], results_tf[1]["routed"][n])


@requires_backend("tensorflow")
@pytest.mark.parametrize("spec", ["thc", "powersgd:2", TF_ROUTED])
def test_num_groups_gives_the_ungrouped_values(results_tf, spec):
    for r in results_tf:
        g = r["groups"][spec]
        assert g["equal"], g["max_diff"]


@requires_backend("tensorflow")
def test_mixed_groups_widen_and_say_so(results_tf):
    # num_groups=2 splits grad_0..grad_5 into (grad_0, grad_1, grad_2) and (grad_3, grad_4, grad_5).
    widen = {"thc": {"grad_0": 4, "grad_1": 2, "grad_2": 2},  # fp16 + int32 -> float64
             # fp16 + float32 -> float32: vectors and (4, 48) go uncompressed as fp16
             "powersgd:2": {"grad_0": 2, "grad_3": 2, "grad_5": 2},
             TF_ROUTED: {"grad_0": 2, "grad_2": 2, "grad_3": 4, "grad_4": 2, "grad_5": 4}}
    for r in results_tf:
        for spec, factors in widen.items():
            g = r["groups"][spec]
            for key, (payload, side, count) in g["wire"].items():
                assert g["grouped_wire"][key] == (payload * factors.get(key, 1), side, count), (spec, key)
        assert len(r["groups"]["thc"]["warnings"]) == 1
        assert "grad_0 (float16), grad_1 (int32), grad_2 (int32)" in r["groups"]["thc"]["warnings"][0]
        assert "travel as float64" in r["groups"]["thc"]["warnings"][0]
        assert len(r["groups"][TF_ROUTED]["warnings"]) == 2


@requires_backend("tensorflow")
def test_rank_dependent_names_refused_on_every_rank(results_tf):
    assert "rank 0: 'x_bias:0' -> fp16 (rule 0 '*bias*')" in results_tf[0]["route_differs"]
    for r in results_tf:
        assert r["route_differs"] == results_tf[0]["route_differs"]
        assert "rank 1: 'emb_x:0' -> topkc:ratio=0.25,chunk=8 (rule 1 'emb*')" in r["route_differs"]


@requires_backend("tensorflow")
def test_indexed_slices_counted_and_warned_once(results_tf):
    nbytes = 6 * 8 * 4 + 6 * 4  # float32 values [6, 8], int32 indices [6]
    for r in results_tf:
        s = r["sparse"]
        payload, side, collectives, sparse, sparse_collectives = s["bytes"]
        assert (sparse, sparse_collectives) == (nbytes, 2) and payload > 0
        assert s["per_tensor"] == {"grad_0": nbytes}
        assert s["metrics"] == {"sparse_bytes": nbytes, "sparse_steps": 2}
        assert len(s["warnings"]) == 1 and s["warnings"][0].startswith("hvd_gradcomp: grad_0 (table:0) has a sparse")


@requires_backend("tensorflow")
def test_tf_rank0_checkpoint_resumes_exactly(results_tf):
    for r in results_tf:
        assert r["resume_equal"] == {n: True for n in TF_NAMES}
