"""Real-Horovod scenarios that have hung or given wrong values (issue 10): each must complete.

Every scenario is one launch (``tests.hvdrun.run`` with a hard timeout of
:data:`LAUNCH_TIMEOUT` s, so a hang fails fast) running every compressor spec in turn with a
fresh compressor per optimizer; each rank writes its result per spec as soon as it has it, so
the specs finished before a hang (or an exception) are still checked, and the spec that was
running when the launch died is the one that fails, with the launch's error (for a timeout:
every rank's Python stack). ``BASELINE`` (Horovod without a compressor) runs first where it
tells whether Horovod itself copes with the scenario.

Scenarios: (a) unused heads (their gradients filled in by Horovod's ``synchronize()``, in an
order that differs between ranks); (b) a rank-dependent graph; (c) process sets of one rank;
(d) two process sets summing separately (4 ranks); (e) ``hvd.join()`` with 3 ranks;
(f) TensorFlow layer names that differ between ranks; (g) compressor state loaded on rank 0
only.

Observed Horovod 0.28.1 convention (scenario (e), asserted by
``test_join_average_convention``): under ``hvd.join()``, ``op=Average`` divides the sum of
the ranks that did contribute by the size of the whole process set, **joined ranks included**
(3 here, not the 2 contributors): Horovod's C++ core turns Average into
``postscale_factor /= process_set size`` when the op is enqueued, and a joined rank adds
zeros. The compressed schemes must give the same: ``(x0 + x1) / 3``.

Observed Horovod 0.28.1 fact (scenario (f)): without a compressor, ``DistributedGradientTape``
inside ``tf.function`` names each all-reduce after the gradient's op name
(``HorovodAllreduce_gradient_tape_dense_1_BiasAdd_...``), which carries the layer name, so when
layer names differ between ranks Horovod itself waits forever for names that never match
(unless ``tape.gradient(..., use_generic_names=True)``). So (f) has no ``BASELINE``. With a
compressor, Horovod all-reduces the compressor's payload instead, and neither its name nor
the compressor's own keys and collectives may depend on the variables' names.
"""
import os
import pickle
import tempfile
import traceback

import numpy as np
import pytest

from tests.hvdrun import run

LAUNCH_TIMEOUT = 120
SPECS = ["fp16", "topkc:ratio=0.25,chunk=8", "thc", "powersgd:rank=2"]
EXACT = "topkc:ratio=1"  # top-k keeping every chunk: lossless selection, fp16 payload
VALUE_SPECS = SPECS + [EXACT]
BASELINE = "horovod"  # Horovod's own path, no compression argument
# Relative L2 error bounds of an all-reduce output against the float64 reference, by spec;
# the other specs are lossy by design: outputs must agree across ranks and be finite.
TOL = {"fp16": 0.01, "thc": 0.6, EXACT: 0.01, BASELINE: 1e-6}
SHAPE = (50, 100)  # the known all-reduced tensors: 5000 coordinates, a matrix for PowerSGD
JOIN_AVERAGE_DIVISOR = 3  # the Horovod 0.28.1 fact this module's docstring states


# ---------------------------------------------------------------- shared helpers

