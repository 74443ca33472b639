"""PowerSGD batched through DDP's hook (torch_backend/ddp.py) on 2 real Gloo ranks: a bucket's
matrices of one shape go as one batch (one group per shape), the outputs equal the per-matrix
hook's (``per_tensor=True``) within float32 rounding, and a per-matrix checkpoint (gathered on
rank 0) resumes in the batched hook as the per-matrix run goes on. One launch."""
import numpy as np

from tests.ddprun import run

SHAPES = {"w1": (32, 48), "b": (32,), "w2": (32, 48), "c1": (16, 4, 3, 3), "w3": (32, 48), "c2": (16, 4, 3, 3),
          "odd": (24, 40)}
SPEC = "powersgd:2"
STEPS, RESUME = 4, 3


def _grads(rank, step):
    import torch
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 3)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _model():
    import torch

    class Probe(torch.nn.Module):
        """loss = sum_p sum(p * G[p]): the gradient of p is G[p]."""

        def __init__(self):
            super().__init__()
            for n, s in SHAPES.items():
                self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))

        def forward(self, grads):
            return sum((p * grads[n]).sum() for n, p in self.named_parameters())
    return Probe()


def _step(ddp, grads):
    for p in ddp.parameters():
        p.grad = None
    ddp(grads).backward()
    return {n: p.grad.detach().double().numpy().copy() for n, p in ddp.module.named_parameters()}


def batched_worker(tmp):
    import os
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    rank = dist.get_rank()
    out = {}
    hooks = {}
    for per_tensor in (False, True):
        ddp = DDP(_model())
        comp = register_comm_hook(ddp, Compression.from_spec(SPEC), per_tensor=per_tensor)
        hooks[per_tensor] = (ddp, comp)
        out[per_tensor] = [_step(ddp, _grads(rank, t)) for t in range(STEPS)]
        out[("groups", per_tensor)] = sorted(tuple(comp.codec.groups.groups[g].keys)
                                             for g in set(comp.codec.groups.holders.values())
                                             if g in comp.codec.groups.groups)
    # the per-matrix hook's checkpoint, resumed by a batched hook
    path = os.path.join(tmp, "per_matrix.pt")
    state = hooks[True][1].state_dict(gather=True)
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    ddp2 = DDP(_model())
    comp2 = register_comm_hook(ddp2, Compression.from_spec(SPEC))
    comp2.load_state_dict(torch.load(path, weights_only=False))
    out["resume"] = [(_step(hooks[True][0], _grads(rank, t)), _step(ddp2, _grads(rank, t)))
                     for t in range(STEPS, STEPS + RESUME)]
    return out


def _close(a, b, what):
    scale = max(np.abs(b).max(), 1e-6)
    assert np.abs(a - b).max() / scale < 2e-4, what


def test_ddp_batched_equals_per_matrix(tmp_path):
    results = run(batched_worker, np=2, args=(str(tmp_path),))
    for rank, r in enumerate(results):
        # one batch per shape in the bucket; per tensor: none
        assert sorted(sorted(g) for g in r[("groups", False)]) == [["c1", "c2"], ["w1", "w2", "w3"]], r[("groups", False)]
        assert r[("groups", True)] == []
        for t, (got, want) in enumerate(zip(r[False], r[True])):
            for n in SHAPES:
                _close(got[n], want[n], f"rank {rank} step {t} {n}")
        for t, (want, got) in enumerate(r["resume"]):
            for n in SHAPES:
                _close(got[n], want[n], f"rank {rank} resumed step {t} {n}")
    for n in SHAPES:  # both ranks hold the same mean
        np.testing.assert_allclose(results[0][False][-1][n], results[1][False][-1][n], rtol=0, atol=1e-6)
