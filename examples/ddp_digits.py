"""Train a digits classifier with PyTorch DDP and a gradient compressor as its comm hook (AMP).

    torchrun --nproc_per_node 2 examples/ddp_digits.py --compression topkc:0.1

Data: scikit-learn's bundled 8x8 digits (no download), each worker a disjoint shard. Mixed
precision: bfloat16 autocast (what CPUs run; on a GPU, ``torch.autocast("cuda")``,
``GradScaler("cuda")`` and ``backend="nccl"``) and a GradScaler, which the compressor is told
about so its error feedback stays in unscaled units. Rank 0 prints the test accuracy every
epoch, and at the end the bytes each worker sent per step against FP16.
"""
import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_backend import Compression
from torch_backend.ddp import register_comm_hook
from torch_backend.stats import CompressionStats

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--compression", default="topkc:0.1", help="e.g. fp16, topkc:0.1, thc, powersgd:4, auto")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.025, help="times the number of workers")
parser.add_argument("--log-dir", default=None, help="write TensorBoard scalars here")
parser.add_argument("--save", default=None, help="save a checkpoint here at the end (rank 0)")
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, size = dist.get_rank(), dist.get_world_size()
logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
log = logging.getLogger("example")
torch.manual_seed(0)
torch.set_num_threads(1)  # the workers share this machine's cores

# Data: a fixed split; each worker trains on every size-th example, tests on all of them.
x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
pixels = StandardScaler().fit(x_train)  # zero mean, unit variance per pixel
x_train, x_test = pixels.transform(x_train), pixels.transform(x_test)
per_worker = len(x_train) // size  # the same number of steps on every worker
x_train = torch.tensor(x_train[rank::size][:per_worker], dtype=torch.float32)
y_train = torch.tensor(y_train[rank::size][:per_worker])
x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10))
ddp_model = DDP(model)  # broadcasts rank 0's parameters
compression = register_comm_hook(ddp_model, Compression.from_spec(args.compression))
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr * size, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
compression.set_loss_scale(scaler)  # residuals in the gradient's own units
stats = CompressionStats(compression, model.parameters(), log_dir=args.log_dir, rank=rank)

step = 0
for epoch in range(1, args.epochs + 1):
    ddp_model.train()
    order = torch.randperm(per_worker)
    for i in range(0, per_worker - args.batch_size + 1, args.batch_size):
        batch = order[i:i + args.batch_size]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp_model(x_train[batch]), y_train[batch])
        scaler.scale(loss).backward()  # DDP's hook compresses and all-reduces each bucket
        scaler.step(optimizer)
        scaler.update()
        stats.step()
        step += 1
    ddp_model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean()
    dist.all_reduce(accuracy)  # the same everywhere
    accuracy = accuracy.item() / size
    log.info("epoch %d, step %d: loss %.4f, test accuracy %.2f%%", epoch, step, loss.item(), 100 * accuracy)

log.info("done: final test accuracy %.2f%%", 100 * accuracy)
stats.log()  # "step 220: topkc:ratio=0.1: 19,208 B/step sent, FP16 170,004 B/step (FP16/ours 8.85x); ..."
stats.close()
checkpoint = {"model": model.state_dict(), "compression": compression.state_dict(gather=True)}  # all ranks
if rank == 0 and args.save:  # resume: compression.load_state_dict(torch.load(...)["compression"])
    torch.save(checkpoint, args.save)
dist.destroy_process_group()
