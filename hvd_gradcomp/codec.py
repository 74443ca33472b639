"""The codec: one engine-neutral, framework-free object that every engine calls.

A :class:`Codec` owns its parts and says so in its fields:

- ``tensors``: the :class:`~hvd_gradcomp.records.TensorBook` (per key: facts, wire bytes,
  loaded states, owners, sparse gradients);
- ``groups``: the :class:`~hvd_gradcomp.buckets.GroupBook` (bucket groups, where each tensor's
  error feedback lives);
- ``routing`` and ``table``: which scheme sends each tensor (:mod:`~hvd_gradcomp.routing`);
- ``plans``: the one plan cache of bucket layouts;

and it is handed: ``ops`` (the backend's primitives), ``store`` (where scheme states live,
:class:`~hvd_gradcomp.store.Store`), ``frontend`` (the framework facts,
:class:`~hvd_gradcomp.frontend.Frontend`), ``horovod`` (Horovod's collectives,
:class:`~hvd_gradcomp.horovod_ops.HorovodCollectives`, or None) and, once an engine binds
itself, ``engine`` (:class:`~hvd_gradcomp.engine.Engine`).

An engine's step (docs/writing-an-engine.md): ``plan_bucket`` -> ``encode_unit`` per unit ->
post the payloads (:mod:`~hvd_gradcomp.payloads`, one collective per payload dtype) ->
``decode``; ``encode``/``decode`` for one tensor; ``decode_joined`` (DDP's Join),
``decode_scattered`` (a reduce-scatter: :mod:`~hvd_gradcomp.scattered`), ``linear_decode``,
``add_error_feedback``. Checkpoints (:mod:`~hvd_gradcomp.checkpoint`), reports
(:mod:`~hvd_gradcomp.reports`) and link calibration (:mod:`~hvd_gradcomp.link`) are functions
over a codec. Horovod's ``compress``/``decompress`` contract is the
:class:`~hvd_gradcomp.adapter.HorovodCompressor`'s, which holds a codec.
"""
import dataclasses
import logging

from . import composite
from .base import HALF_MAX, EmptyState, Scheme, TensorInfo, compress_tensor, finish_tensor, passes_through, \
    saturate_output
from .buckets import BucketPlan, GroupBook, Unit, flattens, group_key
from .calls import AdapterCtx, Call, scheme_info
from .auto.group import auto_group, auto_group_key, group_choice, group_choices
from .auto.scheme import AutoScheme
from .powersgd_batched import batch_view, batched_scheme
from .primitives import FLOAT_DTYPES
from .records import TensorBook
from .routing import RouteTable, Routing
from .scattered import decode_scattered

__all__ = ["Codec"]

log = logging.getLogger("hvd_gradcomp")


