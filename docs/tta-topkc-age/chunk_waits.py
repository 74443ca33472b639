"""How long TopKC's chunks wait on ``lm-comm``: the measurement behind docs/adam.md's "TopKC's
age bound".

Two ranks simulated in one process (no Horovod, no network): each rank's gradient comes from
its own shard of ``lm-comm``'s data (:class:`hvd_gradcomp.bench.workers.torch_workloads.LMCommWorkload`,
the users' recipe: AdamW (0.9, 0.95), weight decay 0.1 on matrices, 5% warm-up, cosine decay
over FP16's 0.5-epoch budget of 294 steps); every tensor of at least 1024 coordinates goes
through the scheme with each rank's own state (:func:`~hvd_gradcomp.base.compress_tensor` /
:func:`~hvd_gradcomp.base.finish_tensor`), the two payloads summed and halved (Average) in
the payload's float16; smaller tensors as FP16. For every chunk sent it records its *wait*,
the steps it went unsent before (the age ``max_age`` bounds), and the share of the slots
taken by chunks sent for their age. Prints one JSON line.

    PYTHONPATH=. python docs/tta-topkc-age/chunk_waits.py topkc:ratio=0.1,max_age=20 300

Single-threaded, about 100 s for 300 steps on one core.
"""
import json
import math
import sys

import numpy as np
import torch

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import one_rank
from hvd_gradcomp.registry import parse_spec, make_scheme
from hvd_gradcomp.bench.workers.torch_workloads import LMCommWorkload
from torch_backend import OPS


def main(spec, steps, ranks=2, budget=294, min_numel=1024):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    works = [LMCommWorkload(r, ranks, 0, 16) for r in range(ranks)]
    model = works[0].model()
    opt = works[0].optimizer(list(model.named_parameters()), 2e-3)
    schedule = works[0].schedule(opt, budget)
    ops = one_rank(OPS)
    scheme = make_scheme(*parse_spec(spec)[:1], **parse_spec(spec)[1])
    cfg = scheme.config
    big = {k: p for k, p in model.named_parameters() if p.numel() >= min_numel}
    infos = {k: [TensorInfo(k, tuple(p.shape), "float32", ranks, r, "average") for r in range(ranks)]
             for k, p in big.items()}
    states = {k: [scheme.init(ops, infos[k][r], p.detach()) for r in range(ranks)] for k, p in big.items()}
    ages = {k: np.zeros(-(-p.numel() // cfg.chunk), np.int64) for k, p in big.items()}
    waits, forced, evals = [], 0, []
    batches = [w.batches(0) for w in works]
    for step in range(steps):
        schedule.set(step)
        grads = []
        for r in range(ranks):
            x, y = next(batches[r])
            model.zero_grad()
            works[r].loss(model, x, y).backward()
            grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        for k, p in model.named_parameters():
            if k not in big:
                p.grad = sum(g[k].half().float() for g in grads) / ranks
                continue
            sent = [compress_tensor(scheme, ops, grads[r][k], states[k][r], infos[k][r]) for r in range(ranks)]
            total = sent[0][0]
            for payload, _ in sent[1:]:
                total = total + payload
            total = total * (1.0 / ranks)
            for r in range(ranks):
                out, states[k][r] = finish_tensor(scheme, ops, total, sent[r][1], states[k][r], infos[k][r])
            p.grad = out.reshape(p.shape)
            idx = sent[0][1].idx.numpy()
            age = ages[k]
            waits += [int(age[i]) for i in idx]
            if cfg.max_age:
                forced += int((age[idx] >= cfg.max_age).sum())
            age += 1
            age[idx] = 0
        opt.step()
        if (step + 1) % 20 == 0 or step == steps - 1:
            model.eval()
            nll = count = 0.0
            for w in works:
                t, c = w.evaluate(model)
                nll, count = nll + t, count + c
            model.train()
            evals.append((step + 1, round(math.exp(nll / count), 2)))
    w = np.array(waits)
    return {"spec": spec, "steps": steps, "slots": len(waits), "forced_share": round(forced / len(waits), 4),
            "wait_mean": round(float(w.mean()), 2), "wait_p50": float(np.percentile(w, 50)),
            "wait_p90": float(np.percentile(w, 90)), "wait_p99": float(np.percentile(w, 99)),
            "wait_max": int(w.max()), "chunks": int(sum(len(a) for a in ages.values())),
            "never_sent": int(sum((a >= steps).sum() for a in ages.values())), "perplexity": evals}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
