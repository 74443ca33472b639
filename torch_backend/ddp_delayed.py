"""Delayed gradient sync for the DDP hook: ``register_comm_hook(ddp_model, comp, delay=1)``.

Step t's payloads are posted during step t's backward, without waiting, and their decoded
mean is applied at step t + 1: the all-reduce runs during the next forward and backward
(issue 49, item 1; one-step asynchronous sync as in CO2, ICLR 2024, and PCCL's async DiLoCo).

**The step, per bucket** (:meth:`DelayedHook.step`, called by DDP's reducer in bucket order):

1. decode the previous step's posted buckets that hold one of this bucket's parameters, in the
   order they were posted (waiting for their all-reduces: on a link slower than a step, here);
   each parameter's mean is held, keyed by the parameter (not a bucket position: DDP's bucket
   rebuild after the first step changes the layout, the means follow their parameters);
2. plan and encode this bucket (the blocking hook's own steps, :class:`BucketSteps`, so both
   paths compute the same bits) and post its payloads, one all-reduce per payload dtype;
3. write the held means of this bucket's parameters into the bucket (zeros where none is held:
   the first step applies zeros on every rank alike, so replicas stay equal) and return a
   completed future of it.

The codec sees every tensor's calls in the blocking hook's order (step t - 1 decoded before step
t is encoded), so the delayed run applies at step t exactly what the blocking run applies at
step t - 1, and error feedback's balance holds as there: what was applied, plus the held mean
of the last step, plus the ranks' mean residual, is the sum of the mean gradients.

A tensor a payload or a codec context shares with DDP's bucket buffer (a cast of a bucket in
its own dtype is the bucket itself) is copied before the hook returns: DDP writes the next
step's gradients into that buffer while the all-reduce may still be in flight.

**Gradient accumulation** (``no_sync``): DDP calls no hook under ``no_sync``, so nothing moves;
the synchronised step posts the accumulated gradient and the next synchronised step applies
its mean (the delay counts synchronised steps).

**Loss scaling** (``comp.set_loss_scale(scaler)``): a held mean is kept in the gradient's
own units (the decoded mean divided by the loss scale its step was encoded at, a device copy
taken then) and delivered times the scale of the step that applies it, which the scaler then
divides out: a scale changed by ``scaler.update()`` in between does not scale an applied mean
by S_old / S_new. An overflow at step t reaches ``.grad`` at step t + 1, whose optimizer step
the scaler skips (the step that would apply it).

**Checkpoints** (:meth:`DelayedHook.drain`, :meth:`DelayedHook.state_dict`): ``drain()`` waits
for the step in flight and decodes it (no collective: its all-reduces were posted), so the
compressor's state has moved past it; then ``comp.state_dict(...)`` and the hook's
``state_dict()`` (the held means by parameter name, equal on every rank) together resume
exactly: load both into a new model before its first step (:func:`delayed_state` finds the
hook of a DDP model). Draining mid-run changes nothing in the numbers.

**Unused parameters** (``find_unused_parameters=True``, ``static_graph=True``): DDP keeps a
parameter that no rank used in a step untouched, dropping what the hook delivered for it (the
previous step's mean). The hook counts each parameter's users in the same all-reduce as the
blocking hook (:func:`torch_backend.ddp._counts`), and when it decodes a step it holds again
what that step delivered and DDP dropped, added to the step's own mean: each mean is applied
at the next step that uses its parameter, and the balance above holds. (The blocking hook keeps
what DDP drops in error feedback instead, so with unused parameters the delayed run is not the
blocking run shifted by a step.)

**Join** (uneven inputs): a joined rank's shadow all-reduces run this hook on zero buckets; it
posts zero payloads (the counts as they are), and decodes that step's sum into the same held
means as its peers (as a rank that sent zeros, :meth:`~hvd_gradcomp.codec.Codec.as_sent_zeros`:
a scheme that takes its own words off the sum, ``subtract_own``, takes zeros off) while its own error feedback stays as it was
(:meth:`~hvd_gradcomp.codec.Codec.decode_joined`), so after ``Join`` (which broadcasts the
model) and :meth:`DelayedHook.drain` every rank holds the same means.
``divide_by_initial_world_size=False`` is refused as by the blocking hook.

**Refused** at registration (ValueError, before anything is bound): ``delay`` other than 0 or
1, compiled DDP (its Python reducer writes each ``.grad`` itself at the end of backward) and
sparse gradients (an ``Embedding(sparse=True)``: its bucket is all-reduced uncompressed and
blocking). Horovod's ``DistributedOptimizer`` has no delayed form.

**A rank that fails**: its peers' next wait for the step it left (the next step's hook, or
``drain()``) raises the process group's error (Gloo: the connection closed); call ``drain()``
after the last step so that a failure there is seen too (it also returns the last mean,
otherwise never applied).
"""
import weakref
from typing import Callable, NamedTuple

