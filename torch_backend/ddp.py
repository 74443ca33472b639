"""hvd-gradcomp's compressors as PyTorch DDP communication hooks.

Usage::

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    ddp_model = DDP(model)
    comp = Compression.topkc(0.1)            # any spec, rules and auto included
    register_comm_hook(ddp_model, comp)      # calls ddp_model.register_comm_hook(state, hook)

Trainers that wrap the model themselves (PyTorch Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``) take the state made from the module before wrapping:
``state = comm_state(model, comp)`` and :func:`hook` (the compressor is bound to the DDP
model's process group at the first backward, on every rank alike).

The compressor object is the one Horovod users pass as ``compression=``; everything it offers
(``state_dict``/``load_state_dict``, ``bytes_per_step``, ``metrics``, ``routes``,
``set_loss_scale``, :class:`~torch_backend.stats.CompressionStats`) behaves as with Horovod,
with the DDP model's process group in place of Horovod's global set (ranks, world size,
``state_dict(gather=True)``'s object gather, ``calibrate()`` for ``auto``).

**Identity.** Each gradient of a bucket (``bucket.gradients()``) is keyed by its parameter's
name in the wrapped module (``ddp_model.module.named_parameters()``, the names Horovod users
pass as ``named_parameters``), equal on every rank and stable across DDP's bucket rebuild, so
routing rules match those names and each parameter keeps its own state.

**One codec call per bucket and route** (:mod:`hvd_gradcomp.buckets`). The bucket's tensors
that share a route whose scheme's math is over a vector (the casts, TopK, TopKC, THC, signSGD)
are compressed as one flat vector, read from DDP's flat bucket buffer as a view where they are
contiguous in it; PowerSGD's matrices and ``auto``'s tensors are compressed one by one. Error
feedback is one flat buffer per group; checkpoints, routes and reports stay per parameter.
``per_tensor=True`` compresses every gradient alone (the reference the bucketed path is tested
against; bit for bit equal for ``none``/``fp16``/``bf16``). The payloads are concatenated, one
tensor per payload dtype (sorted by name: e.g. THC's int32 words and the float16 of its small
tensors travel in two), each summed by one ``dist.all_reduce(..., async_op=True)`` on the DDP
process group; the future's ``then`` decodes each unit (its state moves on), divides by the
process group's size in float32 (DDP expects the average; a float16 model's mean is never
formed from an overflowing float16 sum) and writes the result into the bucket. The schemes
are told ``op=Sum``: decoding the sum and dividing it is exact for every scheme (an Average
would need Horovod's scaling of integer words). The tensors made at compress time stay
referenced by the future's callback until it has run, so the all-reduce on the process
group's stream never reads freed memory (ProcessGroupNCCL also records its streams on them).

**Unused parameters** (``find_unused_parameters=True`` or ``static_graph=True``): DDP keeps a
parameter that no rank used in a step untouched, dropping what the hook delivered for it
(unless its ``.grad`` is a bucket view already, which DDP does write). The hook counts each
parameter's users in the same all-reduce (an int32 count per parameter, from gradient hooks
on every parameter; a rank joined under ``Join`` counts the previous step's all-reduced
users, as DDP's Join shadow does for its used map) and keeps what DDP drops in the
parameter's error feedback, so error feedback's balance (delivered + owed = the sum of the mean gradients) holds in every DDP
configuration. These counts (8 bytes a parameter, in the bucket's int32 all-reduce) are the
hook's own and not in ``bytes_per_step()``, which counts the compressors' payloads.

**Sparse gradients** (``nn.Embedding(sparse=True)``): DDP gives them a bucket of their own;
it is all-reduced uncompressed and averaged, as PyTorch's default hook does.

**Joined ranks** (``torch.distributed.algorithms.Join`` with uneven inputs): a rank that has
joined shadows each bucket's all-reduce with a zero gradient. Here it compresses that zero
gradient only to learn the payloads' shapes, sends zero payloads (contributing nothing, as a
rank in ``hvd.join()`` does: THC's and auto's count lanes see it) and keeps its rank-local
state (:attr:`~hvd_gradcomp.base.Scheme.rank_local_fields`: its error feedback) as it was,
while the fields the ranks agree on move on from the same all-reduced payload as everywhere
else (:meth:`~hvd_gradcomp.codec.Codec.decode_joined`). The result is divided by
the process group's size, as ``Join(..., divide_by_initial_world_size=True)`` (the default)
does; ``False`` is refused.

**Delayed sync** (``register_comm_hook(..., delay=1)``): step t's payloads posted during its
backward, their mean applied at step t + 1 (:mod:`torch_backend.ddp_delayed`).

Refused with a ValueError, before any collective and on every rank: a compressor already
bound to a DDP model, a parameter DDP hands over that the model does not name, the papers'
blocking two-round variants (their side all-reduce is Horovod's), and everything the Horovod
adapter refuses (a shape change under one key, a checkpoint routed differently, ...). A
compressor passed as the state itself (``ddp_model.register_comm_hook(comp, hook)``) is
refused with a TypeError that names :func:`comm_state`.
"""
import logging
import sys

