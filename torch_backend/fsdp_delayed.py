"""Delayed gradient sync for FSDP2's all-reduce across replicas: ``install(model, comp,
delay=1)`` (:mod:`torch_backend.fsdp`, "Delayed sync"; issue 49, item 1).

Step t's payloads are encoded and posted during step t's backward, in each FSDP parameter
group's all-reduce hook, without waiting; their decoded mean is applied at step t + 1, so the
all-reduce across replicas runs during the next forward and backward (one-step asynchronous
sync, as CO2, ICLR 2024, and PCCL's async DiLoCo). The DDP form is
:mod:`torch_backend.ddp_delayed`; the semantics are the same.

**The hook, per FSDP parameter group** (:meth:`DelayedShardHook.__call__`, called by FSDP2
with the group's flat, reduce-scattered shard ``output``, PyTorch 2.13):

1. the shard in the compressor's layout, the shards kept while the all-reduce was off added
   (the blocking hook's :meth:`~torch_backend.fsdp._ShardHook.take_input`; a call with the
   all-reduce off keeps it and hands FSDP zeros, as there: the delay counts the steps whose
   all-reduce is on);
2. decode this group's steps still in flight, oldest first (waiting for their all-reduces: on
   a link slower than a step, here), with the blocking hook's own
   :meth:`~torch_backend.fsdp._ShardHook.decode` (presence check, error feedback of what FSDP
   does not write); each parameter's shard of the mean is held, keyed by the parameter;
3. encode the shard and post its payloads (the blocking hook's
   :meth:`~torch_backend.fsdp._ShardHook.encode`: the same bits), one asynchronous all-reduce
   per payload dtype on the replicas' group;
4. write each reduced parameter's held mean into ``output`` (zeros where none is held: the
   first step applies zeros on every replica alike, so the replicas stay equal); FSDP then
   divides, casts and writes ``.grad`` from it as it would from the blocking hook's sum.

Each tensor's codec calls come in the blocking order (step t - 1 decoded before step t is
encoded), so the delayed run applies at step t exactly what the blocking run applies at step
t - 1. The shard the codec encodes is a copy where it is FSDP's buffer (a codec context may
keep a view of its input, and FSDP divides that buffer and makes it ``.grad``).

**Unused and frozen parameters** (:mod:`torch_backend.fsdp_shards`, "Parameters without a
gradient"): frozen parameters are never sent and hold nothing. A trainable parameter without
a gradient in a call is sent as zeros plus its error feedback and what comes back for it goes
into its error feedback again, as in the blocking hook; a mean held for it stays held (FSDP
writes no ``.grad`` for it in that call) and is applied, added to any later one, at the next
step that reduces it. Error feedback's balance holds: what was applied, plus the held means,
plus the replicas' mean residual, is the sum of the mean gradients.

**Loss scaling** (``comp.set_loss_scale(scaler)``): a held mean is kept in the gradient's own
units (divided by the scale its step was encoded at) and written times the scale of the step
that applies it, as :mod:`torch_backend.ddp_delayed` does.

**Checkpoints**: :meth:`DelayedSync.drain` (every rank, between steps; no collective) waits for
every step in flight and decodes it, so the compressor's state has moved past it; then save
``comp.state_dict()`` and :meth:`DelayedSync.state_dict` (this rank's held shards of the means,
keyed ``"<parameter name>[shard i/S]"``: equal on the replicas of a shard rank) with the rank's model
and optimizer shards, and load both on the same rank after ``install(..., delay=1)`` (find the
state with :func:`delayed_state`): the run resumes exactly. Draining mid-run changes nothing.

**A rank that fails**: its peers' next wait for a step it left (the next step's hook of that
group, or ``drain()``) raises the process group's error (Gloo: the connection closed). Call
``drain()`` after the last step: it raises such an error, and returns the last mean (never
applied otherwise); a process that exits with an all-reduce in flight may abort in Gloo.

Gloo: the groups' all-reduces of a step are in flight together on the replicas' group (the
blocking hook runs one at a time, ``overlap=True`` one in flight; they wait at their decode,
in the order they were posted).
"""
import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .fsdp_shards import shard_key