import torch

from hvd_gradcomp.payloads import post_payloads, unpack_payloads

from .ops import OPS

__all__ = ["BucketSteps", "DelayedHook", "hook", "delayed_state", "check_delay", "check_model"]

_HOOKS = weakref.WeakKeyDictionary()  # DDP model -> its DelayedHook


class BucketSteps(NamedTuple):
    """The blocking hook's steps (:mod:`torch_backend.ddp`'s), passed in so the delayed path
    computes the same bits without importing that module.

    plan(state, bucket, buffer, params) -> BucketPlan or None (a sparse bucket);
    encode(codec, plan, buffer, n) -> [(payload, ctx)] per unit;
    decode(state, plan, encoded, reduced, counts, buffer): the mean written into ``buffer``;
    counts(state, plan, params, joined, device) -> int32 [params, 2] (users, bucket views);
    joined() -> bool: called by :func:`hook`, True on a rank DDP's ``Join`` shadows.
    """

    plan: Callable
    encode: Callable
    decode: Callable
    counts: Callable
    joined: Callable


class _Posted(NamedTuple):
    """One bucket's step in flight: its parameters, plan, codec contexts, packed payloads
    (the counts last, where ``counts``), futures, the buffer's (numel, dtype, device) to
    decode into, whether this rank sent zeros (joined), and the loss scale it was encoded at
    (a 0-d float32 copy, or None)."""

    params: list
    plan: object
    encoded: list
    packed: object
    futures: list
    like: tuple
    counts: bool
    joined: bool
    scale: object