import torch
import torch.distributed as dist

from hvd_gradcomp.buckets import Member
from hvd_gradcomp.payloads import post_payloads, unpack_payloads

from . import ddp_compiled, ddp_delayed
from .compression import check_compressor
from .kernels import runs
from .ops import OPS
from .engine import ProcessGroupEngine

__all__ = ["register_comm_hook", "make_comm_hook", "comm_state", "hook", "HookState", "DDPEngine", "fingerprint",
           "check_agreement"]

log = logging.getLogger("hvd_gradcomp")


DDPEngine = ProcessGroupEngine  # the name it had before torch_backend.engine


class HookState:
    """What :func:`hook` needs: the compressor, the parameters' names, the process group.

    Attributes:
        compressor: the bound compressor; codec: its codec (what the hook calls).
        names: {parameter tensor: name} (parameters hash by identity).
        group: the process group (None: the default one, or the DDP model's once bound).
        world_size: its size (None until bound).
        ddp_model: the DDP model, or None for a state made from the module (:func:`comm_state`).
        per_tensor: compress every gradient alone instead of one call per bucket and route.
        used: ids of the parameters that got a gradient since their bucket was last sent
            (kept only where DDP drops unused parameters' results: :attr:`tracks_unused`).
    """

    def __init__(self, compressor, names: dict, group, world_size, ddp_model, per_tensor=False):
        self.compressor = compressor
        self.codec = compressor.codec
        self.names = names
        self.group = group
        self.world_size = world_size
        self.ddp_model = ddp_model
        self.per_tensor = per_tensor
        self.used = set()
        self.last_used = {}  # id(plan) -> int32 [params]: 1 where some rank used it last step
        self.tracks_unused = False
        self.slots = {}  # id(plan) -> (plan, its units' slots): where DDP may drop results
        self._hooks = []
        self.ready = None  # ddp_compiled.ReadyBuckets, under the Python reducer
        self.delay = 0  # register_comm_hook's delay (ddp_delayed); part of the ranks' agreement

    def bind(self, ddp_model=None, compiled=False):
        """Bind the compressor to the process group (at registration, or at the first backward
        for a state made by :func:`comm_state`) and, where DDP drops unused parameters'
        results, start counting each parameter's users (``compiled``, or a model under the
        Python reducer: every parameter of a bucket arrived, nothing to count)."""
        codec = self.codec
        if ddp_model is not None:
            self.ddp_model = ddp_model
            self.group = ddp_model.process_group
        engine = ProcessGroupEngine(self.group)
        check_agreement(self, engine)  # before binding: nothing changed where it raises
        codec.bind_engine(engine)
        self.world_size, _ = engine.world()
        model = self.ddp_model
        compiled = compiled or bool(getattr(model, "_use_python_reducer", False))
        self.tracks_unused = not compiled and (model is None or bool(getattr(
            model, "find_unused_parameters", False)) or bool(getattr(model, "static_graph", False)))
        if self.tracks_unused and not self._hooks:
            used = self.used
            for p in self.names:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda param, used=used: used.add(id(param))))
        if any(s.adaptive and s.link is None for s in codec.routing.schemes()):
            like = next(iter(self.names), None)
            self.compressor.calibrate(like=None if like is None else like.detach())
        return self


