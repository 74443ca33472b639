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
from ..worker import OPTIMIZERS, Recorder, optimizer_class, parse_optimizer

__all__ = ["DigitsWorkload", "LMWorkload", "LMCommWorkload", "ShakespeareWorkload", "WORKLOADS", "train", "versions",
           "build_optimizer", "AdamProbe", "LRSchedule", "add_recipe_args", "make_schedule", "lr_factor", "decay_groups", "RECIPES"]


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
    width, layers = 192, 2
    adam_log_every = 50  # AdamProbe (the Horovod worker's --adam-log-every default)

    # (train bytes, validation bytes, description): the corpus; another text keeps the rest
    load_corpus = staticmethod(data.stdlib_corpus)

    def __init__(self, rank, world_size, seed, batch_size, context=64):
        self.rank, self.world_size, self.seed, self.batch_size = rank, world_size, seed, batch_size
        self.context = context
        train, valid, self.corpus = self.load_corpus()
        n = len(train) // (context + 1)
        self.train = torch.from_numpy(train[:n * (context + 1)].astype(np.int64)).view(n, context + 1)
        m = len(valid) // (context + 1)
        windows = torch.from_numpy(valid[:m * (context + 1)].astype(np.int64)).view(m, context + 1)
        pick = np.linspace(0, m - 1, self.valid_windows).round().astype(np.int64)
        self.valid = windows[torch.from_numpy(pick)][rank::world_size]
        self.steps_per_epoch = (n // world_size) // batch_size

    def model(self):
        return ByteTransformer(self.context, self.width, 4, self.layers)

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
                "model": f"byte transformer, {self.layers} layers, width {self.width}, context {self.context}",
                "corpus": self.corpus, "valid_windows": self.valid_windows}


