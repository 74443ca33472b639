"""Real-Horovod scenarios that have hung or given wrong values (issue 10): each must complete.

Every scenario is one launch (:class:`tests.parallel.hang_launch.Launch`, with a hard timeout, so
a hang fails fast) running every compressor spec in turn with a fresh compressor per optimizer;
each rank writes its result per spec as soon as it has it, so the specs finished before a hang
(or an exception) are still checked, and the spec that was running when the launch died is the
one that fails, with the launch's error (for a timeout: every rank's Python stack).
``BASELINE`` (Horovod without a compressor) runs first where it tells whether Horovod itself
copes with the scenario.

Scenarios here: (a) unused heads (their gradients filled in by Horovod's ``synchronize()``, in
an order that differs between ranks); (b) a rank-dependent graph; (c) process sets of one rank;
(d) two process sets summing separately (4 ranks). Ranks that diverge ((e) ``hvd.join()`` with
3 ranks, (f) TensorFlow layer names that differ between ranks, (g) compressor state loaded on
rank 0 only): tests/parallel/test_adapter_hangs_divergent.py.
"""
import numpy as np
import pytest

from tests.parallel.hang_launch import (BASELINE, Launch, SPECS, VALUE_SPECS, check_agree_finite,
                                        check_params, check_values, each_spec, known, numpy_params,
                                        torch_compression)


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
        init = numpy_params(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       **torch_compression(hvd, spec))
        head_grad = 0.0
        for step in range(3):
            opt.zero_grad()
            x = torch.from_numpy(known(hvd.rank(), step, salt=1, shape=(32, 64)))
            model.trunk(x).pow(2).mean().backward()
            opt.step()
            for p in model.heads.parameters():
                head_grad = max(head_grad, float(p.grad.abs().max()) if p.grad is not None else 0.0)
        return {"init": init, "params": numpy_params(model), "head_grad": head_grad}

    each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def unused_heads():
    return Launch(worker_unused_heads, 2, A_SPECS)


@pytest.mark.parametrize("spec", A_SPECS)
def test_unused_heads(unused_heads, spec):
    res = unused_heads.values(spec)
    check_params([r["params"] for r in res], spec)
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
        init = numpy_params(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       **torch_compression(hvd, spec))
        for step in range(3):
            opt.zero_grad()
            x = torch.from_numpy(known(hvd.rank(), step, salt=2, shape=(32, 64)))
            y = model.A(x)
            if hvd.rank() == 0:
                y = model.B(y)
            y.pow(2).mean().backward()
            opt.step()
        return {"init": init, "params": numpy_params(model)}

    each_spec(specs, outdir, body)


@pytest.fixture(scope="module")
def rank_dependent():
    return Launch(worker_rank_dependent, 2, B_SPECS)


@pytest.mark.parametrize("spec", B_SPECS)
def test_rank_dependent_graph(rank_dependent, spec):
    res = rank_dependent.values(spec)
    check_params([r["params"] for r in res], spec)
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
                                       process_set=mine, **torch_compression(hvd, spec))
        updates = []
        for step in range(2):
            before = numpy_params(module)
            opt.zero_grad()
            loss = sum((getattr(module, k) * torch.from_numpy(known(hvd.rank(), step, salt=30 + i, shape=s))).sum()
                       for i, (k, s) in enumerate(C_SHAPES.items()))
            loss.backward()
            opt.step()
            after = numpy_params(module)
            updates.append({k: before[k] - after[k] for k in before})
        return {"updates": updates, "set_size": mine.size()}

    each_spec(specs, outdir, body)
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
            report[(r, k)] = check_values(spec, got, grads, label)
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
        kw = torch_compression(hvd, spec)
        i = specs.index(spec)
        outs = []
        for step in range(D_STEPS):
            t = torch.from_numpy(known(hvd.rank(), step, salt=4))
            out = hvd.allreduce(t, name=f"x.{i}", op=hvd.Sum, process_set=mine, **kw)
            outs.append(out.numpy().astype(np.float64))
        return outs

    each_spec(specs, outdir, body)
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
            check_agree_finite([res[r][step] for r in members], f"{spec} set {members} step {step}")
        refs = [sum(known(r, step, salt=4).astype(np.float64) for r in members) for step in range(D_STEPS)]
        report[members] = check_values(spec, res[members[0]], refs, f"{spec} set {members}")
    print(f"{spec}: relative errors by set: {report}")
