"""Smoke test worker (PyTorch): two steps of a tiny model with hvd.DistributedOptimizer and
Horovod's own fp16 compression; each rank writes its final parameters to ``<out>.<rank>.json``.

Rank r trains on rows [4r, 4r+4) of a fixed batch of 8, so the result must equal one process
training on the whole batch (the mean of the ranks' gradients is the full-batch gradient).
"""
import json
import sys

import torch

import horovod.torch as hvd


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def main(out):
    hvd.init()
    net = model()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(),
                                   compression=hvd.Compression.fp16)
    x, y = batch()
    lo, hi = 4 * hvd.rank(), 4 * hvd.rank() + 4
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    with open(f"{out}.{hvd.rank()}.json", "w") as f:
        json.dump({k: v.tolist() for k, v in net.state_dict().items()}, f)


if __name__ == "__main__":
    main(sys.argv[1])
