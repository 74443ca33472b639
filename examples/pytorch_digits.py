"""Train a digits classifier on Horovod workers with a gradient compressor (PyTorch, AMP).

    horovodrun -np 2 python examples/pytorch_digits.py --compression topkc:0.1

Data: scikit-learn's bundled 8x8 digits (no download), each worker a disjoint shard. Mixed
precision: bfloat16 autocast (what CPUs run; on a GPU, ``torch.autocast("cuda")`` and
``GradScaler("cuda")``) and a GradScaler, which the compressor is told about so its error
feedback stays in unscaled units. Rank 0 prints the test accuracy every epoch, and at the end
the bytes each worker sent per step against FP16.
"""
import argparse
import logging

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from torch_backend import Compression
from torch_backend.stats import CompressionStats

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--compression", default="topkc:0.1", help="e.g. fp16, topkc:0.1, thc, powersgd:4")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.025, help="times the number of workers")
parser.add_argument("--log-dir", default=None, help="write TensorBoard scalars here")
args = parser.parse_args()

hvd.init()
logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                    format="%(message)s")
log = logging.getLogger("example")
torch.manual_seed(0)
torch.set_num_threads(1)  # the workers share this machine's cores

# Data: a fixed split; each worker trains on every size-th example, tests on all of them.
x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
pixels = StandardScaler().fit(x_train)  # zero mean, unit variance per pixel
x_train, x_test = pixels.transform(x_train), pixels.transform(x_test)
per_worker = len(x_train) // hvd.size()  # the same number of steps on every worker
x_train = torch.tensor(x_train[hvd.rank()::hvd.size()][:per_worker], dtype=torch.float32)
y_train = torch.tensor(y_train[hvd.rank()::hvd.size()][:per_worker])
x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10))
compression = Compression.from_spec(args.compression)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
scaler = torch.amp.GradScaler("cpu")
compression.set_loss_scale(scaler)  # residuals in the gradient's own units
stats = CompressionStats(compression, model.parameters(), log_dir=args.log_dir)

step = 0
for epoch in range(1, args.epochs + 1):
    model.train()
    order = torch.randperm(per_worker)
    for i in range(0, per_worker - args.batch_size + 1, args.batch_size):
        batch = order[i:i + args.batch_size]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        scaler.scale(loss).backward()  # Horovod compresses and all-reduces each gradient
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        stats.step()
        step += 1
        if step == args.steps:
            break
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    accuracy = hvd.allreduce(torch.tensor(accuracy), name="accuracy").item()  # the same everywhere
    log.info("epoch %d, step %d: loss %.4f, test accuracy %.2f%%", epoch, step, loss.item(), 100 * accuracy)
    if step == args.steps:
        break

log.info("done: final test accuracy %.2f%%", 100 * accuracy)
stats.log()  # "step 220: topkc:ratio=0.1: 19,208 B/step sent, FP16 170,004 B/step (FP16/ours 8.85x); ..."
stats.close()