def fingerprint(state: HookState) -> tuple:
    """What every rank of a DDP model must agree on (issue 47) beyond what DDP checks itself
    (the parameters' count, shapes and ``requires_grad``, at construction): the compressor's
    canonical spec (schemes, options, rules) and ``per_tensor``, which decide each bucket's
    plan and so the layout of the payloads the ranks sum, and ``delay`` (which step's payloads
    the ranks sum together)."""
    return state.compressor.spec, state.per_tensor, state.delay


def check_agreement(state: HookState, engine) -> None:
    """Gather :func:`fingerprint` over the process group (one ``all_gather_object``, every rank
    at the same point: registration, or the first backward of a :func:`comm_state`) and raise
    the same ValueError on every rank at the first difference, naming both ranks' values:
    different payload layouts would otherwise meet inside Gloo (one rank aborted, its peer reset
    mid-backward) or, with equal sizes, be summed silently."""
    seen = engine.gather(fingerprint(state))
    spec, per, delay = seen[0]
    where = "register_comm_hook: the ranks of the DDP process group disagree: rank 0"
    for rank, (spec_r, per_r, delay_r) in enumerate(seen):
        if spec_r != spec:
            raise ValueError(f"{where} registers compressor {spec!r}, rank {rank} {spec_r!r}; every rank must "
                             f"register the same spec (the ranks sum each other's payloads, whose layout the "
                             f"spec decides)")
        if per_r != per:
            raise ValueError(f"{where} registers per_tensor={per}, rank {rank} per_tensor={per_r}; every rank "
                             f"must register the same per_tensor")
        if delay_r != delay:
            raise ValueError(f"{where} registers delay={delay}, rank {rank} delay={delay_r}; every rank "
                             f"must register the same delay")


def comm_state(module, compressor, process_group=None, per_tensor=False) -> HookState:
    """The state of :func:`hook` for a module not yet wrapped in DDP (trainers that wrap it
    themselves: Lightning's ``DDPStrategy(ddp_comm_state=comm_state(model, comp),
    ddp_comm_hook=hook)``). Names are the module's ``named_parameters()``; the compressor is
    bound to ``process_group`` (default: the default group) at the first backward, on every
    rank alike. Raises TypeError / ValueError as :func:`register_comm_hook`."""
    _check_compressor(compressor)
    names = {p: name for name, p in module.named_parameters()}
    return HookState(compressor, names, process_group, None, None, per_tensor)


def _check_compressor(compressor):
    check_compressor(compressor, "register_comm_hook", "DDP")


def _joined() -> bool:
    """True when the hook runs on a rank that has joined (DDP's Join hook shadows the
    backward all-reduces from ``_match_all_reduce_for_bwd_pass``)."""
    frame = sys._getframe(1).f_back  # None where C++ called our caller (no Python frame above)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_match_all_reduce_for_bwd_pass":
            return True
        frame = frame.f_back
    return False


def _plan(state: HookState, bucket, buffer, params):
    """The bucket's :class:`~hvd_gradcomp.buckets.BucketPlan` from the compressor's plan cache,
    keyed by the layout (DDP's rebuilt buckets after the first step are new layouts); None for
    a sparse gradient's bucket. The step's path reads no gradient view on a known layout."""
    # every parameter's identity, in order: DDP's rebuilt bucket may keep the first layout's
    # index, first and last parameter and size while ordering the others otherwise
    layout = (bucket.index(), tuple(map(id, params)), buffer.numel())

    def members():
        out, offset, base = [], 0, buffer.storage_offset()
        for p, g in zip(params, bucket.gradients()):  # (none: a sparse gradient's bucket)
            name = state.names.get(p)
            if name is None:
                raise ValueError(f"hvd_gradcomp DDP hook {state.compressor.spec!r}: bucket "
                                 f"{bucket.index()} holds a parameter of shape {list(p.shape)} that "
                                 f"the DDP model's named_parameters() does not name; register the "
                                 f"hook on the DDP model that owns it")
            if g.is_contiguous() and g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                offset = g.storage_offset() - base  # where DDP put it (consecutive, in bucket order)
            out.append(Member(name, name, tuple(g.shape), offset, g.numel()))
            offset += g.numel()
        return out
    plan = state.codec.plan_bucket(members, str(buffer.dtype).removeprefix("torch."), "sum",
                                   state.group, buffer, per_tensor=state.per_tensor, layout=layout)
    return plan if plan.members else None


