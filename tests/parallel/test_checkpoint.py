"""The state and checkpoint rules on both engines: Horovod (``hvd.DistributedOptimizer``) and
DDP (``torch_backend.ddp``), the same worker on each, two Gloo ranks.

For every default compressor, on the probe model of tests/parallel/test_ddp.py (each rank's
gradient a seeded tensor): after a few steps, ``state_dict(gather=True)`` saved by rank 0 and
loaded into a new compressor on every rank resumes exactly (the next steps' gradients are
bit-identical to the uninterrupted run's); another rank's per-rank state and a state of
another spec are refused with the same messages; and the per-tensor records the two engines
keep are the same: routes, wire bytes, ``bytes_per_step()``, the state's fields and shapes,
the metrics' names, each tensor's world size and rank (signSGD's bytes follow the op: DDP's
hook sums, Horovod's optimizer averages).
"""
import os

import numpy as np
import pytest

from tests import ddprun, hvdrun
from tests.parallel.ddp_probe import RESUME, SHAPES, SPECS, STEPS, check_resumed_totals, grads_of, probe_cls as _probe_cls


def _horovod_engine():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    Probe = _probe_cls()

    def make(spec):
        model = Probe()
        comp = Compression.from_spec(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), compression=comp)

        def step(grads):
            opt.zero_grad()
            model(grads).backward()
            opt.synchronize()
            out = {n: p.grad.detach().double().numpy().copy() for n, p in model.named_parameters()}
            with opt.skip_synchronize():
                opt.step()
            return out
        return comp, step

    def gather(obj):
        return [hvd.broadcast_object(obj, root_rank=r, name=f"engines.{r}") for r in range(hvd.size())]
    return hvd.rank(), make, gather, lambda: hvd.allreduce(torch.zeros(1), name="engines.barrier")


def _ddp_engine():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from tests.parallel.ddp_probe import probe_step as _step
    Probe = _probe_cls()

    def make(spec):
        ddp = DDP(Probe())
        # per tensor: the same books as Horovod's (the bucketed hook keeps a group's state;
        # its checkpoints across layouts are test_ddp.py's)
        comp = register_comm_hook(ddp, Compression.from_spec(spec), per_tensor=True)
        return comp, lambda grads: _step(ddp, grads)

    def gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return dist.get_rank(), make, gather, dist.barrier


def engine_worker(engine, tmp):
    import torch
    from torch_backend import Compression
    from tests.hvdrun import value_error
    from tests.parallel.ddp_probe import residuals as _residuals
    rank, make, gather, barrier = (_horovod_engine if engine == "horovod" else _ddp_engine)()
    out = {}
    for spec in SPECS:
        comp, step = make(spec)
        for t in range(STEPS):
            step(grads_of(rank, t))
        state = comp.state_dict(gather=True)
        path = os.path.join(tmp, f"{engine}-{spec}.pt")
        if rank == 0:
            torch.save(state, path)
        barrier()
        comp2, step2 = make(spec)
        comp2.load_state_dict(torch.load(path, weights_only=False))
        resume = [(step(grads_of(rank, t)), step2(grads_of(rank, t))) for t in range(STEPS, STEPS + RESUME)]
        owed = (_residuals(comp), _residuals(comp2))
        mine = comp.state_dict()
        other = gather(mine)[1 - rank]
        local = mine["tensors"]
        out[spec] = {
            "resume": resume, "owed": owed, "routes": comp.routes(),
            "wire": {k: tuple(w) for k, w in comp.wire_bytes().items()},
            "bytes": tuple(comp.bytes_per_step()),
            "fields": {k: {f: tuple(v.shape) for f, v in fields.items()} for k, fields in local.items()},
            "metrics": {k: sorted(m) for k, m in comp.metrics().items()},
            "worlds": {k: (i.world_size, i.rank) for k, i in comp.codec.tensors.infos.items()},
            "gathered": [p["rank"] for p in state["ranks"]],
            "wrong_rank": value_error(lambda: comp.load_state_dict(other)),
            "wrong_spec": value_error(lambda: Compression.from_spec("thc:bits=2").load_state_dict(mine)),
        }
        if engine == "ddp":
            out[spec].update(_load_before_register(spec, path, other, rank))
    return out


