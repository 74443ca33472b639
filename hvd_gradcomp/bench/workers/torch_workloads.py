"""PyTorch models, data shards and the training loop shared by the PyTorch TTA workers.

Workloads (data: :mod:`hvd_gradcomp.bench.data`):

- ``digits``: an MLP 64 -> 2048 -> 2048 -> 10 (ReLU) on scikit-learn's 8x8 digits;
  4,349,962 parameters (17.4 MB of float32 gradient per step, so communication matters).
  Metric: test accuracy (fraction), higher is better. SGD, momentum 0.9.
- ``lm``: a byte-level causal transformer (2 pre-norm layers, width 192, 4 heads, context 64)
  on Python standard-library source files; 1,000,704 parameters. Metric: validation
  perplexity per byte on 128 fixed windows of the validation files, lower is better. Adam.

The loop (:func:`train`) is the same under Horovod and under ``torch.distributed`` DDP; a
*trainer* object supplies one optimizer step (returning the time split) and a Sum all-reduce
of a few host numbers for evaluation.
"""
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from .. import data
from ..worker import Recorder

__all__ = ["DigitsWorkload", "LMWorkload", "WORKLOADS", "train", "versions"]


def versions():
    """Library versions recorded with every run."""
    import horovod
    return {"torch": torch.__version__, "horovod": horovod.__version__, "numpy": np.__version__}


class DigitsMLP(torch.nn.Module):
    def __init__(self, hidden=2048):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DigitsWorkload:
    """Digits classification (module docs). Batches: this rank's shard, ``batch_size`` rows."""

    name = "digits"
    metric_name = "test accuracy"
    higher_is_better = True
    defaults = dict(target=0.96, lr=0.05, batch_size=32, eval_every=5, max_epochs=20)

    def __init__(self, rank, world_size, seed, batch_size, hidden=2048):
        self.rank, self.world_size, self.seed, self.batch_size = rank, world_size, seed, batch_size
        x_train, y_train, x_test, y_test = data.digits()
        self.x_train, self.y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
        # Each rank evaluates every world_size-th test example; counts are summed.
        self.x_test = torch.from_numpy(x_test[rank::world_size])
        self.y_test = torch.from_numpy(y_test[rank::world_size])
        self.hidden = hidden
        self.steps_per_epoch = (len(x_train) // world_size) // batch_size

    def model(self):
        return DigitsMLP(self.hidden)

    def optimizer(self, params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    def batches(self, epoch):
        idx = data.shard_indices(len(self.x_train), self.rank, self.world_size, self.seed, epoch)
        for i in range(self.steps_per_epoch):
            j = torch.from_numpy(idx[i * self.batch_size:(i + 1) * self.batch_size])
            yield self.x_train[j], self.y_train[j]

    def loss(self, model, x, y):
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        """``(sum, count)`` over this rank's test shard: correct predictions, examples."""
        correct = (model(self.x_test).argmax(1) == self.y_test).sum().item()
        return float(correct), float(len(self.y_test))

    @staticmethod
    def metric(total, count):
        return total / count

    def describe(self):
        return {"workload": self.name, "metric": self.metric_name, "model": f"MLP 64-{self.hidden}-{self.hidden}-10",
                "train_examples": len(self.x_train), "test_examples_total": 360}


class ByteTransformer(torch.nn.Module):
    def __init__(self, context=64, width=192, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.pos = torch.nn.Parameter(torch.zeros(context, width))
        torch.nn.init.normal_(self.pos, std=0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


class LMWorkload:
    """Byte-level language model on stdlib sources (module docs).

    An epoch is one pass over the training bytes cut into non-overlapping windows of
    ``context + 1`` bytes, shuffled per epoch and sharded by rank.
    """

    name = "lm"
    metric_name = "validation perplexity"
    higher_is_better = False
    defaults = dict(target=10.5, lr=2e-3, batch_size=16, eval_every=10, max_epochs=1)
    valid_windows = 128

    def __init__(self, rank, world_size, seed, batch_size, context=64):
        self.rank, self.world_size, self.seed, self.batch_size = rank, world_size, seed, batch_size
        self.context = context
        train, valid, self.corpus = data.stdlib_corpus()
        n = len(train) // (context + 1)
        self.train = torch.from_numpy(train[:n * (context + 1)].astype(np.int64)).view(n, context + 1)
        m = len(valid) // (context + 1)
        windows = torch.from_numpy(valid[:m * (context + 1)].astype(np.int64)).view(m, context + 1)
        pick = np.linspace(0, m - 1, self.valid_windows).round().astype(np.int64)
        self.valid = windows[torch.from_numpy(pick)][rank::world_size]
        self.steps_per_epoch = (n // world_size) // batch_size

    def model(self):
        return ByteTransformer(self.context)

    def optimizer(self, params, lr):
        return torch.optim.Adam(params, lr=lr)

    def batches(self, epoch):
        idx = data.shard_indices(len(self.train), self.rank, self.world_size, self.seed, epoch)
        for i in range(self.steps_per_epoch):
            w = self.train[torch.from_numpy(idx[i * self.batch_size:(i + 1) * self.batch_size])]
            yield w[:, :-1], w[:, 1:]

    def loss(self, model, x, y):
        return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model):
        """``(sum, count)`` over this rank's validation windows: NLL in nats, bytes."""
        x, y = self.valid[:, :-1], self.valid[:, 1:]
        nll = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction="sum").item()
        return float(nll), float(y.numel())

    @staticmethod
    def metric(total, count):
        return math.exp(min(total / count, 50.0))

    def describe(self):
        return {"workload": self.name, "metric": self.metric_name,
                "model": f"byte transformer, 2 layers, width 192, context {self.context}",
                "corpus": self.corpus, "valid_windows": self.valid_windows}


WORKLOADS = {"digits": DigitsWorkload, "lm": LMWorkload}


def train(workload, model, trainer, args, rank, world_size, meta, bytes_fn):
    """The shared loop: steps, evaluations on schedule, the stop rule, the JSON result.

    Args:
        workload: a workload object (batches, evaluate, metric).
        model: the (wrapped) model the trainer steps.
        trainer: ``trainer.step(x, y) -> (loss tensor, compute_s, codec_s, comm_s)`` and
            ``trainer.allreduce_sum(list of float) -> list of float`` (identical on all ranks).
        args: flags of :func:`hvd_gradcomp.bench.worker.add_common_args`.
        meta: recorded with the run.
        bytes_fn: ``() -> dict`` of bytes on the wire per step (called at the end: ``auto``'s
            bytes follow its choices).
    """
    meta = dict(meta, **workload.describe(), versions=versions(),
                params=sum(p.numel() for p in model.parameters()))
    rec = Recorder(args, rank, world_size, workload.steps_per_epoch, workload.higher_is_better, meta)

    def evaluate():
        model.eval()
        total, count = workload.evaluate(model)
        model.train()
        total, count, clock = trainer.allreduce_sum([total, count, rec.clock])
        return rec.evaluate(workload.metric(total, count), clock / world_size)

    stop = evaluate()  # the metric at t = 0
    epoch = 0
    while not stop and rec.step_count < rec.max_steps:
        for x, y in workload.batches(epoch):
            loss, compute_s, codec_s, comm_s = trainer.step(x, y)
            rec.step(compute_s, codec_s, comm_s, loss.item())
            if rec.due() and evaluate():
                stop = True
                break
        epoch += 1
    rec.write(bytes_fn(), {"finished": time.time()})
    return rec