def known(rank, step, salt=0, shape=SHAPE):
    """The float32 tensor rank ``rank`` all-reduces at ``step``."""
    return np.random.default_rng([salt, rank, step]).standard_normal(shape).astype(np.float32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _rank():
    return int(os.environ["HOROVOD_RANK"])


def _each_spec(specs, outdir, body):
    """Worker side: ``body(spec)`` for each spec; its value (or exception) saved at once."""
    rank = _rank()
    for i, spec in enumerate(specs):
        print(f"[test_adapter_hangs] rank {rank}: {spec} started", flush=True)
        open(os.path.join(outdir, f"start-{rank}-{i}"), "w").close()
        try:
            rec = {"ok": True, "value": body(spec)}
        except Exception as e:  # noqa: BLE001 - reported per spec, the next spec still runs
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        with open(os.path.join(outdir, f"done-{rank}-{i}.part"), "wb") as f:
            pickle.dump(rec, f)
        os.replace(os.path.join(outdir, f"done-{rank}-{i}.part"), os.path.join(outdir, f"done-{rank}-{i}"))
        print(f"[test_adapter_hangs] rank {rank}: {spec} {'done' if rec['ok'] else 'raised ' + rec['error']}",
              flush=True)


class Launch:
    """One launch of ``worker(specs, outdir)`` on ``np`` ranks; per-spec results by rank."""

    def __init__(self, worker, np, specs):
        self.np, self.specs, self.error = np, list(specs), None
        self.done, self.started = {}, set()
        with tempfile.TemporaryDirectory(prefix="test-hangs-") as outdir:
            try:
                run(worker, np=np, args=(self.specs, outdir), timeout=LAUNCH_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - each spec's test reports it
                self.error = e
            for name in os.listdir(outdir):
                kind, rank, i = name.split("-")[0], *name.split(".")[0].split("-")[1:]
                if kind == "start":
                    self.started.add((int(rank), int(i)))
                elif kind == "done" and not name.endswith(".part"):
                    with open(os.path.join(outdir, name), "rb") as f:
                        self.done[(int(rank), int(i))] = pickle.load(f)

    def values(self, spec):
        """Every rank's value for ``spec``; fails the test with the reason when there is none."""
        i = self.specs.index(spec)
        recs = [self.done.get((r, i)) for r in range(self.np)]
        raised = [f"rank {r} raised {rec['error']}\n{rec['traceback']}"
                  for r, rec in enumerate(recs) if rec is not None and not rec["ok"]]
        earlier = sorted({f"{self.specs[j]} (rank {r})" for (r, j), rec in self.done.items()
                          if j < i and not rec["ok"]})
        if earlier:  # an exception on some ranks only can leave Horovod shut down or out of step
            raised.append(f"(earlier specs raised too, which may be the cause: {', '.join(earlier)})")
        if raised and any(rec is not None and not rec["ok"] for rec in recs):
            pytest.fail(f"{spec}:\n" + "\n".join(raised), pytrace=False)
        missing = [r for r, rec in enumerate(recs) if rec is None]
        if missing:
            running = [r for r in missing if (r, i) in self.started]
            err = self.error
            cause = f"\n{err.__cause__}" if err is not None and err.__cause__ is not None else ""
            why = f"{type(err).__name__}: {err}{cause}" if err is not None else "no error reported"
            pytest.fail(f"{spec}: no result from ranks {missing} (running it at the end: {running}); "
                        f"the launch ended with {why}" + "".join("\n" + e for e in raised), pytrace=False)
        return [rec["value"] for rec in recs]


def _check_agree_finite(outs, label):
    """All-reduce outputs of one group of ranks: finite and bit-identical."""
    for r, o in enumerate(outs):
        assert np.isfinite(o).all(), f"{label}: rank {r} output not finite"
    for r, o in enumerate(outs[1:], 1):
        assert np.array_equal(outs[0], o), f"{label}: ranks 0 and {r} differ (max |diff| " \
                                          f"{np.abs(outs[0] - o).max():.3g})"


def _check_params(per_rank, label):
    """Parameter dicts of all ranks: finite and bit-identical."""
    for k in per_rank[0]:
        _check_agree_finite([p[k] for p in per_rank], f"{label} param {k}")


def _check_values(spec, outs, refs, label, may_defer=1, realigns=False):
    """Per-step all-reduce outputs ``outs`` against float64 references ``refs`` (one group).

    fp16, topkc:ratio=1 and the baseline: every step within ``TOL``. THC quantises with ranges
    learnt from the previous step, so its first step sends nothing (all of it waits in error
    feedback; also after a realignment, see thc.py) and the next carries it: a THC step passes
    when the *cumulative* output is within ``TOL`` of the cumulative reference, or when it is
    exactly 0 (deferred) and comes before step ``may_defer``. With ``realigns`` (ranks whose
    states differ), TopKC follows the same rule: a split selection vote gives 0 for the step
    and the next step carries it. Other specs: no bound (lossy).
    Returns the errors, for the report.
    """
    per_step = [rel_err(o, r) for o, r in zip(outs, refs)]
    cumulative = [rel_err(sum(outs[:s + 1]), sum(refs[:s + 1])) for s in range(len(outs))]
    errors = {"per_step": [round(e, 4) for e in per_step], "cumulative": [round(e, 4) for e in cumulative]}
    if spec == "thc" or (realigns and spec in TOL):
        bad = [s for s, e in enumerate(cumulative)
               if e > TOL[spec] and not (s < may_defer and not np.any(outs[s]))]
    elif spec in TOL:
        bad = [s for s, e in enumerate(per_step) if e > TOL[spec]]
    else:
        bad = []
    assert not bad, f"{label}: relative error above {TOL[spec]} at steps {bad}: {errors}"
    return errors


def _torch_compression(hvd, spec):
    """kwargs for Horovod: a fresh compressor of ``spec``, or nothing for the baseline."""
    if spec == BASELINE:
        return {}
    from torch_backend import Compression
    return {"compression": Compression.from_spec(spec)}


def _numpy(module):
    return {k: v.detach().numpy().astype(np.float64) for k, v in module.named_parameters()}


# ---------------------------------------------------------------- (a) unused heads

A_SPECS = [BASELINE] + SPECS


def worker_unused_heads(specs, outdir):
    import horovod.torch as hvd
    import torch
    hvd.init()
    torch.set_num_threads(1)

    def body(spec):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.trunk = torch.nn.Linear(64, 64)
        model.heads = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        init = _numpy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       **_torch_compression(hvd, spec))
        head_grad = 0.0
        for step in range(3):
            opt.zero_grad()
            x = torch.from_numpy(known(hvd.rank(), step, salt=1, shape=(32, 64)))
            model.trunk(x).pow(2).mean().backward()
            opt.step()
            for p in model.heads.parameters():
                head_grad = max(head_grad, float(p.grad.abs().max()) if p.grad is not None else 0.0)
        return {"init": init, "params": _numpy(model), "head_grad": head_grad}

    _each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def unused_heads():
    return Launch(worker_unused_heads, 2, A_SPECS)


@pytest.mark.parametrize("spec", A_SPECS)
def test_unused_heads(unused_heads, spec):
    res = unused_heads.values(spec)
    _check_params([r["params"] for r in res], spec)
    for r, out in enumerate(res):
        assert out["head_grad"] == 0.0, f"rank {r}: an unused head got gradient {out['head_grad']}"
        for k, v in out["params"].items():
            if k.startswith("heads."):
                assert np.array_equal(v, out["init"][k]), f"rank {r}: unused {k} changed"
            else:
                assert not np.array_equal(v, out["init"][k]), f"rank {r}: {k} never trained"


# ---------------------------------------------------------------- (b) rank-dependent graph

B_SPECS = [BASELINE] + SPECS


def worker_rank_dependent(specs, outdir):
    import horovod.torch as hvd
    import torch
    hvd.init()
    torch.set_num_threads(1)

    def body(spec):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.A = torch.nn.Linear(64, 64)
        model.B = torch.nn.Linear(64, 64)
        init = _numpy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       **_torch_compression(hvd, spec))
        for step in range(3):
            opt.zero_grad()
            x = torch.from_numpy(known(hvd.rank(), step, salt=2, shape=(32, 64)))
            y = model.A(x)
            if hvd.rank() == 0:
                y = model.B(y)
            y.pow(2).mean().backward()
            opt.step()
        return {"init": init, "params": _numpy(model)}

    _each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def rank_dependent():
    return Launch(worker_rank_dependent, 2, B_SPECS)


