"""FSDP2 with parameters that have no gradient in a step (issue 47, item 4): frozen ones
(``requires_grad=False``: partial fine-tuning, LoRA's base weights), and trainable ones a step's
forward skips (layer drop, MoE), under ``torch_backend.fsdp.install`` (blocking and overlap)
and ``install_reduce_scatter``, on real Gloo processes.

The probe's loss is ``sum(p * G_r[p])`` over the parameters the step uses, so rank ``r``'s
gradient of ``p`` at step ``t`` is ``G_r[p]`` (seeded, rebuilt here). Its FSDP modules: the root
(``s``), ``lora`` (``w`` 64x64 and ``bias`` frozen, adapters ``a`` 32x64 and ``b`` 64x32
trainable), ``drop`` (``u`` 33x64 used on even passes only, ``v`` always) and ``gate`` (``g``
40x64, unused in passes 1, 5, ...: the whole module then has no gradient). ``s`` and ``drop.v``
are below ``min_numel`` (fp16, no error feedback); the balance holds to float16's rounding. FSDP reduces only the
parameters with a gradient, so each call's flat shard holds another set of them.

Checks, per run: every rank ends each step with the same full gradients; a frozen parameter's
and an unused parameter's ``.grad`` stays None in that step, as native FSDP leaves it; error
feedback's balance for every trainable parameter (what the steps delivered, plus the pending
residuals of both compressors mapped back to the parameter, is the sum over the steps of the
mean gradient over all ranks: nothing an unused step drops is lost, nothing is counted twice);
the uncompressed route equals native FSDP.

Launches (each kills its process group at its timeout), one per mesh: 2 x 1 (2 ranks: install,
per parameter and per module, overlap, accumulated micro-batches), 1 x 2 (2 ranks: the reduce-scatter, with install on
one replica) and 2 x 2 (4 ranks: both, blocking and overlap).
"""
import math

import numpy as np
import pytest

from tests.ddprun import run

SHAPES = {"s": (10,), "lora.w": (64, 64), "lora.bias": (64,), "lora.a": (32, 64), "lora.b": (64, 32),
          "drop.u": (33, 64), "drop.v": (64,), "gate.g": (40, 64)}
FROZEN = ("lora.w", "lora.bias")
SKIPPED = ("drop.u", "gate.g")
STEPS = 4

# (name, install spec or None, install_reduce_scatter spec or None, per, overlap, backward
# passes per step: 2 = two micro-batches under set_requires_all_reduce, the all-reduce on the
# last, whose forward skips drop.u and gate), by mesh
RUNS = {
    (2, 1): [("topkc per param", "topkc:0.1", None, "param", False, 1),
             ("thc per group", "thc", None, "group", False, 1),
             ("topkc overlap", "topkc:0.1", None, "param", True, 1),
             ("topkc accumulated", "topkc:0.1", None, "param", False, 2),
             ("none", "none", None, "param", False, 1)],
    (1, 2): [("rs thc", None, "thc", "param", False, 1),
             ("rs signsgd per group", None, "signsgd", "group", False, 1),
             ("topkc + rs thc", "topkc:0.1", "thc", "param", False, 1),
             ("rs none", None, "none", "param", False, 1)],
    (2, 2): [("topkc + rs thc", "topkc:0.1", "thc", "param", False, 1),
             ("thc overlap + rs signsgd", "thc", "signsgd", "param", True, 1),
             ("topkc per group + rs thc", "topkc:0.1", "thc", "group", False, 1),
             ("thc accumulated + rs thc", "thc", "thc", "param", False, 2),
             ("none + rs none", "none", "none", "param", False, 1)],
}


def used(name, k):
    """Whether backward pass ``k``'s forward uses parameter ``name``: ``drop.u`` on even
    passes, ``gate.g`` on all but 1, 5, 9, ... (under accumulation: some steps end with a pass
    without it, so FSDP keeps its reduce-scattered shard until a later step's last pass)."""
    if name == "drop.u":
        return k % 2 == 0
    return name != "gate.g" or k % 4 != 1