__all__ = ["DelayedShardHook", "DelayedSync", "check_delay", "delay_verdict", "delayed_state", "wrap"]

_STATES = weakref.WeakKeyDictionary()  # root FSDP module -> its DelayedSync


def check_delay(delay, overlap=False) -> int:
    """``delay`` as an int in {0, 1}. Raises ValueError for anything else (a bool, a float, 2)
    and for ``delay=1`` with ``overlap=True`` (delay posts without waiting already)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay not in (0, 1):
        raise ValueError(f"install: delay must be 0 (blocking) or 1 (step t's mean applied at step "
                         f"t + 1), got {delay!r}")
    if delay and overlap:
        raise ValueError("install: delay=1 and overlap=True together are not supported (delay=1 posts "
                         "each all-reduce without waiting and applies it at the next step; overlap=True "
                         "finishes them at the end of the same backward): pick one")
    return delay


def delay_verdict(delays, ranks):
    """The message refusing replicas that install different delays (``delays``: one per rank of
    the replicas' group, gathered; ``ranks``: their global ranks), or None."""
    for i, d in enumerate(delays):
        if d != delays[0]:
            return (f"install: the ranks of the replicas' group {ranks} disagree: rank {ranks[0]} installs "
                    f"delay={delays[0]}, rank {ranks[i]} delay={d}; every rank must install the same delay")
    return None


def delayed_state(model) -> "DelayedSync":
    """The :class:`DelayedSync` of ``model`` (the root module given to ``install(...,
    delay=1)``), for :meth:`~DelayedSync.drain` and checkpoints. Raises ValueError when it
    has none."""
    found = _STATES.get(model)
    if found is None:
        raise ValueError("delayed_state: this model has no FSDP all-reduce hook installed with delay=1")
    return found


class _Posted(NamedTuple):
    """One group's step in flight: its call layout, the blocking hook's ``(entries, posted)``,
    the shard's (dtype, device), and the loss scale it was encoded at (a 0-d copy, or None)."""

    lay: object
    entries: list
    posted: tuple
    like: tuple
    scale: object


class DelayedShardHook:
    """The all-reduce hook of one FSDP parameter group with ``delay=1`` (module docstring):
    composes the group's blocking hook (``steps``, a :class:`~torch_backend.fsdp._ShardHook`:
    ``take_input``, ``encode``, ``decode``) and keeps this group's steps in flight and held
    means.

    Attributes:
        steps: the blocking hook, whose steps this one runs.
        compressor, codec: the user's compressor and its codec (as the blocking hook's).
        inflight: [_Posted] of this group not decoded yet, oldest first.
        held: {index into the group's ``fsdp_params``: its shard of the mean to apply next, flat
            (padded shard), in the reduce dtype and the gradient's own units (no loss scale)}.
    """

    def __init__(self, steps):
        self.steps = steps
        self.compressor, self.codec = steps.compressor, steps.codec
        self.inflight, self.held = [], {}

    def __call__(self, output: torch.Tensor) -> None:
        steps = self.steps
        with torch.no_grad():
            lay, x = steps.take_input(output)
            if x is None:  # set_requires_all_reduce(False): kept, FSDP got zeros
                return
            self.settle()  # before encoding: the codec sees each tensor's calls in the blocking order
            if x is output:  # (a codec context may keep a view of its input; FSDP reuses output)
                x = x.clone()
            group = steps.group
            entries, posted = steps.encode(lay, x, lambda flat: dist.all_reduce(flat, group=group, async_op=True))
            codec, scale, now = self.codec, None, None
            if codec.scale_source is not None:  # this step's loss scale, kept for its decode
                now = codec.frontend.scale_of(codec.scale_source)
                scale = now.detach().clone()
                entries = [(u, p, c if c is None or c.scale is None else c._replace(scale=scale))
                           for u, p, c in entries]
            self.inflight.append(_Posted(lay, entries, posted, (x.dtype, x.device), scale))
            for i, (src, _, n) in zip(lay.present, lay.moves):
                mean = self.held.pop(i, None)
                if mean is None:
                    output[src:src + n].zero_()
                else:
                    output[src:src + n].copy_(mean)
                    if now is not None:  # at this step's loss scale, which the scaler divides out
                        output[src:src + n].mul_(now)

    def settle(self):
        """Decode this group's steps in flight, oldest first, into :attr:`held` (waiting for
        their all-reduces). Raises the process group's error where a peer failed, and the
        blocking hook's ValueError for a parameter reduced on some replicas only."""
        while self.inflight:
            p = self.inflight.pop(0)
            lay = p.lay
            summed = torch.zeros(lay.full, dtype=p.like[0], device=p.like[1])
            try:
                self.steps.decode(lay, summed, p.entries, p.posted)
            finally:
                p.posted[0].buffers.clear()
            if p.scale is not None:  # held in the gradient's own units
                summed.div_(p.scale)
            for i, (_, dst, n) in zip(lay.present, lay.moves):
                mean = summed[dst:dst + n]
                kept = self.held.get(i)
                self.held[i] = mean if kept is None else kept + mean

    def keys(self):
        """{index into ``fsdp_params``: ``"<parameter name>[shard i/S]"``, its shard's key here}."""
        shard = self.steps.layouts.shard
        return {i: shard_key(n, shard.rank, shard.size) for i, n in enumerate(shard.names)}


class DelayedSync:
    """The delayed hooks of one ``install(..., delay=1)`` (:func:`delayed_state` finds it):
    drain and checkpoints (module docstring)."""

    def __init__(self, hooks):
        self.hooks = list(hooks)
        self.delay = 1

    def drain(self) -> dict:
        """Wait for every step in flight and decode it (every rank, between steps; no
        collective is posted). Returns {key: this rank's shard of the mean the next step
        applies (flat, padded; the gradient's own units)}, keyed by parameter shard,
        ``"<parameter name>[shard i/S]"`` (also with ``per="group"``: the means follow each
        parameter).
        Raises the process group's error where a peer failed."""
        out = {}
        for hook in self.hooks:
            hook.settle()
            keys = hook.keys()
            out.update({keys[i]: mean for i, mean in hook.held.items()})
        return out

    def state_dict(self) -> dict:
        """``{"delay": 1, "means": {key: mean}}`` after :meth:`drain` (called here): this rank's
        held shards. Save it per rank with ``comp.state_dict()`` taken after the drain."""
        return {"delay": self.delay, "means": {k: v.detach().clone() for k, v in self.drain().items()}}

    def load_state_dict(self, sd: dict):
        """Hold ``sd``'s means (of :meth:`state_dict`, saved on this rank's shard) for the next
        step, in place of any held now (a step in flight is drained first). Call it after
        ``install(..., delay=1)``, before the first step. Raises ValueError for another delay,
        or a key or size this rank's shards do not have (another mesh, another shard rank's
        file)."""
        if not isinstance(sd, dict) or sd.get("delay") != self.delay:
            raise ValueError(f"DelayedSync.load_state_dict: saved with delay="
                             f"{sd.get('delay') if isinstance(sd, dict) else None!r}, this install has "
                             f"delay={self.delay}")
        where = {}
        for hook in self.hooks:
            sizes = [math.prod(fp.padded_sharded_param_size) for fp in hook.steps.fsdp_group.fsdp_params]
            for i, key in hook.keys().items():
                where[key] = (hook, i, sizes[i])
        held = {}
        for key, mean in sd["means"].items():
            found = where.get(key)
            if found is None or mean.numel() != found[2]:
                raise ValueError(f"DelayedSync.load_state_dict: {key!r} ({mean.numel()} values) is not a "
                                 f"shard of this rank's layout of that size (saved on another mesh or "
                                 f"shard rank?); load each rank's own file on the same mesh")
            held[key] = found, mean
        self.drain()  # (no work left in flight unwaited)
        for hook in self.hooks:
            hook.held = {}
        for (hook, i, _), mean in held.values():
            hook.held[i] = mean.detach().reshape(-1).to(device=hook.steps.fsdp_group.device)


def wrap(model, hooks) -> DelayedSync:
    """Register ``hooks`` (one :class:`DelayedShardHook` per FSDP parameter group) as
    ``model``'s :class:`DelayedSync`."""
    sync = _STATES[model] = DelayedSync(hooks)
    return sync