@pytest.mark.parametrize("spec", B_SPECS)
def test_rank_dependent_graph(rank_dependent, spec):
    res = rank_dependent.values(spec)
    _check_params([r["params"] for r in res], spec)
    for r, out in enumerate(res):  # rank 0's gradient of B reaches rank 1
        for k in out["params"]:
            assert not np.array_equal(out["params"][k], out["init"][k]), f"rank {r}: {k} never trained"


# ---------------------------------------------------------------- (c) process sets of one rank

C_SPECS = VALUE_SPECS
C_SHAPES = {"a": (2048,), "w": (64, 64)}  # THC compresses from 1024 coordinates up


def worker_singleton_sets(specs, outdir):
    import horovod.torch as hvd
    import torch
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
    hvd.init(process_sets=sets)
    torch.set_num_threads(1)
    mine = sets[hvd.rank()]

    def body(spec):
        module = torch.nn.Module()
        for k, shape in C_SHAPES.items():
            setattr(module, k, torch.nn.Parameter(torch.from_numpy(known(9, 0, salt=3, shape=shape))))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=1.0),
                                       named_parameters=module.named_parameters(),
                                       process_set=mine, **_torch_compression(hvd, spec))
        updates = []
        for step in range(2):
            before = _numpy(module)
            opt.zero_grad()
            loss = sum((getattr(module, k) * torch.from_numpy(known(hvd.rank(), step, salt=30 + i, shape=s))).sum()
                       for i, (k, s) in enumerate(C_SHAPES.items()))
            loss.backward()
            opt.step()
            after = _numpy(module)
            updates.append({k: before[k] - after[k] for k in before})
        return {"updates": updates, "set_size": mine.size()}

    _each_spec(specs, outdir, body)
    hvd.barrier()  # the global set still works after the one-rank sets