def grads_of(rank, step):
    """The seeded gradients of global ``rank`` at ``step``: {name: float32 tensor}."""
    import torch
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _probe_cls():
    import torch

    class Leaf(torch.nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.prefix = prefix
            for n, s in SHAPES.items():
                if n.startswith(prefix):
                    self.register_parameter(n[len(prefix):], torch.nn.Parameter(torch.zeros(s)))

        def forward(self, grads, step):
            return sum((p * grads[self.prefix + n]).sum() for n, p in self.named_parameters()
                       if used(self.prefix + n, step))

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.zeros(SHAPES["s"]))
            self.lora, self.drop, self.gate = Leaf("lora."), Leaf("drop."), Leaf("gate.")

        def forward(self, grads, step):
            loss = (self.s * grads["s"]).sum() + self.lora(grads, step) + self.drop(grads, step)
            return loss + self.gate(grads, step) if used("gate.g", step) else loss

    return Probe


def _build(mesh):
    import torch
    from torch.distributed.fsdp import fully_shard
    model = _probe_cls()()
    for n, p in model.named_parameters():
        p.requires_grad_(n not in FROZEN)
    for m in (model.lora, model.drop, model.gate, model):
        fully_shard(m, mesh=mesh)
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _residuals(comp, per, size, shards):
    """{parameter name: {shard rank: this rank's pending error feedback of that shard, float64
    flat (padded rows)}} for the shard ranks ``shards`` (the own one, or every one for the
    reduce-scatter), mapped from the compressor's keys (per module: the trainable parameters'
    parts of the module's flat, in order)."""
    out = {}
    for module in ("", "lora", "drop", "gate"):
        names = [n for n in SHAPES if (n.rpartition(".")[0] == module) and n not in FROZEN]
        for j in shards:
            for n in names:
                rows = -(-SHAPES[n][0] // size)
                numel = rows * math.prod(SHAPES[n][1:])
                if per == "param":
                    part = comp.error_feedback(f"{n}[shard {j}/{size}]")
                else:
                    key = [k for k in comp.routes() if k.startswith((module or "<root>")) and
                           k.endswith(f"[shard {j}/{size}]")]
                    part = None
                    if key:
                        ef = comp.error_feedback(key[0])
                        if ef is not None:
                            offset = 0
                            for other in names:
                                o_numel = -(-SHAPES[other][0] // size) * math.prod(SHAPES[other][1:])
                                if other == n:
                                    part = ef[offset:offset + o_numel]
                                offset += o_numel
                out.setdefault(n, {})[j] = None if part is None else part.double().numpy().reshape(-1)[:numel].copy()
    return out


def _one(mesh, shape, spec_ar, spec_rs, per, overlap, micro):
    import torch.distributed as dist
    from torch_backend import Compression
    from torch_backend.fsdp import install, install_reduce_scatter
    rank = dist.get_rank()
    R, S = shape
    model, opt = _build(mesh)
    rs = install_reduce_scatter(model, Compression.from_spec(spec_rs), per=per) if spec_rs else None
    ar = install(model, Compression.from_spec(spec_ar), per=per, overlap=overlap) if spec_ar else None
    outs = []
    for t in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for k in range(micro * t, micro * t + micro):
            if micro > 1:
                model.set_requires_all_reduce(k == micro * t + micro - 1)
            model(grads_of(rank, k), k).backward()
        outs.append({n: None if p.grad is None else p.grad.full_tensor().double().numpy().copy()
                     for n, p in model.named_parameters()})
        opt.step()
    shard = rank % S
    rec = {"outs": outs}
    if ar is not None:
        rec["ar"] = _residuals(ar, per, S, [shard])
    if rs is not None:
        rec["rs"] = _residuals(rs, per, S, range(S))
    return rec


def worker(shape):
    """Every run of ``RUNS[shape]`` on an R x S (replicate, shard) mesh, and native FSDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    out = {run[0]: _one(mesh, shape, *run[1:]) for run in RUNS[shape]}
    model, opt = _build(mesh)
    rank, native = dist.get_rank(), []
    for t in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(grads_of(rank, t), t).backward()
        native.append({n: None if p.grad is None else p.grad.full_tensor().double().numpy().copy()
                       for n, p in model.named_parameters()})
        opt.step()
    out["native"] = {"outs": native}
    return out


_CACHE = {}


def results(shape):
    if shape not in _CACHE:
        _CACHE[shape] = run(worker, np=shape[0] * shape[1], args=(shape,), timeout=480)
    return _CACHE[shape]


def _unshard(name, parts, size):
    d0, rest = SHAPES[name][0], math.prod(SHAPES[name][1:])
    rows = -(-d0 // size)
    return np.concatenate([p.reshape(rows, rest) for p in parts])[:d0].reshape(SHAPES[name])


def check(shape, name):
    R, S = shape
    world = R * S
    res = results(shape)
    recs = [r[name] for r in res]
    ar_spec = rs_spec = None
    micro = 1
    for n, a, b, _, _, m in RUNS.get(shape, []):
        if n == name:
            ar_spec, rs_spec, micro = a, b, m

    def passes(t):
        return range(micro * t, micro * t + micro)
    for t in range(STEPS):
        for p in SHAPES:
            got = [rec["outs"][t][p] for rec in recs]
            if p in FROZEN or not any(used(p, k) for k in passes(t)):
                assert all(g is None for g in got), f"{name}: step {t}: {p}.grad should stay None"
                continue
            assert all(g is not None for g in got), f"{name}: step {t}: {p} has no gradient"
            for r in range(1, world):
                np.testing.assert_array_equal(got[r], got[0], err_msg=f"{name}: step {t} {p}: rank {r}")
    if name == "native":
        return
    for p in SHAPES:
        if p in FROZEN:
            continue
        truth = sum(sum(grads_of(r, k)[p].double().numpy() for r in range(world)) / world
                    for t in range(STEPS) for k in passes(t) if used(p, k))
        delivered = sum(recs[0]["outs"][t][p] for t in range(STEPS) if recs[0]["outs"][t][p] is not None)
        owed = np.zeros(SHAPES[p])
        for q in range(R):
            ranks = [q * S + s for s in range(S)]
            if ar_spec is not None:
                parts = [recs[q * S + s]["ar"][p][s] for s in range(S)]
                if all(x is not None for x in parts):
                    owed += _unshard(p, parts, S) / R
            if rs_spec is not None:
                for r in ranks:
                    parts = [recs[r]["rs"][p][j] for j in range(S)]
                    if all(x is not None for x in parts):
                        owed += _unshard(p, parts, S) / (S * R)
        # (values and fp16 routes rounded to float16 on the wire: test_fsdp's bound)
        bound = STEPS * 2.0 ** -10 * np.abs(truth).max() + 1e-5
        err = np.abs(delivered + owed - truth).max()
        assert err <= bound, f"{name}: {p}: delivered + pending error feedback is {err} off the sum " \
                             f"of the mean gradients (bound {bound})"
    if name.startswith("none") or name == "rs none":
        native = res[0]["native"]["outs"]
        for t in range(STEPS):
            for p in SHAPES:
                if native[t][p] is not None:
                    np.testing.assert_allclose(recs[0]["outs"][t][p], native[t][p], rtol=1e-6, atol=1e-6)


CASES = [(shape, run[0]) for shape in RUNS for run in RUNS[shape]] + [(s, "native") for s in RUNS]


@pytest.mark.parametrize("shape,name", CASES, ids=[f"{s[0]}x{s[1]}-{n}" for s, n in CASES])
def test_frozen_and_unused(shape, name):
    check(shape, name)
