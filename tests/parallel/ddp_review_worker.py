"""The worker of tests/parallel/test_ddp_review.py (one 2-rank Gloo launch): the probe models,
their gradients and ``review_worker``, which records every case the test file checks."""
import os

import numpy as np

from tests.parallel.ddp_probe import AllReduceCounter as _Counter, grads_of

# registration order; FORWARD: the order the loss uses them (backward readiness: reversed)
MANY = {"l0.weight": (32, 64), "l0.bias": (64,), "l1.weight": (48, 64), "l1.bias": (48,),
        "l2.weight": (16, 128), "l2.bias": (16,), "emb.weight": (40, 32), "big.weight": (64, 80),
        "head.weight": (64, 32), "head.bias": (200,)}
FORWARD = ["l1.weight", "l0.bias", "l0.weight", "big.weight", "l1.bias", "emb.weight", "l2.weight",
           "head.bias", "l2.bias", "head.weight"]
# four tensors, one bucket: first and last the same before and after the rebuild, middle swapped
FOUR = {"p0": (64, 64), "p1": (64,), "p2": (32, 64), "p3": (16, 64)}
FOUR_FORWARD = ["p3", "p1", "p2", "p0"]
CAP = 0.02  # MB: about 5,000 float32 per bucket
STEPS = 5
RULES = "*.bias -> fp16; numel>=4096 -> thc; topkc:0.1"
BALANCE_SPECS = ["topkc:0.1", "thc", "signsgd", "topk:0.1", RULES]
HALF = ("l1.weight", "emb.weight", "head.bias", "l0.bias")
FROZEN = ("l2.bias",)
SKIPPED = ("l1.weight", "big.weight")  # unused by every rank at odd steps
JOIN_BATCHES = {0: 2, 1: 4}


def _grads(rank, t, shapes, half=()):
    """The seeded gradients, float16 where the parameter is (its gradient is G cast)."""
    import torch
    g = grads_of(rank, t, shapes)
    return {n: v.to(torch.float16) if n in half else v for n, v in g.items()}


def _net_cls():
    import torch

    class Net(torch.nn.Module):
        """loss = sum over ``order`` of sum(p * G[p]) (``skip``: left out)."""

        def __init__(self, shapes, order, half=(), frozen=()):
            super().__init__()
            self.order = list(order)
            for n, s in shapes.items():
                mod, leaf = self, n
                if "." in n:
                    head, leaf = n.split(".")
                    if not hasattr(self, head):
                        self.add_module(head, torch.nn.Module())
                    mod = getattr(self, head)
                dtype = torch.float16 if n in half else torch.float32
                mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(s, dtype=dtype),
                                                                requires_grad=n not in frozen))

        def forward(self, grads, skip=()):
            params = dict(self.named_parameters())
            return sum((params[n] * grads[n]).sum().float() for n in self.order if n not in skip)

    return Net