class Codec:
    """The engine-neutral codec (module docstring).

    Args:
        routing: a :class:`~hvd_gradcomp.routing.Routing`, or one scheme (every tensor to it,
            those below its ``min_numel`` to fp16).
        ops: the backend's :class:`~hvd_gradcomp.primitives.Primitives`.
        store: a :class:`~hvd_gradcomp.store.Store`.
        frontend: a :class:`~hvd_gradcomp.frontend.Frontend`.
        horovod: Horovod's collectives used while no engine is bound, or None (an engine must
            then be bound before the first tensor: the world size comes from it).
    """

    __slots__ = ("ops", "store", "frontend", "horovod", "engine", "routing", "table", "tensors", "groups",
                 "plans", "scale_source", "warned", "__weakref__")

    def __init__(self, routing, ops, store, frontend, horovod=None):
        if isinstance(routing, Scheme):
            routing = Routing.single(routing)
        self.ops, self.store, self.frontend, self.horovod = ops, store, frontend, horovod
        self.engine = None
        self.routing = routing.bind(ops)
        self.table = RouteTable(self.routing)
        self.tensors = TensorBook(ops, store, frontend)
        self.groups = GroupBook(ops, store, self.tensors, self.table)
        self.plans = {}
        self.scale_source = None  # the loss scale's source (set_loss_scale), or None
        self.warned = set()  # (what, key) warned about once (a joined rank's dropped error feedback)

    @property
    def spec(self) -> str:
        """The canonical text spec of the routing (``Compression.from_spec`` rebuilds it)."""
        return self.routing.spec()

    # ---- the collectives outside compress: a bound engine's, else Horovod's ----
    def bind_engine(self, engine):
        """Use ``engine``'s collectives (an :class:`~hvd_gradcomp.engine.Engine`: world, object
        gather, blocking all-reduce) instead of Horovod's; returns self. Raises ValueError if
        another engine is bound already (a codec belongs to one training run: its state is kept
        per tensor key)."""
        if self.engine is not None and self.engine is not engine:
            raise ValueError(f"compressor {self.spec!r} is already bound to {self.engine!r}; each "
                             f"model needs its own compressor (its state is kept per tensor key)")
        self.engine = engine
        return self

    def world(self, process_set=None):
        """(world size, rank) of the all-reduce: the bound engine's group, else Horovod's
        ``process_set`` (None: the global set). Raises ValueError with neither."""
        if self.engine is not None:
            return self.engine.world()
        if self.horovod is None:
            raise ValueError(f"{self.spec}: no engine bound (codec.bind_engine) and no Horovod")
        return self.horovod.world(process_set)

    def global_world(self):
        """(size, rank) of the engine's group or Horovod's global set; (None, None) when
        neither is there yet (before ``hvd.init()``, or without Horovod)."""
        try:
            return self.world(None)
        except (ValueError, ImportError):
            return None, None

    def job_world(self):
        """(size, rank) of this process: :meth:`global_world`, else the framework's own process
        group (``torch.distributed``'s, so a checkpoint loads before ``register_comm_hook``)."""
        size, rank = self.global_world()
        return (size, rank) if size is not None else self.frontend.process_world()

    def gather(self, obj, name: str) -> list:
        """``[obj of rank 0, 1, ...]`` on every rank (route checks and checkpoints only)."""
        if self.engine is not None:
            return self.engine.gather(obj)
        return self.horovod.gather(obj, name)

    def allreduce_host(self, x, average: bool, name: str, process_set=None):
        """``x`` summed (``average``: averaged) over the ranks, blocking (``calibrate`` only)."""
        if self.engine is not None:
            return self.engine.allreduce(x, average)
        return self.horovod.allreduce(x, average, name, process_set)

    def route(self, params, check: bool = True) -> list:
        """Decide each parameter's route now and (``check``) compare the ranks' decisions with
        one object gather; returns ``[(name, scheme spec or None), ...]``, raises ValueError on
        every rank if they differ (:meth:`~hvd_gradcomp.routing.RouteTable.route`)."""
        gather = (lambda table: self.gather(table, "hvd_gradcomp.route")) if check else None
        return self.table.route(self.frontend.route_items(params), gather)

    # ---- one tensor in ----
    @staticmethod
    def check_call(s: Scheme, key, call: Call, info: TensorInfo):
        """Refuse, before any collective, what the all-reduce would do to a payload scheme ``s``
        cannot take (an op, a scale factor, a blocking variant on a filled-in gradient)."""
        if s.identity or s.linear:
            if call.op == "product" and not s.identity:
                raise ValueError(f"{s.name}: tensor {key!r}: op=Product of pre-scaled payloads is not "
                                 f"the product of the gradients; use op=Sum or Average")
            return
        if call.op not in (None, "sum", "average"):
            raise ValueError(f"{s.name}: tensor {key!r}: op={call.op.capitalize()} cannot combine "
                             f"{s.name} payloads (selected or quantised per step); {s.name} supports "
                             f"op=Sum and op=Average only. Use Compression.fp16() or none with "
                             f"op={call.op.capitalize()}")
        if not s.scalable and (call.prescale != 1.0 or call.postscale != 1.0):
            raise ValueError(f"{s.name}: tensor {key!r}: Horovod would scale the payload "
                             f"(gradient_predivide_factor / prescale_factor={call.prescale:g}, "
                             f"postscale_factor={call.postscale:g}), which corrupts {s.name}'s "
                             f"integer payload; leave these factors at 1 with this compressor")
        if call.filled_in and composite.blocks(s, info):
            raise ValueError(f"{s.spec()}: tensor {key!r} had no gradient on this rank, so Horovod's "
                             f"synchronize() fills it in, in an order that differs between ranks; "
                             f"this variant posts a blocking side all-reduce inside compress and "
                             f"would hang. Use the default (single-collective) variant of "
                             f"{s.name}")

    def info(self, key, shape, dtype, call: Call, tensor) -> TensorInfo:
        """The :class:`~hvd_gradcomp.base.TensorInfo` of a tensor sent under ``key`` by ``call``."""
        world_size, rank = self.world(call.process_set)
        op = call.op if call.op in ("sum", "average") else None
        # Horovod's NCCL Average divides by n before summing: schemes then skip their 1/n.
        # (An engine's all-reduce, e.g. DDP's, divides nothing: schemes pre-scale themselves.)
        nccl_avg = self.engine is None and op == "average" and world_size > 1 and \
            self.frontend.on_gpu(tensor) and self.horovod.nccl_avg()
        # "<unnamed>": a tensor without a key, for stateless schemes only (any key will do).
        return TensorInfo("<unnamed>" if key is None else key, shape, dtype, world_size, rank, op,
                          call.process_set, nccl_avg)

    def encode_call(self, tensor, call: Call, no_key_message: str = None):
        """``(payload, ctx, key)`` of one tensor described by ``call`` (key None, ctx None when it
        passes through untouched: not a float tensor, or empty). ``no_key_message``: the error
        for a stateful scheme's tensor without a key. Raises ValueError as :meth:`encode`."""
        ops = self.ops
        dtype = ops.dtype(tensor)
        if dtype not in FLOAT_DTYPES:
            return tensor, None, None
        tensor = self.frontend.static(tensor, call)
        shape = ops.shape(tensor)
        numel = 1
        for s in shape:
            numel *= s
        if passes_through(dtype, numel):
            return tensor, None, None
        key = self.tensors.key(call)
        info = self.info(key, shape, dtype, call, tensor)
        route = self.table.of(key, call.label if call.label is not None else call.key, call.pin, info)
        if key in self.table.superseded:  # a checkpoint's state of the scheme that now refuses it
            self.table.superseded.discard(key)
            self.tensors.pending.pop(key, None)
        scheme = route.scheme
        unnamed = key is None
        if unnamed and type(scheme).init is not Scheme.init and not scheme.state_optional:
            raise ValueError((no_key_message or self.frontend.no_key_message).format(scheme=scheme.name))
        self.check_call(scheme, info.key, call, info)
        payload, ctx = self._encode_info(tensor, info, scheme, keyed=not unnamed)
        return payload, ctx, info.key

    def _encode_info(self, tensor, info: TensorInfo, scheme: Scheme, detach: bool = True, keyed: bool = True):
        """``(payload, ctx)`` of ``tensor`` under ``info``: the records (facts, wire bytes), the
        loss scale, the state (none for a tensor without a key: a ``state_optional`` scheme's),
        the scheme's compress. Shared by one tensor and a bucket's unit."""
        ops, key, book = self.ops, info.key, self.tensors
        known = book.infos.get(key)
        if known is not None and (known.shape, known.dtype) != (info.shape, info.dtype):
            raise ValueError(f"{scheme.name}: tensor {key!r} was {known.dtype}{list(known.shape)} "
                             f"in earlier steps, got {info.dtype}{list(info.shape)}; one key, one shape")
        if known != info or scheme.adaptive:  # static per tensor, except for adaptive schemes
            book.wire[key] = scheme.wire(info)
        book.infos[key] = info
        if scheme.identity:
            return tensor, None
        if detach:  # (a bucket's buffer has no autograd history)
            tensor = self.frontend.detach(tensor)
        scale = None
        if self.scale_source is not None:
            scale = self.frontend.scale_of(self.scale_source)
            tensor = ops.cast(tensor, "float32") * (1.0 / scale)
        state = self.groups.state_for(scheme, info, tensor) if keyed else EmptyState()
        payload, ctx = compress_tensor(scheme, ops, tensor, state, scheme_info(info, scale))
        return payload, AdapterCtx(info, ctx, scale, scheme)

    def encode(self, tensor, key: str, op: str = "sum", group=None, label=None):
        """Compress one gradient under an explicit key, for an engine that posts the all-reduce.

        Args:
            tensor: the gradient (any shape, a float dtype; other dtypes and empty tensors are
                returned as their own payload with ctx None).
            key: its stable identity, equal on every rank (a parameter name, a shard's path).
            op: ``"sum"`` or ``"average"``: how the engine combines the ranks' payloads.
            group: the engine's process group (recorded in the tensor's info; not its identity).
            label: the name routing rules match (default ``key``).

        Returns ``(payload, ctx)``: the engine all-reduces ``payload`` (in its dtype, elementwise,
        with ``op``) and hands the result to :meth:`decode` with ``ctx``. Posts no collective.

        Raises:
            ValueError: a bad op, a sparse tensor, a shape change under one key, a route that
                differs from a loaded checkpoint's, ...; before any collective.
        """
        if op not in ("sum", "average"):
            raise ValueError(f"{self.spec}: encode({key!r}): op must be 'sum' or 'average', got {op!r}")
        if self.frontend.is_sparse(tensor):
            raise ValueError(f"{self.spec}: tensor {key!r} has a sparse gradient; all-reduce it "
                             f"uncompressed (or make it dense) instead of encoding it")
        payload, ctx, _ = self.encode_call(tensor, Call(key=key, op=op, process_set=group,
                                                        label=label if label is not None else key))
        return payload, ctx

    # ---- a bucket in ----
    def plan_bucket(self, members, dtype: str, op: str = "sum", group=None, like=None,
                    per_tensor: bool = False, layout=None) -> BucketPlan:
        """Route the tensors of a bucket and cut it into units (:mod:`~hvd_gradcomp.buckets`).

        Args:
            members: the bucket's tensors (:class:`~hvd_gradcomp.buckets.Member`), in buffer
                order; or a callable returning them, called only when ``layout`` is not cached.
            dtype: the buffer's dtype string (one float dtype for the whole bucket).
            op: the reduction the engine applies (``"sum"``, ``"average"``; another Horovod op
                name is checked against each member's scheme, which refuses what it cannot take).
            group: the engine's process group.
            like: a tensor on the buffer's device.
            per_tensor: every tensor its own unit (no flat groups): the reference layout.
            layout: a key of the layout the engine forms without reading its members (DDP: the
                bucket's index, its parameters' identities and its size), or None.

        Returns the :class:`~hvd_gradcomp.buckets.BucketPlan`, the same object for the same
        layout at every step (no members: an empty plan). Raises ValueError: what
        :meth:`encode` refuses for any member (before any collective).
        """
        fast = None if layout is None else ("layout", layout, dtype, op, id(group), per_tensor)
        # auto's tensors are grouped per choice between windows (auto/group.py): the plan also
        # follows each one's group_choice (host facts), re-planned when one changes
        token = routed = None
        if not per_tensor and any(isinstance(s, AutoScheme) for s in self.routing.schemes()):
            routed = None if fast is None else self.plans.get(("auto",) + fast)
            if routed is None:  # (cached per layout once the plan has routed every member)
                members = tuple(members() if callable(members) else members)
                routed = self._auto_routed(members)
            token = group_choices(routed, self.world(group)[0], self.store)
            fast = None if fast is None else fast + (token,)
        plan = None if fast is None else self.plans.get(fast)
        if plan is not None:
            return plan
        members = tuple(members() if callable(members) else members)
        sig = (tuple((m.key, tuple(m.shape), m.offset) for m in members), dtype, op, id(group), per_tensor, token)
        plan = self.plans.get(sig)
        if plan is None:
            plan = BucketPlan(members, self._units(members, dtype, op, group, like, per_tensor), dtype)
            if len(self.plans) > 128:  # layouts seen: the initial buckets, the rebuilt ones, a few more
                self.plans.clear()
            self.plans[sig] = plan
        if fast is not None:
            self.plans[fast] = plan
            if token is not None:
                self.plans[("auto",) + fast[:-1]] = self._auto_routed(members)
        return plan

    def _auto_routed(self, members) -> tuple:
        """``(auto scheme or None, key)`` per member routed to ``auto`` or not routed yet (None),
        in order: the tensors whose :func:`~hvd_gradcomp.auto.group.group_choices` (once per
        group: the host Python per step follows the groups) key the bucket's plan."""
        routes, out = self.table.routes, []
        for m in members:
            route = routes.get(m.key)
            if route is None or isinstance(route.scheme, AutoScheme):
                out.append((None if route is None else route.scheme, m.key))
        return tuple(out)

    def _units(self, members, dtype, op, group, like, per_tensor) -> tuple:
        """The units of a bucket (:meth:`plan_bucket`): each member routed, flat groups formed,
        PowerSGD's matrices of one view batched (a group whose unit's scheme is a
        :class:`~hvd_gradcomp.powersgd_batched.BatchedPowerSGD`: :func:`batch_view`), and auto's
        tensors on one choice between windows grouped (an
        :class:`~hvd_gradcomp.auto.group.AutoGroup`: :func:`group_choice`)."""
        ops, book = self.ops, self.groups
        slots, flat_slots = [], {}  # slots: units in order of their first tensor; flat_slots: by group
        for i, m in enumerate(members):
            if passes_through(dtype, m.numel):
                continue
            call = Call(key=m.key, op=op, process_set=group, label=m.label)
            info = self.info(m.key, tuple(m.shape), dtype, call, like)
            route = self.table.of(m.key, m.label, None, info)
            if m.key in self.table.superseded:
                self.table.superseded.discard(m.key)
                self.tensors.pending.pop(m.key, None)
            self.check_call(route.scheme, m.key, call, info)
            # kind: None (flat or alone), ("batch", PowerSGD's matrix view) or ("auto", choice)
            flat = flattens(route.scheme) and not per_tensor
            view = None if per_tensor else batch_view(route.scheme, info, ops.name)
            kind = None if view is None else ("batch", view)
            if isinstance(route.scheme, AutoScheme) and not per_tensor:  # grouped per choice (auto/group.py)
                choice = group_choice(route.scheme, m.key, info.world_size, self.store)
                kind = None if choice < 0 else ("auto", choice)
            slot_key = id(route.scheme) if flat else (None if kind is None else (id(route.scheme), kind))
            if slot_key is not None and slot_key in flat_slots:
                flat_slots[slot_key][1].append((i, info))
                continue
            slot = (route.scheme, [(i, info)], kind)
            if slot_key is not None:
                flat_slots[slot_key] = slot
            slots.append(slot)
        units = []
        for scheme, grouped, kind in slots:
            if len(grouped) == 1:
                (i, info), = grouped
                m = members[i]
                units.append(Unit(m.key, scheme, info, (i,), m.offset, m.offset + m.numel))
                continue
            idx = book.saved_order(tuple(i for i, _ in grouped), members)
            infos = dict(grouped)
            keys = tuple(members[i].key for i in idx)
            auto = kind is not None and kind[0] == "auto"
            gkey = auto_group_key(scheme, keys, kind[1]) if auto else group_key(keys)
            total = sum(members[i].numel for i in idx)
            book.add(gkey, keys, tuple(members[i].numel for i in idx), {members[i].key: infos[i] for i in idx})
            if auto:  # auto's tensors on one choice: one auto tensor of their vector
                scheme = auto_group(scheme, gkey, keys, kind[1])
            elif kind is not None:  # a batch: its own scheme object, kept per group key
                scheme = batched_scheme(scheme, gkey, keys, tuple(infos[i] for i in idx), kind[1], self.tensors)
            first, info0 = members[idx[0]], infos[idx[0]]
            ginfo = type(info0)(gkey, (total,), dtype, info0.world_size, info0.rank, info0.op,
                                info0.group, info0.nccl_avg)
            if all(members[a].offset + members[a].numel == members[b].offset for a, b in zip(idx, idx[1:])):
                units.append(Unit(gkey, scheme, ginfo, idx, first.offset, first.offset + total))
                continue
            index = ops.concat([ops.arange(members[i].numel, "int64", like) + members[i].offset for i in idx], 0)
            runs = []
            for i in idx:  # adjacent members merge into one run
                lo, hi = members[i].offset, members[i].offset + members[i].numel
                if runs and runs[-1][1] == lo:
                    runs[-1] = (runs[-1][0], hi)
                else:
                    runs.append((lo, hi))
            units.append(Unit(gkey, scheme, ginfo, idx, -1, -1, index, tuple(runs)))
        for unit in units:  # whose bytes each tensor's are now (reports count the holders only)
            for i in unit.members:
                book.holders[members[i].key] = unit.key
                if unit.key != members[i].key:
                    self.tensors.wire.pop(members[i].key, None)
        return tuple(units)

    def encode_unit(self, unit: Unit, x):
        """``(payload, ctx)`` of one unit of a plan, as :meth:`encode` of one tensor: ``x`` holds
        the unit's coordinates (a group: its members' flat coordinates in buffer order, shape
        ``unit.info.shape``; a view of the engine's buffer, without autograd history). Decode
        with :meth:`decode`. Posts no collective."""
        return self._encode_info(x, unit.info, unit.scheme, detach=False)

    # ---- out ----
    def decode_call(self, payload, ctx):
        """Horovod's decompress of one tensor: the all-reduced ``payload`` in the gradient's
        shape and dtype (times the loss scale), the state moved on (:func:`finish_tensor`)."""
        info, inner, scale, scheme = ctx
        has_state = self.store.has(info.key)
        state = self.store.read(info.key) if has_state else EmptyState()
        out, new_state = finish_tensor(scheme, self.ops, payload, inner, state, scheme_info(info, scale),
                                       dtype=info.dtype, scale=scale)
        if has_state and new_state is not state:
            self.store.write(info.key, new_state)
        return out

    def decode(self, payload, ctx, divide=None, into=None):
        """The all-reduced ``payload`` of :meth:`encode` mapped back; the tensor's state moves on.

        Args:
            payload: the all-reduced payload (same shape and dtype as encode returned).
            ctx: encode's ctx.
            divide: None: the sum (op ``"sum"``) or mean (``"average"``) in the gradient's dtype.
                A number n: the decoded value divided by n in float32 before the cast to the
                gradient's dtype (DDP's mean of a sum), so a float16 gradient's mean is never
                formed from an overflowing float16 sum; a finite value beyond a half dtype's
                range is clamped and the excess kept in error feedback.
            into: None, or a flat float32 tensor of the gradient's numel (an engine's bucket
                slice) that the result may be written into, with ``divide`` folded into the same
                pass (:func:`~hvd_gradcomp.composite.decompress_into`: signSGD's fused decode);
                used only for a float32 gradient without a loss scale. The result then shares
                ``into``'s storage; otherwise it is a new tensor for the caller to copy.
        """
        if ctx is None:
            return payload if divide is None else payload / divide
        if divide is None:
            return self.decode_call(payload, ctx)
        info, inner, scale, scheme = ctx
        sinfo = scheme_info(info, scale)
        has_state = self.store.has(info.key)
        state = self.store.read(info.key) if has_state else EmptyState()
        # (a factor of 1.0 is no pass at all at world size 1; into only where no cast or scale follows)
        out, new_state = finish_tensor(scheme, self.ops, payload, inner, state, sinfo, dtype="float32",
                                       factor=1.0 / divide, into=into if info.dtype == "float32" and scale is None
                                       else None)
        if info.dtype in HALF_MAX:  # clamp the mean: each rank keeps the excess (Average's share)
            out, new_state = saturate_output(scheme, self.ops, out, new_state,
                                             dataclasses.replace(sinfo, op="average"), HALF_MAX[info.dtype], scale)
        if scale is not None:
            out = out * scale
        if info.dtype != "float32":
            out = self.ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self.store.write(info.key, new_state)
        return out

    def linear_decode(self, ctx):
        """The factor ``f`` when decoding ``ctx``'s payload is its float32 cast times ``f`` and
        moves no state (the casts, without a loss scale), so an engine may fuse the cast, the
        scaling and the write into its own buffer; else None."""
        if ctx is None or ctx.scale is not None or self.store.has(ctx.info.key):
            return None
        return composite.decode_factor(ctx.scheme, scheme_info(ctx.info, ctx.scale))

    def as_sent_zeros(self, ctx):
        """``ctx`` (of :meth:`encode` or :meth:`encode_unit`; None passes) as a rank that posted a
        zero payload in place of its own holds it, so that it decodes the mean its peers decode
        (DDP's ``Join`` under the delayed hook): the scheme's
        :func:`~hvd_gradcomp.composite.sent_zeros` (THC's and SparseLoCo's own words zeroed)."""
        return None if ctx is None else ctx._replace(inner=composite.sent_zeros(ctx.scheme, self.ops, ctx.inner))

    def decode_joined(self, payload, ctx):
        """The state step of a rank that contributed zeros (DDP's ``Join``): the fields every
        rank agrees on move on from the all-reduced ``payload``, this rank's own fields
        (:attr:`~hvd_gradcomp.base.Scheme.rank_local_fields`: its error feedback) stay as they
        were. Nothing is returned (the joined rank has no gradient to write)."""
        if ctx is None or not self.store.has(ctx.info.key):  # passed through, or stateless
            return
        info, inner, scale, scheme = ctx
        info = scheme_info(info, scale)
        old = self.store.read(info.key)
        _, new = finish_tensor(scheme, self.ops, payload, inner, old, info)
        if new is old:
            return
        local = [f for f in scheme.rank_local_fields if f in new._fields]
        if tuple(new._fields) == tuple(old._fields) and all(
                tuple(self.ops.shape(getattr(old, f))) == tuple(self.ops.shape(getattr(new, f))) for f in local):
            new = new._replace(**{f: getattr(old, f) for f in local})
        else:  # an adaptive scheme changed the tensor's scheme on the agreed figures
            new = new._replace(**{f: 0.0 * getattr(new, f) for f in local})
            if ("joined", info.key) not in self.warned:  # once per tensor and codec
                self.warned.add(("joined", info.key))
                log.warning("hvd_gradcomp: %s changed scheme while this rank had joined; its pending "
                            "error feedback on this rank is dropped", info.key)
        self.store.write(info.key, new)

    def decode_scattered(self, values, agreed, ctx, divide=None):
        """One tensor's step after a reduce-scatter of its payload (FSDP2's): arguments, return
        and errors as :func:`hvd_gradcomp.scattered.decode_scattered`."""
        return decode_scattered(self, values, agreed, ctx, divide)

    def add_error_feedback(self, ctx, amount):
        """Keep ``amount`` owed: add it to the error feedback of the tensor (or group) ``ctx``
        was encoded for, as every rank's share of a decoded mean that the engine did not
        deliver (DDP keeps a parameter no rank used untouched).

        Args:
            ctx: the ctx of :meth:`encode` / :meth:`encode_unit`, after its :meth:`decode`.
            amount: float32, ``numel`` values in the gradient's units as delivered (times the
                loss scale, when one is set; divided out here).

        Nothing happens for a scheme that keeps no error feedback (the casts).
        """
        if ctx is None or not self.store.has(ctx.info.key):
            return
        info, _, scale, scheme = ctx
        ops = self.ops
        amount = ops.reshape(ops.cast(amount, "float32"), (info.numel,))
        if scale is not None:
            amount = amount * (1.0 / scale)
        moved = composite.add_residual(scheme, ops, self.store.read(info.key), info, amount)
        if moved is not None:
            self.store.write(info.key, moved)

    def error_feedback(self, key):
        """This rank's pending error feedback of tensor ``key`` in its own coordinates (float32
        ``[numel]``; :meth:`~hvd_gradcomp.buckets.GroupBook.error_feedback`), or None."""
        return self.groups.error_feedback(key)

    def __repr__(self):
        return f"Codec({self.spec!r}, engine={self.engine!r})"