def check_delay(delay) -> int:
    """``delay`` as an int in {0, 1}; ValueError otherwise (a bool or a non-integer too)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay not in (0, 1):
        raise ValueError(f"register_comm_hook: delay must be 0 (blocking) or 1 (step t's mean applied "
                         f"at step t + 1), got {delay!r}")
    return delay


def check_model(ddp_model, spec) -> None:
    """ValueError where delayed sync cannot serve ``ddp_model``: compiled DDP (the Python
    reducer writes each ``.grad`` itself at the end of backward, from what the hook returns
    there; :mod:`torch_backend.ddp_compiled`) and sparse gradients (an ``Embedding`` or
    ``EmbeddingBag`` with ``sparse=True``)."""
    if getattr(ddp_model, "_use_python_reducer", False):
        raise ValueError(f"register_comm_hook {spec!r}, delay=1: compiled DDP (optimize_ddp='python_reducer') "
                         f"is not supported (its reducer writes each .grad itself at the end of backward); "
                         f"use delay=0 there")
    sparse = [name for name, m in ddp_model.module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(f"register_comm_hook {spec!r}, delay=1: sparse gradients (module {sparse[0]!r}, "
                         f"sparse=True) are not supported (their bucket is all-reduced uncompressed, "
                         f"blocking); use delay=0 or sparse=False")


def delayed_state(ddp_model) -> "DelayedHook":
    """The :class:`DelayedHook` registered on ``ddp_model`` (for :meth:`~DelayedHook.drain`
    and checkpoints). Raises ValueError when it has none."""
    found = _HOOKS.get(ddp_model)
    if found is None:
        raise ValueError("delayed_state: this DDP model has no hook registered with delay=1")
    return found


def _shares(t, storage_ptr) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and \
        t.untyped_storage().data_ptr() == storage_ptr


def _own(obj, storage_ptr):
    """``obj`` (a codec context: tensors in tuples and named tuples) with every tensor sharing
    the buffer's storage replaced by a copy; ``obj`` itself when none does."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if _shares(obj, storage_ptr) else obj
    if isinstance(obj, (tuple, list)):
        items = [_own(o, storage_ptr) for o in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class DelayedHook:
    """The state of :func:`hook`: a bound :class:`~torch_backend.ddp.HookState`, the steps
    in flight and the means held for the next step (module docstring).

    Attributes:
        state: the :class:`~torch_backend.ddp.HookState` (compressor, names, group, world size).
        delay: 1.
        held: {parameter: its mean, in the bucket's dtype and the gradient's own units (no
            loss scale)} to apply at its next bucket.
        previous: [_Posted] of the previous step not decoded yet, in posted order.
        current: [_Posted] of this step (moved to ``previous`` after DDP's last bucket).
        delivered: {parameter: the held mean this step delivered}, kept where DDP may drop it
            (unused parameters) until this step's decode says whether it did.
    """

    def __init__(self, state, delay: int, steps: BucketSteps):
        self.state, self.delay, self.steps = state, delay, steps
        self.held, self.previous, self.current = {}, [], []
        self.delivered = {}

    def register(self, ddp_model):
        """Remember this hook as ``ddp_model``'s (:func:`delayed_state`)."""
        _HOOKS[ddp_model] = self
        return self

    def _decode(self, posted: _Posted):
        """Wait for ``posted``'s all-reduces and hold each of its parameters' mean."""
        state = self.state
        codec = state.codec
        try:
            reduced = unpack_payloads(OPS, posted.packed, [codec.engine.wait(f) for f in posted.futures],
                                      view=torch.Tensor.view)
        finally:
            posted.packed.buffers.clear()
        numel, dtype, device = posted.like
        out = torch.empty(numel, dtype=dtype, device=device)
        units = len(posted.encoded)
        with torch.no_grad():
            if posted.joined:  # the mean every rank decodes; this rank's own state kept (decode_joined)
                keys = {ctx.info.key for _, ctx in posted.encoded if ctx is not None}
                saved = {k: codec.store.read(k) for k in keys if codec.store.has(k)}
            encoded = [(p, codec.as_sent_zeros(c)) for p, c in posted.encoded] if posted.joined else posted.encoded
            self.steps.decode(state, posted.plan, encoded, reduced[:units], None, out)
            if posted.scale is not None:  # held in the gradient's own units
                out.div_(posted.scale)
            if posted.joined:
                for k, v in saved.items():
                    codec.store.write(k, v)
                for (_, ctx), payload in zip(posted.encoded, reduced):
                    codec.decode_joined(payload, ctx)
            dropped = None
            if posted.counts:  # no rank used it, and DDP did not write its .grad: what this
                counts = reduced[units]  # step delivered for it is held again, for the next
                state.last_used[id(posted.plan)] = (counts[:, 0] > 0).to(torch.int32)
                dropped = ((counts[:, 0] == 0) & (counts[:, 1] == 0)).to(dtype)
            for i, (p, m) in enumerate(zip(posted.params, posted.plan.members)):
                mean = out[m.offset:m.offset + m.numel].view(m.shape)
                lost = self.delivered.pop(p, None) if dropped is not None else None
                if lost is not None:
                    mean.add_(lost * dropped[i])
                self.held[p] = mean

    def _decode_for(self, params):
        """Decode the previous step's buckets, in posted order, up to the last one holding one of
        ``params`` (all of them when ``params`` is None)."""
        if params is None:
            last = len(self.previous) - 1
        else:
            ids = set(map(id, params))
            last = max((i for i, e in enumerate(self.previous) if any(id(p) in ids for p in e.params)),
                       default=-1)
        done, self.previous = self.previous[:last + 1], self.previous[last + 1:]
        for posted in done:
            self._decode(posted)

    def step(self, bucket, joined: bool = False):
        """One bucket of DDP's backward: decode what it needs of the previous step, post this
        step's payloads (zeros on a ``joined`` rank), return a completed future of the bucket
        holding the previous step's mean (module docstring)."""
        state = self.state
        codec = state.codec
        if not getattr(state.ddp_model, "_divide_by_initial_world_size", True):
            raise ValueError(f"hvd_gradcomp DDP hook {codec.spec!r}: Join(..., divide_by_initial_world_size="
                             f"False) is not supported (the hook divides by the process group's size); use "
                             f"the default True")
        buffer, params = bucket.buffer(), bucket.parameters()
        if buffer.is_sparse:  # (an Embedding's refused at registration: check_model)
            raise ValueError(f"hvd_gradcomp DDP hook {codec.spec!r}, delay=1: sparse gradients (bucket "
                             f"{bucket.index()}) are not supported; use delay=0")
        self._decode_for(params)  # before planning: a rebuilt bucket's group takes the decoded state
        plan = self.steps.plan(state, bucket, buffer, params)
        encoded = self.steps.encode(codec, plan, buffer, state.world_size)
        ptr = buffer.untyped_storage().data_ptr()
        encoded = [(p, _own(ctx, ptr)) for p, ctx in encoded]
        scale = now = None
        if codec.scale_source is not None:  # this step's loss scale, kept for its decode
            now = codec.frontend.scale_of(codec.scale_source)
            scale = now.detach().clone()
            encoded = [(p, c if c is None or c.scale is None else c._replace(scale=scale)) for p, c in encoded]
        payloads = [torch.zeros_like(p) if joined else p for p, _ in encoded]
        if state.tracks_unused:
            payloads.append(self.steps.counts(state, plan, params, joined, buffer.device))
        copy = any(_shares(p, ptr) for p in payloads)
        packed, futures = post_payloads(OPS, payloads, codec.engine.post, copy=copy)
        self.current.append(_Posted(list(params), plan, encoded, packed, futures,
                                    (buffer.numel(), buffer.dtype, buffer.device), state.tracks_unused, joined, scale))
        with torch.no_grad():
            for p, g in zip(params, bucket.gradients()):
                mean = self.held.pop(p, None)
                if mean is None:
                    g.zero_()
                else:
                    g.copy_(mean)
                    if now is not None:  # at this step's loss scale, which the scaler divides out
                        g.mul_(now)
                    if state.tracks_unused:  # held again if DDP drops it (known at the next decode)
                        self.delivered[p] = mean
        if bucket.is_last():
            self._decode_for(None)  # (nothing left where every parameter is in a bucket)
            self.previous, self.current = self.current, []
        done = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        done.set_result(buffer)
        return done

    def drain(self) -> dict:
        """Wait for the step in flight and decode it (call it on every rank between steps: no
        collective is posted). Returns {parameter name: the mean the next step applies, in the
        gradient's own units (no loss scale)}.
        Raises the process group's error where a peer failed; RuntimeError inside a backward."""
        if self.current:
            raise RuntimeError("DelayedHook.drain: called inside a backward; call it between steps")
        self._decode_for(None)
        self.delivered.clear()
        names = self.state.names
        return {names[p]: mean for p, mean in self.held.items()}

    def state_dict(self) -> dict:
        """``{"delay": 1, "means": {name: mean}}`` after :meth:`drain` (called here too): the
        held means, equal on every rank. Save it with ``comp.state_dict(...)`` taken after the
        drain."""
        return {"delay": self.delay, "means": {k: v.detach().clone() for k, v in self.drain().items()}}

    def load_state_dict(self, sd: dict):
        """Hold ``sd``'s means (of :meth:`state_dict`) for the next step, on each parameter's
        device and in its gradient's dtype. Call it before the first step, with the
        compressor's ``load_state_dict``. Raises ValueError for another delay or an unknown
        name or shape."""
        if sd.get("delay") != self.delay:
            raise ValueError(f"DelayedHook.load_state_dict: saved with delay={sd.get('delay')!r}, "
                             f"this hook has delay={self.delay}")
        by_name = {n: p for p, n in self.state.names.items()}
        held = {}
        for name, mean in sd["means"].items():
            p = by_name.get(name)
            if p is None or tuple(mean.shape) != tuple(p.shape):
                raise ValueError(f"DelayedHook.load_state_dict: {name!r} (shape {list(mean.shape)}) is "
                                 f"not a parameter of this model of that shape")
            held[p] = mean.detach().to(device=p.device, dtype=p.dtype)
        self.previous, self.current, self.held, self.delivered = [], [], held, {}


def hook(state: DelayedHook, bucket):
    """DDP communication hook with delayed sync: ``state.step(bucket)`` (module docstring).
    Raises TypeError when ``state`` is not a :class:`DelayedHook`; ValueError as
    :meth:`DelayedHook.step`."""
    if not isinstance(state, DelayedHook):
        raise TypeError(f"hvd_gradcomp delayed DDP hook: the state must be a DelayedHook, got "
                        f"{type(state).__name__}; use register_comm_hook(ddp_model, compressor, delay=1)")
    return state.step(bucket, state.steps.joined())