def _slots(state: HookState, plan, device):
    """Per unit, where DDP may drop a parameter's result: its parameters' indices in the
    bucket and sizes (device tensors made once per plan, read by :func:`_dropped_part`)."""
    hit = state.slots.get(id(plan))
    if hit is None or hit[0] is not plan:
        hit = state.slots[id(plan)] = (plan, [(
            torch.tensor(u.members, device=device),
            torch.tensor([plan.members[i].numel for i in u.members], device=device)) for u in plan.units])
    return hit[1]


def _dropped_part(out, dropped, slot):
    """``out`` (a unit's decoded mean) where DDP drops it (``dropped``: bool per parameter of
    the bucket), zero elsewhere, flat float32; ``slot``: the unit's (indices, sizes)."""
    flat = out.reshape(-1).float()
    index, sizes = slot
    if index.numel() == 1:
        return flat * dropped[index].float()
    return flat * torch.repeat_interleave(dropped[index].float(), sizes, output_size=flat.numel())


def _flat(x):
    """``x`` as 1-D (itself when it already is: no operation recorded)."""
    return x if x.dim() == 1 else x.reshape(-1)


def _encode(codec, plan, buffer, n):
    """``[(payload, ctx)]`` per unit of ``plan``, read from the bucket's ``buffer``."""
    encoded = []
    for unit in plan.units:
        x = buffer[unit.start:unit.stop] if unit.contiguous else runs.gather(buffer, unit)
        if len(unit.members) == 1 and x.shape != unit.info.shape:
            x = x.view(unit.info.shape)
        payload, ctx = codec.encode_unit(unit, x)
        if ctx is None:  # sent as it is (none): divided first, as DDP's own all-reduce does, so
            payload = payload / n  # a float16 bucket's sum cannot overflow where its mean fits
        encoded.append((payload, ctx))
    return encoded


def _counts(state: HookState, plan, params, joined, device):
    """int32 [params, 2]: per parameter, whether this rank used it, and whether DDP writes its
    ``.grad`` anyway (a bucket view); all-reduced with the payloads."""
    view = state.ddp_model is not None and state.ddp_model.gradient_as_bucket_view
    # A joined rank counts what DDP's Join shadow contributes to its used map: the previous
    # step's all-reduced map (sticky while joined), not zeros, so "dropped" below is DDP's
    used = state.last_used.get(id(plan)) if joined else None
    if used is None:
        used = torch.tensor([0 if joined else int(id(p) in state.used) for p in params],
                            dtype=torch.int32, device=device)
    views = torch.tensor([int(view and p.grad is not None) for p in params], dtype=torch.int32, device=device)
    state.used.difference_update(id(p) for p in params)
    return torch.stack([used, views], 1)


def _write_cast(dst, flat, factor, n):
    """A cast's mean into the bucket: ``flat`` (its summed payload) times ``factor / n``."""
    if factor == n:  # fp16's 1/n pre-scale: nothing left to scale
        dst.copy_(flat)
    elif dst.dtype == torch.float32 and flat.dtype != torch.float32:
        # (torch.mul(flat, f, out=dst) would cost 8 operations here, and round the product in
        # the payload's half dtype)
        dst.copy_(flat)
        dst.mul_(factor / n)
    else:  # in the payload's dtype (float32 into a half bucket: the mean, rounded once, not the sum)
        torch.mul(flat, factor / n, out=dst)


def _decode(state: HookState, plan, encoded, reduced, counts, buffer):
    """Decode every unit's summed payload into the bucket's ``buffer`` (the mean); with
    ``counts`` (the all-reduced :func:`_counts`), what DDP will drop is kept owed."""
    codec, n = state.codec, state.world_size
    dropped = None
    if counts is not None:  # no rank used it, and DDP will not write its .grad
        dropped = (counts[:, 0] == 0) & (counts[:, 1] == 0)
    slots = _slots(state, plan, buffer.device) if counts is not None else [None] * len(plan.units)
    outs = []
    for unit, slot, (_, ctx), payload in zip(plan.units, slots, encoded, reduced):
        factor = codec.linear_decode(ctx) if unit.contiguous else None
        if factor is not None:  # a cast: its mean written into the bucket
            _write_cast(buffer[unit.start:unit.stop], _flat(payload), factor, n)
            continue
        dst = buffer[unit.start:unit.stop] if unit.contiguous else None
        out = payload if ctx is None else codec.decode(payload, ctx, divide=n, into=dst)
        if dropped is not None:
            codec.add_error_feedback(ctx, _dropped_part(out, dropped, slot))
        outs.append((unit, dst, out))
    # Written into the bucket's buffer (one copy per unit, none where the decode wrote there
    # itself) and the buffer returned: DDP then sees its own views and copies nothing more per
    # parameter.
    for unit, dst, out in outs:
        if dst is not None:
            runs.write_into(dst, out)
        else:
            runs.scatter(buffer, unit, out)