@pytest.fixture(scope="module")
def singleton_sets():
    return Launch(worker_singleton_sets, 2, C_SPECS)


@pytest.mark.parametrize("spec", C_SPECS)
def test_process_set_of_one_rank(singleton_sets, spec):
    res = singleton_sets.values(spec)
    report = {}
    for r, out in enumerate(res):
        assert out["set_size"] == 1
        for i, (k, shape) in enumerate(C_SHAPES.items()):
            grads = [known(r, step, salt=30 + i, shape=shape).astype(np.float64) for step in range(len(out["updates"]))]
            got = [upd[k] for upd in out["updates"]]
            label = f"{spec} rank {r} {k}"
            for step, g in enumerate(got):
                assert np.isfinite(g).all(), f"{label} step {step}"
                if spec == "fp16":  # fp16(g / 1) * 1: round to nearest fp16, plus float32 update rounding
                    np.testing.assert_allclose(g, grads[step], rtol=2 ** -10, atol=1e-6, err_msg=f"{label} step {step}")
            report[(r, k)] = _check_values(spec, got, grads, label)
    print(f"{spec}: relative errors (update against own gradient): {report}")


# ---------------------------------------------------------------- (d) two sets summing separately

D_SPECS = VALUE_SPECS
D_STEPS = 3