def review_worker(tmp):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend import ddp as tddp
    rank = dist.get_rank()
    Net = _net_cls()

    def make(spec, shapes=MANY, order=FORWARD, per_tensor=False, comp=None, half=(), frozen=(), **ddp_kw):
        ddp = DDP(Net(shapes, order, half, frozen), **ddp_kw)
        comp = Compression.from_spec(spec) if comp is None else comp
        state, _ = tddp.make_comm_hook(ddp, comp, per_tensor)
        layouts = []

        def recording(st, bucket):
            layouts.append([st.names[p] for p in bucket.parameters()])
            return tddp.hook(st, bucket)

        ddp.register_comm_hook(state, recording)
        return ddp, comp, layouts

    def step(ddp, grads, skip=(), factor=1.0):
        ddp.zero_grad(set_to_none=True)
        (ddp(grads, skip) * factor).backward()
        return {n: (np.zeros(p.shape) if p.grad is None else p.grad.detach().double().numpy().copy())
                for n, p in ddp.module.named_parameters()}

    from tests.parallel.ddp_probe import residuals as owed

    def train(ddp, comp, steps, shapes=MANY, half=(), skip_odd=(), factor=1.0, first=0):
        outs, calls, reports = [], [], []
        for t in range(first, first + steps):
            with _Counter() as c:
                outs.append(step(ddp, _grads(rank, t, shapes, half), skip_odd if t % 2 else (), factor))
            calls.append(c.calls)
            w = comp.wire_bytes()
            reports.append({"bytes": comp.bytes_per_step().payload, "wire_sum": sum(v.payload for v in w.values()),
                            "wire_keys": sorted(w), "metrics_keys": sorted(comp.metrics()),
                            "groups": sorted(comp.codec.groups.groups)})
        return {"outs": outs, "calls": calls, "reports": reports, "owed": owed(comp)}

    out = {}
    errors = {}

    def _bf16(spec):
        ddp = DDP(Net(MANY, FORWARD).to(torch.bfloat16), bucket_cap_mb=CAP)
        comp = tddp.register_comm_hook(ddp, Compression.from_spec(spec))
        outs = []
        for t in range(STEPS):
            g = {n: v.to(torch.bfloat16) for n, v in grads_of(rank, t, MANY).items()}
            outs.append(step(ddp, g))
        return {"outs": outs, "owed": owed(comp)}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported per experiment, the others still run
            import traceback
            errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            dist.barrier()

    # 1. a bucket whose rebuilt order keeps its first and last tensor but swaps the middle
    for per_tensor in (False, True):
        def four(per_tensor=per_tensor):
            ddp, comp, layouts = make("topkc:0.1", FOUR, FOUR_FORWARD, per_tensor)
            rec = train(ddp, comp, STEPS, FOUR)
            rec["layouts"] = layouts
            return rec
        attempt(("four", per_tensor), four)
    # 2. many buckets, regrouped by DDP's rebuild: balance, bytes, reports
    for spec in BALANCE_SPECS:
        def many(spec=spec):
            ddp, comp, layouts = make(spec, bucket_cap_mb=CAP)
            rec = train(ddp, comp, STEPS)
            rec["layouts"] = layouts
            return rec
        attempt(("many", spec), many)
    attempt(("many per-tensor", "thc"), lambda: train(*make("thc", bucket_cap_mb=CAP, per_tensor=True)[:2], STEPS))
    # 3. gradient_as_bucket_view, static_graph, with the rebuild
    attempt(("view", "topkc:0.1"), lambda: train(*make("topkc:0.1", bucket_cap_mb=CAP,
                                                       gradient_as_bucket_view=True)[:2], STEPS))
    attempt(("static", "thc"), lambda: train(*make("thc", bucket_cap_mb=CAP, static_graph=True)[:2], STEPS))
    # 4. mixed precision (float16 and float32 buckets) and a frozen parameter
    for spec in ("topkc:0.1", "thc"):
        attempt(("mixed", spec), lambda spec=spec: train(
            *make(spec, bucket_cap_mb=CAP, half=HALF, frozen=FROZEN)[:2], STEPS, half=HALF))
    # 5. loss scaling (2**8 divides out exactly)
    for spec in ("topkc:0.1", "thc", "signsgd"):
        def scaled(spec=spec):
            ddp, comp, _ = make(spec, bucket_cap_mb=CAP)
            comp.set_loss_scale(torch.tensor(256.0))
            return train(ddp, comp, STEPS, factor=256.0)
        attempt(("scaled", spec), scaled)
    # 6. fp16 warm-up of 2 steps, bucketed and per tensor
    for per_tensor in (False, True):
        attempt(("warmup", per_tensor), lambda per_tensor=per_tensor: train(
            *make("thc:fp16_warmup=2", bucket_cap_mb=CAP, per_tensor=per_tensor)[:2], STEPS))
    # 7. find_unused_parameters with parameters inside flat groups unused at odd steps
    for spec in ("topkc:0.1", "thc"):
        for view in (False, True):
            attempt(("unused", spec, view), lambda spec=spec, view=view: train(
                *make(spec, bucket_cap_mb=CAP, find_unused_parameters=True, gradient_as_bucket_view=view)[:2],
                STEPS, skip_odd=SKIPPED))
    for spec in ("topkc:0.1", "thc"):  # per tensor: each unit's own parameter's flag
        attempt(("unused per-tensor", spec), lambda spec=spec: train(
            *make(spec, bucket_cap_mb=CAP, find_unused_parameters=True, per_tensor=True)[:2],
            STEPS, skip_odd=SKIPPED))
    # 8. Join with uneven inputs on the bucketed path
    for spec in ("topkc:0.1", "thc"):
        def joined(spec=spec):
            ddp, comp, _ = make(spec, bucket_cap_mb=CAP)
            outs = []
            with Join([ddp]):
                for t in range(JOIN_BATCHES[rank]):
                    outs.append(step(ddp, _grads(rank, t, MANY)))
                at_join = owed(comp)
            return {"outs": outs, "at_join": at_join, "owed": owed(comp)}
        attempt(("join", spec), joined)
    def save_gathered(comp, path):
        """Every rank's state gathered, saved by rank 0, the others waiting for the file."""
        state = comp.state_dict(gather=True)
        if rank == 0:
            torch.save(state, path)
        dist.barrier()

    # 9. a checkpoint saved under one bucket size, loaded under another, per tensor, and into a
    # fresh compressor with rank= before it is bound (weights_only=True everywhere)
    for spec in ("topkc:0.1", "thc"):
        def ckpt(spec=spec):
            path = os.path.join(tmp, f"{spec}.pt")
            ddp, comp, _ = make(spec, bucket_cap_mb=CAP)
            train(ddp, comp, 3)
            save_gathered(comp, path)
            rec = {"continued": train(ddp, comp, 2, first=3)}
            loaded = torch.load(path, weights_only=True)
            for name, kw in (("cap", {"bucket_cap_mb": 0.05}), ("per_tensor", {"per_tensor": True}),
                             ("same", {"bucket_cap_mb": CAP})):
                d2, c2, _ = make(spec, **kw)
                c2.load_state_dict(loaded)
                rec[name] = train(d2, c2, 2, first=3)
            fresh = Compression.from_spec(spec)
            fresh.load_state_dict(loaded, rank=rank)
            again = os.path.join(tmp, f"{spec}.{rank}.pt")
            torch.save(fresh.state_dict(), again)
            fresh2 = Compression.from_spec(spec)
            fresh2.load_state_dict(torch.load(again, weights_only=True), rank=rank)
            d3, c3, _ = make(spec, comp=fresh2, bucket_cap_mb=0.05)
            rec["fresh"] = train(d3, c3, 2, first=3)
            # loaded into the running compressor itself (its groups hold the tensors now): the
            # same layout, so steps 3 and 4 replay exactly
            comp.load_state_dict(loaded)
            rec["reload"] = train(ddp, comp, 2, first=3)
            # a per-tensor run's checkpoint loaded into the running bucketed compressor
            dp, cp, _ = make(spec, per_tensor=True, bucket_cap_mb=CAP)
            train(dp, cp, 3)
            comp.load_state_dict(cp.state_dict())
            rec["from_per_tensor"] = (train(dp, cp, 2, first=3), train(ddp, comp, 2, first=3))
            return rec
        attempt(("ckpt", spec), ckpt)
    # 10. a checkpoint of the first layout (saved after step 0, before DDP's rebuild)
    for spec in ("topkc:0.1", "thc"):
        def early(spec=spec):
            path = os.path.join(tmp, f"early-{spec}.pt")
            ddp, comp, _ = make(spec, bucket_cap_mb=CAP)
            train(ddp, comp, 1)
            save_gathered(comp, path)
            rec = {"continued": train(ddp, comp, 2, first=1)}
            d2, c2, _ = make(spec, bucket_cap_mb=CAP)
            c2.load_state_dict(torch.load(path, weights_only=True))
            rec["same"] = train(d2, c2, 2, first=1)
            return rec
        attempt(("early", spec), early)
    # 12. Join where a rank joins before DDP's rebuild (after one step), each rank in turn
    for first in (0, 1):
        def join_early(first=first):
            ddp, comp, layouts = make("topkc:0.1", bucket_cap_mb=CAP)
            outs = []
            with Join([ddp]):
                for t in range(1 if rank == first else 4):
                    outs.append(step(ddp, _grads(rank, t, MANY)))
            return {"outs": outs, "owed": owed(comp), "layouts": layouts}
        attempt(("join early", first), join_early)
    # 13. no_sync accumulation (3 micro-batches) with the rebuild
    def accumulate():
        ddp, comp, _ = make("topkc:0.1", bucket_cap_mb=CAP)
        outs = []
        for t in range(3):
            ddp.zero_grad(set_to_none=True)
            for k in range(2):
                with ddp.no_sync():
                    ddp(_grads(rank, 10 * t + k, MANY)).backward()
            ddp(_grads(rank, 10 * t + 2, MANY)).backward()
            outs.append({n: p.grad.detach().double().numpy().copy() for n, p in ddp.module.named_parameters()})
        return {"outs": outs, "owed": owed(comp)}
    attempt(("no_sync", "topkc:0.1"), accumulate)
    # 14. find_unused_parameters: l1.weight and big.weight unused on rank 1 only, at odd steps
    def one_rank_unused():
        ddp, comp, _ = make("thc", bucket_cap_mb=CAP, find_unused_parameters=True)
        return train(ddp, comp, STEPS, skip_odd=SKIPPED if rank == 1 else ())
    attempt(("unused rank 1", "thc"), one_rank_unused)
    # 15. a bfloat16 model
    for spec in ("topkc:0.1", "thc", "fp16"):
        attempt(("bf16", spec), lambda spec=spec: _bf16(spec))
    # 16. a loss scale that changes between steps (a GradScaler's), with unused parameters
    def rescaled():
        ddp, comp, _ = make("topkc:0.1", bucket_cap_mb=CAP, find_unused_parameters=True)
        scale = torch.tensor(256.0)
        comp.set_loss_scale(scale)
        outs = []
        for t in range(STEPS):
            scale.fill_(256.0 * 4 ** t)
            got = step(ddp, _grads(rank, t, MANY), SKIPPED if t % 2 else (), float(scale))
            outs.append({n: v / float(scale) for n, v in got.items()})
        return {"outs": outs, "owed": owed(comp)}
    attempt(("rescaled", "topkc:0.1"), rescaled)
    attempt(("unused plain", "topkc:0.1"), lambda: train(
        *make("topkc:0.1", bucket_cap_mb=CAP, find_unused_parameters=True)[:2], STEPS, skip_odd=SKIPPED))
    # 17. Join with find_unused_parameters on the bucketed path
    def join_unused(spec="thc", per_tensor=False, hooked=True):
        if hooked:
            ddp, comp, _ = make(spec, bucket_cap_mb=CAP, find_unused_parameters=True, per_tensor=per_tensor)
        else:
            ddp, comp = DDP(Net(MANY, FORWARD), bucket_cap_mb=CAP, find_unused_parameters=True), None
        owe = (lambda c: {n: None for n in MANY}) if comp is None else owed
        outs = []
        with Join([ddp]):
            for t in range(JOIN_BATCHES[rank]):
                outs.append(step(ddp, _grads(rank, t, MANY), SKIPPED if t % 2 else ()))
            at_join = owe(comp)
        return {"outs": outs, "at_join": at_join, "owed": owe(comp)}
    attempt(("join unused", "thc"), join_unused)
    attempt(("join unused", "thc per-tensor"), lambda: join_unused(per_tensor=True))
    attempt(("join unused", "fp16"), lambda: join_unused("fp16"))
    attempt(("join unused", "plain DDP"), lambda: join_unused(hooked=False))
    # 11. mixed precision under loss scaling
    def mixed_scaled():
        ddp, comp, _ = make("thc", bucket_cap_mb=CAP, half=HALF, frozen=FROZEN)
        comp.set_loss_scale(torch.tensor(256.0))
        return train(ddp, comp, STEPS, half=HALF, factor=256.0)
    attempt(("mixed scaled", "thc"), mixed_scaled)
    out["errors"] = errors
    return out