def decay_groups(named_parameters, weight_decay):
    """Parameter groups for AdamW with decoupled weight decay on matrices only: ``[{"params":
    tensors of 2 or more dimensions (weights, the embeddings), "weight_decay": weight_decay},
    {"params": the rest (biases, LayerNorm gains), "weight_decay": 0.0}]`` (empty groups left
    out), as GPT-style recipes do."""
    decay, rest = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else rest).append(p)
    return [g for g in ({"params": decay, "weight_decay": float(weight_decay)},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def lr_factor(step, total, warmup=0.05, final=0.1):
    """The learning-rate multiplier of optimizer step ``step`` (1-based) of a ``total``-step
    run: linear warm-up from 1/W to 1 over the first W = max(1, round(warmup x total)) steps,
    then a cosine decay from 1 to ``final`` at step ``total``, and ``final`` after it (rows
    that run past FP16's budget keep the last rate).

    Raises:
        ValueError: total < 1, warmup not in [0, 1), final not in [0, 1].
    """
    if total < 1:
        raise ValueError(f"lr_factor: total must be >= 1 steps, got {total}")
    if not 0 <= warmup < 1 or not 0 <= final <= 1:
        raise ValueError(f"lr_factor: warmup must be in [0, 1) and final in [0, 1], got {warmup}, {final}")
    w = max(1, round(warmup * total))
    if step <= w:
        return step / w
    if step >= total:
        return final
    progress = (step - w) / max(1, total - w)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets every parameter group's ``lr`` to its initial value times :func:`lr_factor` before
    each optimizer step: ``schedule.set(step)`` with the 1-based number of the step about to be
    taken (``total``: the schedule's length in steps; FP16's budget in an lm-comm sweep)."""

    def __init__(self, optimizer, total, warmup=0.05, final=0.1):
        self.opt, self.total, self.warmup, self.final = optimizer, int(total), warmup, final
        self.base = [g["lr"] for g in optimizer.param_groups]
        lr_factor(1, self.total, warmup, final)  # checks the arguments

    def set(self, step):
        f = lr_factor(step, self.total, self.warmup, self.final)
        for g, lr in zip(self.opt.param_groups, self.base):
            g["lr"] = lr * f
        return f


# lm-comm's recipes: the users' (the default) and issue 25's, kept for comparison.
RECIPES = {
    "adamw-cosine": {"betas": (0.9, 0.95), "weight_decay": 0.1, "warmup": 0.05, "final": 0.1},
    "adam-constant": None,  # Adam (0.9, 0.999), no weight decay, constant learning rate
}


class LMCommWorkload(LMWorkload):
    """``lm-comm``: the LM made communication-bound and trained until FP16 flattens (issue 25),
    under the recipe users train transformers with (issue 34).

    The same byte-level transformer and corpus as ``lm``, narrower (width 128: 470,528
    parameters, about half ``lm``'s compute per step) and trained for a fixed budget of
    steps (``max_epochs``) with no absolute target: the report sets the target of every row
    to ``target_vs_fp16`` (1.02) times FP16's final rolling perplexity in the same sweep
    (:func:`hvd_gradcomp.bench.report.apply_targets`). The sweep runs it on a slower link
    (``hvd_gradcomp.bench.tta.WORKLOAD_SWEEP_DEFAULTS``) so that FP16's step is mostly
    communication. Logs Adam's per-tensor statistics every ``adam_log_every`` steps
    (:class:`AdamProbe`).

    Recipe (``recipe``, the workers' ``--recipe``; :data:`RECIPES`): ``adamw-cosine`` (the
    default) is AdamW with betas (0.9, 0.95) and decoupled weight decay 0.1 on matrices only
    (:func:`decay_groups`), peak learning rate ``lr``, a linear warm-up over the first 5% of
    FP16's step budget and a cosine decay to 10% of the peak at its end (:class:`LRSchedule`,
    set by the trainer before every step; a row naming its own optimizer keeps the schedule);
    ``adam-constant`` is issue 25's Adam at a constant ``lr``, no decay.
    """

    name = "lm-comm"
    defaults = dict(target=None, target_vs_fp16=1.02, lr=2e-3, batch_size=16, eval_every=20,
                    max_epochs=1.75)
    width, layers = 128, 2
    adam_log_every = 100
    recipe = "adamw-cosine"

    def optimizer(self, params, lr):
        """``params``: ``named_parameters()`` pairs or bare tensors (bare tensors: matrices
        are told by their dimensions alike)."""
        r = RECIPES[self.recipe]
        if r is None:
            return torch.optim.Adam(params, lr=lr)
        named = [(None, p) if isinstance(p, torch.Tensor) else p for p in params]
        return torch.optim.AdamW(decay_groups(named, r["weight_decay"]), lr=lr, betas=r["betas"])

    def schedule(self, optimizer, total):
        """The recipe's :class:`LRSchedule` over ``total`` steps, or None (constant rate)."""
        r = RECIPES[self.recipe]
        return None if r is None else LRSchedule(optimizer, total, r["warmup"], r["final"])


def build_optimizer(workload, params, lr, text, defaults=None):
    """The optimizer of a run: ``workload.optimizer(params, lr)`` for an empty ``text``, else
    the class :data:`hvd_gradcomp.bench.worker.OPTIMIZERS` names for PyTorch, built as
    ``cls(params, lr=lr, **options)`` (the options may override ``lr``; ``defaults``:
    ``{name: options}`` used where the text gives none of them), imported only here, so that
    an optimizer not in this checkout fails this run alone.

    Raises:
        ValueError: a bad ``text`` (:func:`~hvd_gradcomp.bench.worker.parse_optimizer`), a class
            that cannot be imported (named, with the import error), or options its
            constructor rejects (its message).
    """
    name, opts = parse_optimizer(text)
    if name is None:
        return workload.optimizer(params, lr)
    cls = optimizer_class(name, "torch")
    kwargs = dict({"lr": lr}, **dict((defaults or {}).get(name, {}), **opts))
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer {name}: {OPTIMIZERS[name]['torch'].replace(':', '.')}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) "
                         f"rejected its options: {e}") from None