def _future(engine, futures, finish, buffer):
    """One future of ``finish([each future's tensor])``: ``then`` for one collective (its
    callback's streams wait for the all-reduce; DDP's for it); for several, a future of the
    buffer's device completed on the streams the decode ran on (collect_all's holds no tensors
    and records no CUDA events)."""
    # wait(), not value(): on CUDA it makes this thread's current stream wait for each
    # all-reduce (value() does not, and collect_all's callback is synchronised with none)
    if len(futures) == 1:
        return futures[0].then(lambda fut: finish([engine.wait(fut)]))
    done = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

    def complete(fut):
        try:
            done.set_result(finish([engine.wait(f) for f in fut.value()]))
        except Exception as exc:  # noqa: BLE001 - handed to DDP's wait(), as then() would
            done.set_exception(exc)
    torch.futures.collect_all(futures).add_done_callback(complete)
    return done


def hook(state: HookState, bucket):
    """DDP communication hook: compress ``bucket`` (one codec call per route, or per tensor),
    all-reduce the payloads (one collective per payload dtype), decode, average (module
    docstring).

    Returns a ``torch.futures.Future`` holding ``bucket.buffer()`` with the averaged, decoded
    gradients written into it.

    Under the Python reducer (compiled DDP) ``bucket`` is ``(grad, param)`` and the hook
    returns None: :mod:`torch_backend.ddp_compiled` gathers the buckets and writes the means.

    Raises:
        TypeError: ``state`` is not a :class:`HookState` (e.g. the compressor itself).
        ValueError: a gradient whose parameter the model does not name, ``Join`` with
            ``divide_by_initial_world_size=False``, or what the compressor refuses (on every
            rank, before the collective).
    """
    if not isinstance(state, HookState):
        raise TypeError(f"hvd_gradcomp DDP hook: the state must be a HookState, got "
                        f"{type(state).__name__}; use register_comm_hook(ddp_model, compressor), or "
                        f"pass torch_backend.ddp.comm_state(model, compressor) as the state (e.g. "
                        f"Lightning's DDPStrategy(ddp_comm_state=comm_state(model, comp), "
                        f"ddp_comm_hook=hook))")
    if isinstance(bucket, tuple):  # DDP's Python reducer (torch.compile, compiled autograd)
        return ddp_compiled.arrive(state, bucket[0], bucket[1], hook)
    codec = state.codec
    if codec.engine is None:  # a state made by comm_state(): bound at the first backward
        state.bind()
    joined = _joined()
    if state.ddp_model is not None and not getattr(state.ddp_model, "_divide_by_initial_world_size", True):
        raise ValueError(f"hvd_gradcomp DDP hook {codec.spec!r}: Join(..., "
                         f"divide_by_initial_world_size=False) is not supported (the hook divides "
                         f"by the process group's size); use the default True")
    buffer, params = bucket.buffer(), bucket.parameters()
    plan = None if buffer.is_sparse else _plan(state, bucket, buffer, params)
    if plan is None:  # a sparse gradient's bucket: uncompressed, averaged
        buffer.div_(state.world_size)
        fut = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    encoded = _encode(codec, plan, buffer, state.world_size)
    payloads = [p for p, _ in encoded]
    if joined:  # zero payloads (the counts travel as they are)
        payloads = [torch.zeros_like(p) for p in payloads]
    if state.tracks_unused:  # users per parameter, and whether DDP writes its result anyway
        payloads.append(_counts(state, plan, params, joined, buffer.device))
    packed, futures = post_payloads(OPS, payloads, codec.engine.post)

    def finish(results):
        try:
            reduced = unpack_payloads(OPS, packed, results, view=torch.Tensor.view)
        finally:
            packed.buffers.clear()  # the payloads sent stay alive until here (the all-reduce's stream reads them)
        counts = reduced[len(encoded)] if state.tracks_unused else None
        with torch.no_grad():
            if counts is not None:
                state.last_used[id(plan)] = (counts[:, 0] > 0).to(torch.int32)
            if joined:
                for (_, ctx), payload in zip(encoded, reduced):
                    codec.decode_joined(payload, ctx)
            else:
                _decode(state, plan, encoded, reduced, counts, buffer)
        return buffer
    return _future(codec.engine, futures, finish, buffer)


