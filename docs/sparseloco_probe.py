"""The probe of docs/sparseloco.md: lm-comm rows under UpdateSync on torch.distributed Gloo
(loopback, no emulated link), perplexity every --eval-every steps and, with --burst, the size
of each sync's applied update against the ranks' mean local change on the coordinates it
moved. Run from the repository root:

    PYTHONPATH=$PWD torchrun --nproc_per_node 2 docs/sparseloco_probe.py \\
        --spec "sparseloco" --every 16 --outer-lr 1 --outer-momentum 0 --steps 512 --burst
"""
import argparse, json, math, os, sys, time
import torch, torch.distributed as dist
from hvd_gradcomp.bench.workers.torch_workloads import LMCommWorkload
from torch_backend import Compression, UpdateSync

ap = argparse.ArgumentParser()
ap.add_argument("--spec", default="fp16"); ap.add_argument("--every", type=int, default=16)
ap.add_argument("--outer-lr", type=float, default=1.0); ap.add_argument("--outer-momentum", type=float, default=0.0)
ap.add_argument("--steps", type=int, default=1024); ap.add_argument("--total", type=int, default=1029)
ap.add_argument("--eval-every", type=int, default=128); ap.add_argument("--out", default=None)
ap.add_argument("--burst", action="store_true", help="log the applied update against the mean local change on the coordinates it moved")
a = ap.parse_args()
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, n = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
wl = LMCommWorkload(rank, n, 0, 16)
model = wl.model()
opt = wl.optimizer(list(model.named_parameters()), 2e-3)
sched = wl.schedule(opt, a.total)
sync = UpdateSync(opt, model=model, compression=Compression.from_spec(a.spec), every=a.every,
                  outer_lr=a.outer_lr, outer_momentum=a.outer_momentum, backend="torch")
def evaluate():
    t, c = wl.evaluate(model)
    v = torch.tensor([t, c], dtype=torch.float64); dist.all_reduce(v)
    return wl.metric(v[0].item(), v[1].item())
log, step, t0 = [], 0, time.time()
bursts, worsts, covs = [], [], []
epoch = 0
while step < a.steps:
    for x, y in wl.batches(epoch):
        step += 1
        sync.zero_grad()
        wl.loss(model, x, y).backward()
        sched.set(step)
        if a.burst and sync.local_steps + 1 >= sync.every:
            sync.optimizer.step(); sync.local_steps += 1
            with torch.no_grad():
                deltas = [(p.detach() - th).clone() for p, th in zip(sync._params, sync._theta)]
                for dl in deltas: dist.all_reduce(dl); dl /= n
                before = [th.clone() for th in sync._theta]
            sync.synchronize()
            with torch.no_grad():
                num = den = cov = tot = 0.0; worst = 0.0
                for dl, b0, th in zip(deltas, before, sync._theta):
                    ap = th - b0; m = ap != 0
                    cov += m.sum().item(); tot += m.numel()
                    if m.any():
                        r = (ap[m].norm() / dl[m].norm().clamp_min(1e-12)).item()
                        worst = max(worst, r); num += ap[m].norm().item() ** 2; den += dl[m].norm().item() ** 2
                bursts.append((num / max(den, 1e-24)) ** 0.5); worsts.append(worst); covs.append(cov / tot)
        else:
            sync.step()
        if step % a.eval_every == 0 or step == a.steps:
            ppl = evaluate()
            extra = {}
            if bursts:
                extra = {"burst": sum(bursts) / len(bursts), "worst": max(worsts), "moved": sum(covs) / len(covs)}
                bursts.clear(); worsts.clear(); covs.clear()
            log.append((step, ppl, extra))
            if rank == 0:
                print(f"{a.spec} H={a.every} step {step} ppl {ppl:.3f} {extra} ({time.time()-t0:.0f}s)", flush=True)
        if step >= a.steps:
            break
    epoch += 1
if rank == 0:
    bps = sync.bytes_per_step()
    res = {"spec": a.spec, "every": a.every, "outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum,
           "log": log, "bytes_per_step": bps.payload, "seconds": time.time() - t0}
    print(json.dumps(res))
    if a.out:
        with open(a.out, "a") as f: f.write(json.dumps(res) + "\n")
dist.destroy_process_group()