def worker_two_sets(specs, outdir):
    import horovod.torch as hvd
    import torch
    sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]
    hvd.init(process_sets=sets)
    torch.set_num_threads(1)
    mine = sets[hvd.rank() // 2]

    def body(spec):
        kw = _torch_compression(hvd, spec)
        i = specs.index(spec)
        outs = []
        for step in range(D_STEPS):
            t = torch.from_numpy(known(hvd.rank(), step, salt=4))
            out = hvd.allreduce(t, name=f"x.{i}", op=hvd.Sum, process_set=mine, **kw)
            outs.append(out.numpy().astype(np.float64))
        return outs

    _each_spec(specs, outdir, body)
    hvd.barrier()  # the sets run apart: no rank may shut Horovod down while the other set works


@pytest.fixture(scope="module")
def two_sets():
    return Launch(worker_two_sets, 4, D_SPECS)


@pytest.mark.parametrize("spec", D_SPECS)
def test_two_process_sets_sum_separately(two_sets, spec):
    res = two_sets.values(spec)
    report = {}
    for members in ((0, 1), (2, 3)):
        for step in range(D_STEPS):
            _check_agree_finite([res[r][step] for r in members], f"{spec} set {members} step {step}")
        refs = [sum(known(r, step, salt=4).astype(np.float64) for r in members) for step in range(D_STEPS)]
        report[members] = _check_values(spec, res[members[0]], refs, f"{spec} set {members}")
    print(f"{spec}: relative errors by set: {report}")


# ---------------------------------------------------------------- (e) join with 3 ranks

E_SPECS = [BASELINE] + VALUE_SPECS
E_STEPS = 2
OPS = ("sum", "average")


def worker_join(specs, outdir):
    import horovod.torch as hvd
    import torch
    hvd.init()
    torch.set_num_threads(1)

    def body(spec):
        i = specs.index(spec)
        value = {}
        for j, op in enumerate(OPS):
            outs = []
            if hvd.rank() < 2:
                kw = _torch_compression(hvd, spec)  # a fresh compressor per op
                for step in range(E_STEPS):
                    t = torch.from_numpy(known(hvd.rank(), step, salt=50 + j))
                    out = hvd.allreduce(t, name=f"x.{i}.{op}", op=hvd.Sum if op == "sum" else hvd.Average, **kw)
                    outs.append(out.numpy().astype(np.float64))
            value[op] = outs
            value[f"{op}_last_joined"] = hvd.join()
        return value

    _each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def join():
    return Launch(worker_join, 3, E_SPECS)


def _join_reference(op, step, divisor):
    j = OPS.index(op)
    total = sum(known(r, step, salt=50 + j).astype(np.float64) for r in (0, 1))
    return total if op == "sum" else total / divisor


def test_join_average_convention(join):
    """What Horovod itself divides by under join with op=Average (2 contributors, 3 ranks)."""
    res = join.values(BASELINE)
    for step in range(E_STEPS):
        out = res[0]["average"][step]
        errs = {d: rel_err(out, _join_reference("average", step, d)) for d in (2, 3)}
        print(f"join Average step {step}: relative error against sum/2 and sum/3: {errs}")
        assert errs[JOIN_AVERAGE_DIVISOR] < 1e-6, f"Horovod's join Average is not sum/{JOIN_AVERAGE_DIVISOR}: {errs}"


@pytest.mark.parametrize("spec", E_SPECS)
def test_join(join, spec):
    res = join.values(spec)
    assert res[0]["sum_last_joined"] == res[1]["sum_last_joined"] == res[2]["sum_last_joined"]
    report = {}
    for op in OPS:
        assert res[2][op] == [], "rank 2 joined at once"
        for step in range(E_STEPS):
            _check_agree_finite([res[r][op][step] for r in (0, 1)], f"{spec} {op} step {step}")
        refs = [_join_reference(op, step, JOIN_AVERAGE_DIVISOR) for step in range(E_STEPS)]
        report[op] = _check_values(spec, res[0][op], refs, f"{spec} {op}")
    print(f"{spec}: relative errors against sum and sum/{JOIN_AVERAGE_DIVISOR}: {report}")


# ---------------------------------------------------------------- (f) TensorFlow name drift

# No BASELINE here: Horovod's own path hangs in this scenario (see the module docstring).
F_SPECS = SPECS


def worker_tf_name_drift(specs, outdir):
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()

    def body(spec):
        if hvd.rank() == 0:  # one extra layer first: the auto-generated names differ between ranks
            tf.keras.layers.Dense(3)(tf.zeros((1, 64)))
        l1, l2 = tf.keras.layers.Dense(64), tf.keras.layers.Dense(8)
        l2(l1(tf.zeros((1, 64))))
        variables = l1.trainable_variables + l2.trainable_variables
        for n, v in enumerate(variables):
            v.assign(known(7, n, salt=6, shape=tuple(v.shape)) * 0.1)
        init = [v.numpy().astype(np.float64) for v in variables]
        kw = {"compression": Compression.from_spec(spec)}
        opt = tf.keras.optimizers.SGD(0.1)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(l2(l1(x)) - y))
            tape = hvd.DistributedGradientTape(tape, **kw)
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))

        for s in range(3):
            step(tf.constant(known(hvd.rank(), s, salt=60, shape=(16, 64))),
                 tf.constant(known(hvd.rank(), s, salt=61, shape=(16, 8))))
        return {"names": [v.name for v in variables], "init": init,
                "params": [v.numpy().astype(np.float64) for v in variables]}

    _each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def tf_name_drift():
    return Launch(worker_tf_name_drift, 2, F_SPECS)