def _load_before_register(spec, path, other, rank):
    """Build, load, then register (Lightning's order: ``on_load_checkpoint`` runs before the
    model is wrapped), in a job without Horovod: the gathered state resumes as when loaded
    after registering, another rank's per-rank state is refused, and CompressionStats takes
    torch.distributed's rank, before and after binding."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    from torch_backend.stats import CompressionStats
    from tests.hvdrun import value_error
    from tests.parallel.ddp_probe import probe_step as _step
    comp = Compression.from_spec(spec)
    stats_rank = CompressionStats(comp, _probe_cls()().parameters()).rank
    comp.load_state_dict(torch.load(path, weights_only=False))
    ddp = DDP(_probe_cls()())
    register_comm_hook(ddp, comp, per_tensor=True)  # the saved run's layout (make() above)
    resumed = [_step(ddp, grads_of(rank, t)) for t in range(STEPS, STEPS + RESUME)]
    return {"load_first": resumed, "load_first_world": comp.codec.job_world(), "stats_rank": stats_rank,
            "stats_rank_bound": CompressionStats(comp, ddp.parameters()).rank,
            "wrong_rank_unbound": value_error(lambda: Compression.from_spec(spec).load_state_dict(other))}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("engines"))
    return {"horovod": hvdrun.run(engine_worker, np=2, args=("horovod", tmp), timeout=400),
            "ddp": ddprun.run(engine_worker, np=2, args=("ddp", tmp), timeout=400)}


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
@pytest.mark.parametrize("spec", SPECS)
def test_checkpoint_rules(engines, engine, spec):
    for rank, result in enumerate(engines[engine]):
        rec = result[spec]
        if spec != "auto":  # auto's first step after a load is a sync step: totals below
            for before, after in rec["resume"]:
                for n in SHAPES:
                    np.testing.assert_array_equal(after[n], before[n], err_msg=f"{engine} {spec} {n}")
        assert rec["gathered"] == [0, 1]
        assert rec["wrong_rank"].startswith(f"load_state_dict: this state_dict holds rank {1 - rank}'s "
                                            f"state (its error feedback), and this is rank {rank}")
        assert rec["wrong_spec"].startswith("state_dict was saved by compressor ")
        assert set(rec["worlds"].values()) == {(2, rank)}
    if spec == "auto":
        check_resumed_totals([r[spec] for r in engines[engine]], 2)


@pytest.mark.parametrize("spec", SPECS)
def test_load_before_register(engines, spec):
    """DDP, load_state_dict before register_comm_hook: the rank is torch.distributed's."""
    for rank, result in enumerate(engines["ddp"]):
        rec = result[spec]
        assert (rec["stats_rank"], rec["stats_rank_bound"], rec["load_first_world"]) == (rank, rank, (2, rank))
        assert rec["wrong_rank_unbound"].startswith(f"load_state_dict: this state_dict holds rank {1 - rank}'s "
                                                    f"state (its error feedback), and this is rank {rank}")
        if spec != "auto":  # auto's first step after a load is a sync step
            for (_, loaded_after), loaded_first in zip(rec["resume"], rec["load_first"]):
                for n in SHAPES:
                    np.testing.assert_array_equal(loaded_first[n], loaded_after[n], err_msg=f"{spec} {n}")


# Schemes whose payload size follows the op: DDP's hook all-reduces with Sum (no guard bits in
# the lanes), Horovod's optimizer with Average (guard bits, so fewer lanes a word).
OP_SIZED = ("signsgd",)


@pytest.mark.parametrize("spec", SPECS)
def test_same_records_on_both_engines(engines, spec):
    from hvd_gradcomp.base import TensorInfo
    from hvd_gradcomp.registry import make_scheme
    for rank in range(2):
        hvd, ddp = engines["horovod"][rank][spec], engines["ddp"][rank][spec]
        for what in ("routes", "wire", "bytes", "fields", "metrics", "worlds", "wrong_spec"):
            if spec in OP_SIZED and what in ("wire", "bytes"):
                continue
            assert hvd[what] == ddp[what], what
        if spec in OP_SIZED:
            scheme = make_scheme(spec)
            for rec, op in ((hvd, "average"), (ddp, "sum")):
                wire = {n: tuple(scheme.wire(TensorInfo(n, shape, "float32", 2, rank, op))) for n, shape in SHAPES.items()}
                assert rec["wire"] == wire and rec["bytes"][0] == sum(w[0] for w in wire.values()), op
            assert sum(w[0] for w in ddp["wire"].values()) < sum(w[0] for w in hvd["wire"].values())