class AdamProbe:
    """Per-tensor statistics of an Adam-family optimizer, off the training clock (issue 25's
    mechanism check: with classic error feedback a Top-K coordinate arrives about every
    1/ratio steps carrying that many steps of gradient, so Adam's second moment should grow
    about 1/ratio and its steps shrink about sqrt(ratio)).

    Every ``every`` steps, over the last ``window`` steps before it (steps ``k*every -
    window + 1 .. k*every``), per parameter tensor: ``update_rms`` (RMS over the window's
    steps of the parameter change ``p_after - p_before`` of ``optimizer.step()``),
    ``grad_rms`` (RMS of the gradient the optimizer stepped with, i.e. after the all-reduce
    and decompression), and at the window's end ``v_mean`` (mean of ``exp_avg_sq``, Adam's
    second moment) and ``m_rms`` (RMS of ``exp_avg``). Optimizers without those states log
    None for them.

    Use: ``probe.before(step)`` just before ``optimizer.step()`` (after the gradient is
    final), ``probe.after(step)`` just after; both no-ops outside a window.
    ``probe.records()`` -> ``{"every", "window", "steps": [...], "tensors": {name: {"numel",
    "update_rms": [...], "grad_rms": [...], "v_mean": [...], "m_rms": [...]}}}``.
    """

    def __init__(self, named_parameters, optimizer, every, window=10):
        self.params = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.opt, self.every, self.window = optimizer, int(every), max(1, min(int(window), int(every)))
        self._before = None
        self._acc = None
        self.steps = []
        self.tensors = {n: {"numel": p.numel(), "update_rms": [], "grad_rms": [], "v_mean": [],
                            "m_rms": []} for n, p in self.params}

    def _in_window(self, step):
        return self.every > 0 and (-step) % self.every < self.window

    @torch.no_grad()
    def before(self, step):
        if not self._in_window(step):
            return
        self._before = [p.detach().clone() for _, p in self.params]
        g2 = torch.stack([(p.grad.double() ** 2).mean() if p.grad is not None else torch.zeros((), dtype=torch.float64)
                          for _, p in self.params])
        if self._acc is None:
            self._acc = {"u2": torch.zeros_like(g2), "g2": torch.zeros_like(g2), "n": 0}
        self._acc["g2"] += g2

    @torch.no_grad()
    def after(self, step):
        if self._before is None:
            return
        u2 = torch.stack([((p.detach().double() - b.double()) ** 2).mean() for (_, p), b in zip(self.params, self._before)])
        self._before = None
        self._acc["u2"] += u2
        self._acc["n"] += 1
        if step % self.every:
            return
        n = self._acc["n"]
        u = (self._acc["u2"] / n).sqrt().tolist()
        g = (self._acc["g2"] / n).sqrt().tolist()
        self._acc = None
        self.steps.append(step)
        for i, (name, p) in enumerate(self.params):
            st = self.opt.state.get(p, {})
            v, m = st.get("exp_avg_sq"), st.get("exp_avg")
            rec = self.tensors[name]
            rec["update_rms"].append(u[i])
            rec["grad_rms"].append(g[i])
            rec["v_mean"].append(None if v is None else v.double().mean().item())
            rec["m_rms"].append(None if m is None else (m.double() ** 2).mean().sqrt().item())

    def records(self):
        return {"every": self.every, "window": self.window, "steps": self.steps, "tensors": self.tensors}


class ShakespeareWorkload(LMCommWorkload):
    """``lm-shakespeare``: ``lm-comm``'s model and recipe on Shakespeare's texts, character
    (byte) level (:func:`hvd_gradcomp.bench.data.shakespeare_corpus`: 39 texts train, 3 plays
    validate); the same windows, validation sample, sharding and FP16-relative target as
    ``lm-comm``; a budget of 0.5 epochs (the corpus is 4.67 MB)."""

    name = "lm-shakespeare"
    defaults = dict(LMCommWorkload.defaults, max_epochs=0.5)
    load_corpus = staticmethod(data.shakespeare_corpus)


WORKLOADS = {"digits": DigitsWorkload, "lm": LMWorkload, "lm-comm": LMCommWorkload,
             "lm-shakespeare": ShakespeareWorkload}


def add_recipe_args(parser, cls):
    """``--recipe`` and ``--schedule-steps`` for a workload with a recipe (``cls.schedule``);
    nothing for the others."""
    if getattr(cls, "schedule", None) is None:
        return
    g = parser.add_argument_group("recipe")
    g.add_argument("--recipe", choices=sorted(RECIPES), default=cls.recipe,
                   help=f"training recipe (default {cls.recipe}; torch_workloads.LMCommWorkload)")
    g.add_argument("--schedule-steps", type=int, default=0,
                   help="length of the learning-rate schedule in steps (micro-batches); 0: this "
                        "run's own step budget (the harness gives the rows after FP16 FP16's)")


def make_schedule(workload, optimizer, args):
    """The workload's learning-rate schedule for ``optimizer`` (None without a recipe or under
    a constant one), over ``--schedule-steps`` steps, or this run's own budget (``--max-epochs``
    x steps per epoch, capped by ``--max-steps``)."""
    if getattr(workload, "schedule", None) is None:
        return None
    budget = math.ceil(args.max_epochs * workload.steps_per_epoch)
    total = args.schedule_steps or (min(budget, args.max_steps) if args.max_steps else budget)
    return workload.schedule(optimizer, total)


def train(workload, model, trainer, args, rank, world_size, meta, bytes_fn):
    """The shared loop: steps, evaluations on schedule, the stop rule, the JSON result.

    Args:
        workload: a workload object (batches, evaluate, metric).
        model: the (wrapped) model the trainer steps.
        trainer: ``trainer.step(x, y) -> (loss tensor, compute_s, codec_s, comm_s[, wait_s])``
            (``wait_s``: the part of ``comm_s`` blocked on the link, :meth:`.worker.Recorder.step`;
            left out: not measured) and
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
            loss, compute_s, codec_s, comm_s, *wait = trainer.step(x, y)
            rec.step(compute_s, codec_s, comm_s, loss.item(), wait[0] if wait else None)
            if rec.due() and evaluate():
                stop = True
                break
        epoch += 1
    probe = getattr(trainer, "probe", None)
    rec.write(bytes_fn(), {"finished": time.time()},
              records={"adam": probe.records()} if probe is not None and probe.every else None)
    return rec