@pytest.mark.parametrize("spec", F_SPECS)
def test_tf_name_drift(tf_name_drift, spec):
    res = tf_name_drift.values(spec)
    assert res[0]["names"] != res[1]["names"], f"the scenario needs names that differ: {res[0]['names']}"
    _check_params([dict(enumerate(r["params"])) for r in res], spec)
    for r, out in enumerate(res):
        for n, (v, v0) in enumerate(zip(out["params"], out["init"])):
            assert not np.array_equal(v, v0), f"rank {r}: variable {out['names'][n]} never trained"


# ---------------------------------------------------------------- (g) state loaded on rank 0 only

G_SPECS = VALUE_SPECS
G_STEPS = 3


def worker_state_rank0(specs, outdir):
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)

    def body(spec):
        # 3 steps of training; the compressor's state is saved (and used on rank 0 only).
        module = torch.nn.Module()
        module.p = torch.nn.Parameter(torch.from_numpy(known(9, 0, salt=7)))
        comp = Compression.from_spec(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                       named_parameters=module.named_parameters(), compression=comp)
        for step in range(3):
            opt.zero_grad()
            (module.p * torch.from_numpy(known(hvd.rank(), step, salt=70))).sum().backward()
            opt.step()
        saved = comp.state_dict()
        saved_keys = sorted(saved["tensors"])
        # Fresh model, optimizer and compressor everywhere; the state is loaded on rank 0 only.
        module = torch.nn.Module()
        module.p = torch.nn.Parameter(torch.from_numpy(known(9, 0, salt=7)))
        comp = Compression.from_spec(spec)
        hvd.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                 named_parameters=module.named_parameters(), compression=comp)
        outs = []
        try:
            if hvd.rank() == 0:
                comp.load_state_dict(saved)
            for step in range(G_STEPS):
                t = torch.from_numpy(known(hvd.rank(), step, salt=71))
                outs.append(hvd.allreduce(t, name="p", op=hvd.Sum, compression=comp).numpy().astype(np.float64))
        except ValueError as e:
            return {"refused": str(e), "steps_done": len(outs), "saved_keys": saved_keys}
        return {"outs": outs, "saved_keys": saved_keys, "keys": sorted(comp.state_dict()["tensors"])}

    _each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def state_rank0():
    return Launch(worker_state_rank0, 2, G_SPECS)


@pytest.mark.parametrize("spec", G_SPECS)
def test_state_loaded_on_rank0_only(state_rank0, spec):
    res = state_rank0.values(spec)
    refused = [r for r, out in enumerate(res) if "refused" in out]
    if refused:  # acceptable: a clear ValueError on every rank
        print(f"{spec}: refused: {[out.get('refused') for out in res]}")
        assert refused == list(range(len(res))), f"{spec}: ValueError on ranks {refused} only: {res}"
        for out in res:
            assert out["refused"].startswith(spec.partition(":")[0]), out["refused"]
        return
    if res[0]["saved_keys"]:  # a stateful scheme: the loaded state was under the key used again
        assert "p" in res[0]["saved_keys"], res[0]["saved_keys"]
    for step in range(G_STEPS):
        _check_agree_finite([out["outs"][step] for out in res], f"{spec} step {step}")
    refs = [sum(known(r, step, salt=71).astype(np.float64) for r in range(2)) for step in range(G_STEPS)]
    # THC, TopKC, PowerSGD: a state that differs between ranks is detected (output 0 for that
    # step, never a wrong value) and the ranks realign: up to the last step may be deferred.
    errors = _check_values(spec, res[0]["outs"], refs, spec, may_defer=G_STEPS - 1, realigns=True)
    print(f"{spec}: relative errors: {errors}")
