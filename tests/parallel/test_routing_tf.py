"""Routing, grouped all-reduce, rank-0 checkpoints and IndexedSlices in TensorFlow: 2 real
Horovod ranks (Gloo), one launch for every check below.

Known gradients (loss = sum_i <v_i, C_i>, SGD lr 1) through ``hvd.DistributedGradientTape``
inside ``tf.function``; keys are positions ``grad_<j>`` in the sorted variable list.

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

from tests.conftest import requires_backend
from tests.hvdrun import LogRecords, run, value_error

# Sorted names -> keys grad_0..grad_5.
SHAPES = {"dense_bias": (48,), "dense_kernel": (48, 32), "emb_table": (40, 32), "head_kernel": (4, 48),
          "mid_kernel": (16, 32), "norm_scale": (32,)}
NAMES = sorted(SHAPES)
RULES = [("*bias*", "fp16"), ("emb*", "topkc:ratio=0.25,chunk=8"), ("numel>=1500", "powersgd:2")]
ROUTED = "*bias* -> fp16; emb* -> topkc:ratio=0.25,chunk=8; numel>=1500 -> powersgd:rank=2; thc:min_numel=256"
EXPECTED_ROUTES = {"grad_0": "fp16", "grad_1": "powersgd:rank=2", "grad_2": "topkc:ratio=0.25,chunk=8",
                   "grad_3": "fp16", "grad_4": "thc", "grad_5": "fp16"}
PLAIN = {"topkc:ratio=0.25,chunk=8": "topkc:ratio=0.25,chunk=8,min_numel=1", "powersgd:rank=2": "powersgd:rank=2",
         "fp16": "fp16", "thc": "thc:min_numel=1"}


def grad_of(name, rank, step):
    seed = [NAMES.index(name), rank, step, 5]
    return np.random.default_rng(seed).standard_normal(SHAPES[name]).astype(np.float32)


def init_of(name):
    return np.random.default_rng([11, NAMES.index(name)]).standard_normal(SHAPES[name]).astype(np.float32)


def _train(hvd, tf, comp, steps, start=0, values=None, groups=None, route=False):
    variables = [tf.Variable(init_of(n) if values is None else values[n], name=n) for n in NAMES]
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
        step([tf.constant(grad_of(n, hvd.rank(), s)) for n in NAMES])
    return {n: v.numpy().copy() for n, v in zip(NAMES, variables)}


def worker(path):
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    out = {"rank": hvd.rank()}
    records = LogRecords()
    logging.getLogger("hvd_gradcomp").addHandler(records)

    # 1. Names need route(); then each variable goes as its rule says.
    out["unrouted"] = value_error(lambda: _train(hvd, tf, Compression.rules(RULES, default="thc", min_numel=256), 1))
    comp = Compression.rules(RULES, default="thc", min_numel=256)
    out["routed"] = _train(hvd, tf, comp, 3, route=True)
    out["routes"] = comp.routes()
    out["spec"] = comp.spec
    refs = {f"grad_{j}": Compression.from_spec(PLAIN[EXPECTED_ROUTES[f"grad_{j}"]]) for j in range(len(NAMES))}
    values = {n: init_of(n) for n in NAMES}
    for s in range(3):
        for j, n in enumerate(NAMES):
            key = f"grad_{j}"
            reduced = hvd.allreduce(tf.constant(grad_of(n, hvd.rank(), s)), name=key, compression=refs[key],
                                    op=hvd.Average)
            values[n] = values[n] - reduced.numpy()
    out["reference"] = values

    # 2. num_groups=2.
    out["groups"] = {}
    for spec in ("thc", "powersgd:2", ROUTED):
        plain_comp, grouped_comp = Compression.from_spec(spec), Compression.from_spec(spec)
        needs_route = spec == ROUTED
        before = len(records.messages)
        plain = _train(hvd, tf, plain_comp, 3, route=needs_route)
        grouped = _train(hvd, tf, grouped_comp, 3, groups=2, route=needs_route)
        out["groups"][spec] = {
            "max_diff": max(float(np.abs(plain[n] - grouped[n]).max()) for n in NAMES),
            "equal": all(np.array_equal(plain[n], grouped[n]) for n in NAMES),
            "wire": {k: tuple(w) for k, w in plain_comp.wire_bytes().items()},
            "grouped_wire": {k: tuple(w) for k, w in grouped_comp.wire_bytes().items()},
            "warnings": [m for m in records.messages[before:] if "grouped all-reduce" in m]}

    # 3. Names that differ between ranks, routed differently.
    odd = tf.Variable(tf.zeros((48,)), name="x_bias" if hvd.rank() == 0 else "emb_x")
    out["route_differs"] = value_error(lambda: Compression.rules(RULES).route([odd]))

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
    full = _train(hvd, tf, Compression.from_spec(ROUTED), 6, route=True)
    first = Compression.from_spec(ROUTED)
    half = _train(hvd, tf, first, 3, route=True)
    gathered = first.state_dict(gather=True)
    if hvd.rank() == 0:
        with open(path, "wb") as f:
            pickle.dump({"values": half, "compressor": gathered}, f)
    hvd.allreduce(tf.constant(0.0), name="barrier")
    with open(path, "rb") as f:
        saved = pickle.load(f)
    comp = Compression.from_spec(ROUTED)
    comp.load_state_dict(saved["compressor"])
    resumed = _train(hvd, tf, comp, 3, start=3, values=saved["values"], route=True)
    out["resume_equal"] = {n: bool(np.array_equal(full[n], resumed[n])) for n in NAMES}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("ckpt"), "rank0.pkl")
    return run(worker, np=2, args=(path,), timeout=420)


@requires_backend("tensorflow")
def test_name_rules_need_route_and_follow_it(results):
    for r in results:
        assert "call compressor.route(variables) on every rank" in r["unrouted"]
        assert "variable 'dense_bias:0' (gradient 'grad_0') was not given to route()" in r["unrouted"]
        assert r["spec"] == ROUTED and r["routes"] == EXPECTED_ROUTES
        for n in NAMES:
            np.testing.assert_allclose(r["routed"][n], r["reference"][n], rtol=1e-6, atol=1e-6, err_msg=n)
    for n in NAMES:
        assert np.array_equal(results[0]["routed"][n], results[1]["routed"][n])


@requires_backend("tensorflow")
@pytest.mark.parametrize("spec", ["thc", "powersgd:2", ROUTED])
def test_num_groups_gives_the_ungrouped_values(results, spec):
    for r in results:
        g = r["groups"][spec]
        assert g["equal"], g["max_diff"]


@requires_backend("tensorflow")
def test_mixed_groups_widen_and_say_so(results):
    # num_groups=2 splits grad_0..grad_5 into (grad_0, grad_1, grad_2) and (grad_3, grad_4, grad_5).
    widen = {"thc": {"grad_0": 4, "grad_1": 2, "grad_2": 2},  # fp16 + int32 -> float64
             # fp16 + float32 -> float32: vectors and (4, 48) go uncompressed as fp16
             "powersgd:2": {"grad_0": 2, "grad_3": 2, "grad_5": 2},
             ROUTED: {"grad_0": 2, "grad_2": 2, "grad_3": 4, "grad_4": 2, "grad_5": 4}}
    for r in results:
        for spec, factors in widen.items():
            g = r["groups"][spec]
            for key, (payload, side, count) in g["wire"].items():
                assert g["grouped_wire"][key] == (payload * factors.get(key, 1), side, count), (spec, key)
        assert len(r["groups"]["thc"]["warnings"]) == 1
        assert "grad_0 (float16), grad_1 (int32), grad_2 (int32)" in r["groups"]["thc"]["warnings"][0]
        assert "travel as float64" in r["groups"]["thc"]["warnings"][0]
        assert len(r["groups"][ROUTED]["warnings"]) == 2


@requires_backend("tensorflow")
def test_rank_dependent_names_refused_on_every_rank(results):
    assert "rank 0: 'x_bias:0' -> fp16 (rule 0 '*bias*')" in results[0]["route_differs"]
    for r in results:
        assert r["route_differs"] == results[0]["route_differs"]
        assert "rank 1: 'emb_x:0' -> topkc:ratio=0.25,chunk=8 (rule 1 'emb*')" in r["route_differs"]


@requires_backend("tensorflow")
def test_indexed_slices_counted_and_warned_once(results):
    nbytes = 6 * 8 * 4 + 6 * 4  # float32 values [6, 8], int32 indices [6]
    for r in results:
        s = r["sparse"]
        payload, side, collectives, sparse, sparse_collectives = s["bytes"]
        assert (sparse, sparse_collectives) == (nbytes, 2) and payload > 0
        assert s["per_tensor"] == {"grad_0": nbytes}
        assert s["metrics"] == {"sparse_bytes": nbytes, "sparse_steps": 2}
        assert len(s["warnings"]) == 1 and s["warnings"][0].startswith("hvd_gradcomp: grad_0 (table:0) has a sparse")


@requires_backend("tensorflow")
def test_rank0_checkpoint_resumes_exactly(results):
    for r in results:
        assert r["resume_equal"] == {n: True for n in NAMES}
