"""Train a digits classifier with PyTorch FSDP2 as HSDP (sharded within, replicated across
groups of ranks) and a gradient compressor on the all-reduce across replicas.

    torchrun --nproc_per_node 4 examples/fsdp_digits.py --shards 2 --compression thc

Ranks form a (replicate, shard) mesh of world / shards replicas of ``--shards`` ranks each:
each layer's parameters are sharded within a replica, FSDP reduce-scatters their gradients
there, and the compressor sends each shard's gradient to the other replicas (the slow link,
in a real cluster). Data: scikit-learn's bundled 8x8 digits (no download), each rank a
disjoint part. Rank 0 prints the test accuracy every epoch, and at the end the bytes this rank
sent per step against FP16: across replicas, and with ``--reduce-scatter`` within its replica. ``--reduce-scatter thc`` (or fp16, bf16, signsgd)
compresses the reduce-scatter within the replica too, with a compressor of its own. Needs no
Horovod (``pip install ".[ddp]" scikit-learn``).
"""
import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torch_backend import Compression
from torch_backend.fsdp import install, install_reduce_scatter
from torch_backend.stats import CompressionStats

parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
parser.add_argument("--compression", default="thc", help="e.g. fp16, topkc:0.1, thc, powersgd:4, auto")
parser.add_argument("--reduce-scatter", default=None, help="compress the reduce-scatter within a replica "
                    "too (--shards >= 2): none, fp16, bf16, thc, signsgd")
parser.add_argument("--shards", type=int, default=1, help="ranks per replica (the world size divides by it)")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.025, help="times the number of ranks")
parser.add_argument("--save", default=None, help="save each rank's checkpoint as SAVE.rank<r>")
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, size = dist.get_rank(), dist.get_world_size()
logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
log = logging.getLogger("example")
torch.manual_seed(0)  # the same initial parameters on every rank
torch.set_num_threads(1)  # the workers share this machine's cores
mesh = init_device_mesh("cpu", (size // args.shards, args.shards), mesh_dim_names=("replicate", "shard"))

x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
pixels = StandardScaler().fit(x_train)
x_train, x_test = pixels.transform(x_train), pixels.transform(x_test)
per_rank = len(x_train) // size  # the same number of steps on every rank
x_train = torch.tensor(x_train[rank::size][:per_rank], dtype=torch.float32)
y_train = torch.tensor(y_train[rank::size][:per_rank])
x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
compression = install(model, Compression.from_spec(args.compression))  # the cross-replica all-reduce
scatter = install_reduce_scatter(model, Compression.from_spec(args.reduce_scatter)) if args.reduce_scatter else None
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
# What this rank sends across replicas: its shards (FP16 would send 2 bytes a coordinate of
# them); within its replica, with --reduce-scatter: the whole gradients, reduce-scattered.
stats = CompressionStats(compression, [p.to_local() for p in model.parameters()], rank=rank)
scatter_stats = CompressionStats(scatter, list(model.parameters()), rank=rank) if scatter else None

step = 0
for epoch in range(1, args.epochs + 1):
    order = torch.randperm(per_rank)
    for i in range(0, per_rank - args.batch_size + 1, args.batch_size):
        batch = order[i:i + args.batch_size]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        loss.backward()  # reduce-scatter in the replica, compressed all-reduce across replicas
        optimizer.step()
        stats.step()
        if scatter_stats:
            scatter_stats.step()
        step += 1
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean()
    log.info("epoch %d, step %d: loss %.4f, test accuracy %.2f%%", epoch, step, loss.item(), 100 * accuracy)

log.info("done: final test accuracy %.2f%%", 100 * accuracy)
log.info("all-reduce across replicas: %s", stats.report().line())
if scatter_stats:
    log.info("reduce-scatter within the replica: %s", scatter_stats.report().line())
if args.save:  # per rank: its model and optimizer shards with its compressor state
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                "compression": compression.state_dict(),
                "scatter": scatter.state_dict() if scatter else None}, f"{args.save}.rank{rank}")
dist.destroy_process_group()