def make_comm_hook(ddp_model, compressor, per_tensor: bool = False, delay: int = 0):
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``, with ``compressor``
    bound to the model's process group: what :func:`register_comm_hook` registers, for callers
    that wrap the hook (e.g. to time it). Arguments and errors as there; the compressor is
    bound here (register_comm_hook binds only once DDP has accepted the hook). With
    ``delay=1``: a :class:`~torch_backend.ddp_delayed.DelayedHook` and its hook."""
    state = _model_state(ddp_model, compressor, per_tensor, delay).bind(ddp_model)
    return (state, hook) if not delay else _delayed(state, ddp_model)


_STEPS = ddp_delayed.BucketSteps(_plan, _encode, _decode, _counts, _joined)  # the delayed hook runs these


def _delayed(state, ddp_model):
    """(state, hook) of the delayed hook over a bound :class:`HookState`."""
    return ddp_delayed.DelayedHook(state, state.delay, _STEPS).register(ddp_model), ddp_delayed.hook


def _model_state(ddp_model, compressor, per_tensor, delay=0) -> HookState:
    """The unbound :class:`HookState` of a DDP model, its arguments checked."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_comm_hook: expected a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    _check_compressor(compressor)
    if ddp_delayed.check_delay(delay):
        ddp_delayed.check_model(ddp_model, compressor.spec)
    names = {p: name for name, p in ddp_model.module.named_parameters()}
    state = HookState(compressor, names, ddp_model.process_group, None, ddp_model, per_tensor)
    state.delay = delay
    return state


def register_comm_hook(ddp_model, compressor, per_tensor: bool = False, delay: int = 0):
    """Install ``compressor`` as ``ddp_model``'s communication hook.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel``, before its first backward.
        compressor: a compressor from ``torch_backend.Compression`` (``Compression.topkc(0.1)``,
            ``from_spec``, ``rules``, ``auto``), new or loaded from a checkpoint, used by no
            other model.
        per_tensor: compress each gradient alone instead of one codec call per bucket and
            route (module docstring); the same numbers for the casts, more operations.
        delay: 0 (blocking) or 1: delayed sync, step t's payloads posted during step t's
            backward and their mean applied at step t + 1 (:mod:`torch_backend.ddp_delayed`;
            ``ddp_delayed.delayed_state(ddp_model)`` drains it and saves its held means).

    Binds the compressor to the model's process group (ranks, world size, checkpoints) once
    DDP has accepted the hook, and for ``auto`` without ``bandwidth_gbit`` measures the link
    there (``calibrate()``: a collective, so every rank calls ``register_comm_hook`` at the
    same point). Returns the compressor.

    Raises:
        TypeError: ``compressor`` is a factory (``Compression.fp16`` without the call) or not a
            PyTorch compressor; ``ddp_model`` is not a DDP model.
        ValueError: the compressor is already bound to a DDP model, or routes some tensor to a
            blocking two-round variant; ``delay`` not 0 or 1, or ``delay=1`` on a model it
            cannot serve (compiled DDP, sparse gradients).
        RuntimeError: DDP's own refusal (e.g. the model has a hook already); the compressor is
            then left unbound.
    """
    state = _model_state(ddp_model, compressor, per_tensor, delay)
    ddp_compiled.check_model(ddp_model, compressor.spec)
    if delay:  # DDP's checks first: nothing bound if it refuses
        delayed = ddp_delayed.DelayedHook(state, delay, _STEPS)
        ddp_model.register_comm_hook(delayed, ddp_delayed.hook)
        state.bind(ddp_model)
        delayed.register(ddp_model)
        return compressor
    ddp_model.register_comm_hook(state, hook)  # DDP's checks first: nothing bound if it refuses
    state.bind(ddp_model)
    return compressor
