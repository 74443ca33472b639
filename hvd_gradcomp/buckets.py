"""One codec call per bucket: the tensors of a bucket that share a route, compressed as one flat vector.

An engine that all-reduces buckets (DDP's gradient buckets; FSDP's flat shards are one tensor
already) hands the compressor a bucket as a flat buffer and the layout of its tensors
(:class:`Member`: key, name the rules match, shape, offset in the buffer).
:meth:`Buckets.plan_bucket` routes each tensor as usual (rules by name, ``min_numel``,
``accepts``), then cuts the bucket into :class:`Unit` s:

- a **flat group**: the bucket's tensors of one route whose scheme's math is over a vector
  (:attr:`~hvd_gradcomp.base.Scheme.flattens`: the casts, TopK, TopKC, THC, signSGD). They are
  compressed as one vector of their concatenated coordinates (in bucket order), under a group
  key made from their keys (equal on every rank, since every rank's buckets hold the same
  tensors): THC's blocks and TopKC's chunks span tensor boundaries. A group whose tensors are
  contiguous in the buffer is read and written as a view (no copy); otherwise through one
  gather and one scatter with a cached index;
- a **single tensor**: a scheme that needs the tensor's shape (PowerSGD's matrices), changes
  scheme per tensor (``auto``) or keeps per-tensor estimates (TopKC's EF21), or a group of one.

The codec's work per step then follows the bucket count and the bytes, not the tensor count.

**Per-tensor identity stays.** Error feedback is one flat buffer per group (the scheme's own
state of the group's vector); each tensor's part of it is a slice, in the gradient's
coordinates (:func:`~hvd_gradcomp.composite.residual_of`: THC's rotated residual is rotated
back). ``state_dict()`` stores each tensor's part under its own key (the field
:data:`ERROR_FEEDBACK`, float32 ``[numel]``) and the fields the ranks agree on (TopKC's scores,
THC's ranges, counters) under the group key in ``"buckets"``. A checkpoint therefore loads
into a run with other buckets (another bucket size, DDP's rebuild after the first step, the
Horovod path): each tensor's error feedback moves into whatever holds it now; agreed fields
load where the same group exists and start afresh (equally on every rank) where not. A
per-tensor state (an older checkpoint, a tensor first sent alone) moves into a group the same
way, when the group is first compressed. Routes, ``wire_bytes()`` (a group's bytes shared out
by size; ``bytes_per_step()`` exact), ``metrics()`` (per group key) and ``routes()`` stay per
tensor.

A mixin of :class:`hvd_gradcomp.adapter.HorovodCompressor` (its slots ``_groups``,
``_members``, ``_plans``).
"""
import zlib
from typing import Any, NamedTuple

from . import composite
from .base import passes_through

__all__ = ["Member", "Unit", "BucketPlan", "Buckets", "ERROR_FEEDBACK", "group_key"]

# The checkpoint field of a tensor's error feedback in the gradient's own coordinates (float32
# [numel]): what a bucketed run saves per tensor, and what any run can load into any layout.
ERROR_FEEDBACK = "error_feedback"


class Member(NamedTuple):
    """One tensor of a bucket: its key (state identity), label (what routing rules match),
    static shape, and offset and size in the bucket's flat buffer (elements)."""

    key: str
    label: str
    shape: tuple
    offset: int
    numel: int


class Unit(NamedTuple):
    """What one codec call sends: a flat group or a single tensor.

    key: the state key (the tensor's, or the group's :func:`group_key`).
    scheme: the route's scheme; info: the :class:`~hvd_gradcomp.base.TensorInfo` compressed
        (a group: shape ``(numel,)``).
    members: indices into :attr:`BucketPlan.members`, in buffer order.
    start, stop: the unit's span in the flat buffer when its members are contiguous, else -1.
    index: when not contiguous, the buffer positions of the unit's coordinates (int64, on the
        buffer's device, built once per plan), else None.
    runs: when not contiguous, the same positions as maximal runs ``((start, stop), ...)`` of
        the buffer, in the unit's order (an engine may copy run by run:
        :mod:`torch_backend.kernels.runs`), else ().
    """

    key: str
    scheme: Any
    info: Any
    members: tuple
    start: int
    stop: int
    index: Any = None
    runs: tuple = ()

    @property
    def contiguous(self) -> bool:
        return self.start >= 0


class BucketPlan(NamedTuple):
    """The units of one bucket layout (cached per layout: routes are decided once)."""

    members: tuple
    units: tuple
    dtype: str


class _Group(NamedTuple):
    """A flat group's tensors: keys, offsets in the group's vector, sizes."""

    keys: tuple
    offsets: tuple
    numels: tuple


def group_key(keys) -> str:
    """The state key of a flat group of the tensors ``keys`` (in order): readable, equal on every
    rank, different for different member lists (a CRC-32 of the joined keys)."""
    keys = list(keys)
    crc = zlib.crc32("\x00".join(keys).encode()) & 0xFFFFFFFF
    return f"bucket[{keys[0]}..{keys[-1]}|{len(keys)}|{crc:08x}]"


def _flattens(scheme) -> bool:
    return scheme.flattens and not scheme.adaptive and not scheme.blocking


class Buckets:
    """The bucketed codec (module docstring): planning, group state, checkpoint expansion.

    State of the mixin (slots of :class:`~hvd_gradcomp.adapter.HorovodCompressor`):
    ``_groups`` {group key: _Group} of every group planned; ``_members`` {tensor key: group key}
    of the group whose state holds the tensor's error feedback now; ``_plans`` {layout: plan};
    ``_holders`` {tensor key: the unit key whose payload carries it now} (reports count the
    bytes of these only: a group of an earlier layout no longer sends);
    ``_pending_groups`` {group key: saved agreed fields} from a checkpoint; ``_member_infos``
    {tensor key: its own TensorInfo}; ``_leaving`` {group key: True} of the groups that some of
    their tensors left while they kept state for the others (their state still holds stale
    error feedback of the tensors that left: when such a group is sent again, :meth:`_rejoin`
    moves those tensors' error feedback back in, in place of the stale slices).
    """

    __slots__ = ()

    def plan_bucket(self, members, dtype: str, op: str = "sum", group=None, like=None,
                    per_tensor: bool = False, layout=None) -> BucketPlan:
        """Route the tensors of a bucket and cut it into units (module docstring).

        Args:
            members: the bucket's tensors (:class:`Member`), in buffer order; or a callable
                returning them, called only when ``layout`` is not cached yet.
            dtype: the buffer's dtype string (one float dtype for the whole bucket).
            op: the reduction the engine applies (``"sum"``, ``"average"``; another Horovod op
                name is checked against each member's scheme, which refuses what it cannot take).
            group: the engine's process group.
            like: a tensor on the buffer's device.
            per_tensor: every tensor its own unit (no flat groups): the reference layout.
            layout: a key of the layout the engine forms without reading its members (DDP:
                the bucket's index, its parameters' identities and its size), or None. The
                compressor's one plan cache keeps the plan under it too.

        Returns the :class:`BucketPlan`, the same object for the same layout at every step (no
        members: an empty plan).

        Raises:
            ValueError: what :meth:`encode` refuses for any member (before any collective).
        """
        from .calls import Call
        fast = None if layout is None else ("layout", layout, dtype, op, id(group), per_tensor)
        plan = None if fast is None else self._plans.get(fast)
        if plan is not None:
            return plan
        members = tuple(members() if callable(members) else members)
        sig = (tuple((m.key, tuple(m.shape), m.offset) for m in members), dtype, op, id(group), per_tensor)
        plan = self._plans.get(sig)
        if plan is not None:
            if fast is not None:
                self._plans[fast] = plan
            return plan
        slots, groups = [], {}  # slots: units in order of their first tensor; groups: id -> slot
        for i, m in enumerate(members):
            if passes_through(dtype, m.numel):
                continue
            call = Call(key=m.key, op=op, process_set=group, label=m.label)
            info = self._info(m.key, tuple(m.shape), dtype, call, like)
            route = self.table.of(m.key, m.label, None, info)
            if m.key in self.table.superseded:
                self.table.superseded.discard(m.key)
                self._pending.pop(m.key, None)
            self._check_call(route.scheme, m.key, call, info)
            flat = _flattens(route.scheme) and not per_tensor
            if flat and id(route.scheme) in groups:
                groups[id(route.scheme)][2].append((i, info))
                continue
            slot = [route.scheme, None, [(i, info)]]
            if flat:
                groups[id(route.scheme)] = slot
            slots.append(slot)
        units = []
        for scheme, _, grouped in slots:
            if len(grouped) == 1:
                (i, info), = grouped
                m = members[i]
                units.append(Unit(m.key, scheme, info, (i,), m.offset, m.offset + m.numel))
                continue
            idx = self._saved_order(tuple(i for i, _ in grouped), members)
            grouped = sorted(grouped, key=lambda e: idx.index(e[0]))
            keys = tuple(members[i].key for i in idx)
            gkey = group_key(keys)
            offsets, total = [], 0
            for i in idx:
                offsets.append(total)
                total += members[i].numel
            self._groups.setdefault(gkey, _Group(keys, tuple(offsets), tuple(members[i].numel for i in idx)))
            for i, info in grouped:
                self._member_infos[members[i].key] = info
            first, info0 = members[idx[0]], grouped[0][1]
            ginfo = type(info0)(gkey, (total,), dtype, info0.world_size, info0.rank, info0.op,
                                info0.group, info0.nccl_avg)
            if all(members[a].offset + members[a].numel == members[b].offset for a, b in zip(idx, idx[1:])):
                units.append(Unit(gkey, scheme, ginfo, idx, first.offset, first.offset + total))
            else:
                ops = self.ops
                index = ops.concat([ops.arange(members[i].numel, "int64", like) + members[i].offset
                                    for i in idx], 0)
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
                self._holders[members[i].key] = unit.key
                if unit.key != members[i].key:
                    self._wire.pop(members[i].key, None)
        plan = BucketPlan(members, tuple(units), dtype)
        if len(self._plans) > 128:  # layouts seen: the initial buckets, the rebuilt ones, a few more
            self._plans.clear()
        self._plans[sig] = plan
        if fast is not None:
            self._plans[fast] = plan
        return plan

    def encode_unit(self, unit: Unit, x):
        """``(payload, ctx)`` of one unit of a plan, as :meth:`encode` of one tensor: ``x`` holds
        the unit's coordinates (a group: its members' flat coordinates in buffer order, shape
        ``unit.info.shape``; a view of the engine's buffer, without autograd history). Decode
        with :meth:`decode`. Posts no collective."""
        return self._encode_info(x, unit.info, unit.scheme, detach=False)

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
        if ctx is None or not self._has_state(ctx.info.key):
            return
        info, _, scale, scheme = ctx
        ops = self.ops
        amount = ops.reshape(ops.cast(amount, "float32"), (info.numel,))
        if scale is not None:
            amount = amount * (1.0 / scale)
        moved = composite.add_residual(scheme, ops, self._read_state(info.key), info, amount)
        if moved is not None:
            self._write_state(info.key, moved)

    def _saved_order(self, idx, members):
        """The order of a group's tensors: a loaded checkpoint's group of the same tensors keeps
        its order (so its agreed fields load, and the resume is exact, even where this run's
        first buckets order them otherwise: DDP's before its rebuild), else the bucket's."""
        if self._pending_groups:
            keys = {members[i].key: i for i in idx}
            for saved in self._pending_groups.values():
                order = saved["members"]
                if len(order) == len(keys) and set(order) == set(keys):
                    return tuple(keys[k] for k in order)
        return idx

    # ---- where a tensor's error feedback lives ----
    def _state_for(self, scheme, info, like):
        key = info.key
        if key in self._leaving and self._has_state(key):
            return self._rejoin(scheme, info, like)
        if self._has_state(key):
            return self._read_state(key)
        if key in self._groups:
            return self._group_state(scheme, info, like)
        if key in self._members or self._saved_error_feedback(key):
            # a tensor sent alone now whose error feedback a group holds (or a bucketed save)
            carried = self._take_error_feedback(key, scheme, info, like, {})
            state = scheme.init(self.ops, info, like)
            if carried is not None:
                state = composite.add_residual(scheme, self.ops, state, info, carried) or state
            if len(state):
                self._create_state(key, state)
                return self._read_state(key)
            return state
        return super()._state_for(scheme, info, like)

    def _saved_error_feedback(self, key) -> bool:
        loaded = self._pending.get(key)
        return loaded is not None and tuple(loaded._fields) == (ERROR_FEEDBACK,)

    def _group_state(self, scheme, info, like):
        """A new group's first state: the fields the ranks agree on from a checkpoint of the
        same group (else fresh), and every member's pending error feedback moved in."""
        ops = self.ops
        grp = self._groups[info.key]
        state = scheme.init(ops, info, like)
        if not len(state):  # a stateless scheme (the casts): nothing to move, at its first step
            if self._members.get(grp.keys[0]) != info.key:  # only release the earlier holders
                for key in grp.keys:
                    self._take_error_feedback(key, scheme, self._member_infos.get(key), like, {})
                    self._members[key] = info.key
            return state
        olds = self._holders_of(grp.keys)
        saved = self._pending_groups.pop(info.key, None)
        exact = False
        if saved is not None and tuple(saved["members"]) == grp.keys and not olds:
            state = self._with_agreed(scheme, state, saved["fields"], like)
            if saved.get("local"):  # this rank's own fields of the same group: taken as saved
                state = self._with_agreed(scheme, state, saved["local"], like, local=True)
                exact = True  # (no tensor of it has moved on since the save: nothing holds one)
        elif olds:  # what the earlier holders agreed on that a fresh state would lose
            state = composite.carry_over(scheme, ops, state, olds, info)
        parts, found, read = [], False, {}
        for key, numel in zip(grp.keys, grp.numels):
            if exact and self._saved_error_feedback(key):
                del self._pending[key]  # already in the group's own fields
            part = self._take_error_feedback(key, scheme, self._member_infos.get(key), like, read)
            found = found or part is not None
            parts.append(ops.zeros((numel,), "float32", like) if part is None else part)
            self._members[key] = info.key
        if found:
            carried = parts[0] if len(parts) == 1 else ops.concat(parts, 0)
            state = composite.add_residual(scheme, ops, state, info, carried) or state
        if len(state):
            self._create_state(info.key, state)
            return self._read_state(info.key)
        return state

    def _rejoin(self, scheme, info, like):
        """Group ``info.key``'s state, sent again after some of its tensors left it (for another
        layout's group, or alone) while it kept state for the others: each such tensor's error
        feedback moves back in from where it is now, replacing the stale slice the group still
        holds (kept, it would be sent twice and the other holder's lost). Agreed fields stay."""
        ops, gkey = self.ops, info.key
        grp = self._groups[gkey]
        state = self._read_state(gkey)
        current = composite.residual_of(scheme, ops, state, self._infos.get(gkey, info))
        parts, read = [], {}
        for key, off, numel in zip(grp.keys, grp.offsets, grp.numels):
            carried, stale = None, None
            if self._members.get(key) != gkey:
                carried = self._take_error_feedback(key, scheme, self._member_infos.get(key), like, read)
                self._members[key] = gkey
                stale = None if current is None else current[off:off + numel]
            parts.append(ops.zeros((numel,), "float32", like) if stale is None else
                         (-stale if carried is None else carried - stale))
        self._leaving.pop(gkey, None)
        if current is not None:
            delta = parts[0] if len(parts) == 1 else ops.concat(parts, 0)
            moved = composite.add_residual(scheme, ops, state, self._infos.get(gkey, info), delta)
            if moved is not None:
                self._write_state(gkey, moved)
        return self._read_state(gkey)

    def _holders_of(self, keys) -> list:
        """``[(key, state)]`` of the groups and per-tensor states that hold the tensors ``keys``
        now (before a new group takes them over), each once."""
        out, seen = [], set()
        for key in keys:
            holder = self._members.get(key)
            holder = holder if holder is not None and self._has_state(holder) else \
                (key if self._has_state(key) else None)
            if holder is not None and holder not in seen:
                seen.add(holder)
                out.append((holder, self._read_state(holder)))
        return out

    def _with_agreed(self, scheme, state, fields: dict, like, local: bool = False):
        """``state`` with the fields every rank agrees on taken from a checkpoint's ``fields``
        (those whose shape matches; the rank-local ones stay), or with ``local``, the rank-local
        ones."""
        ops, rank_local = self.ops, set(scheme.rank_local_fields)
        values = []
        for f, v in zip(state._fields, state):
            loaded = fields.get(f)
            if (f in rank_local) == local and loaded is not None:
                loaded = self._import(loaded)
                if tuple(ops.shape(loaded)) == tuple(ops.shape(v)):
                    v = ops.cast(self._to_device(loaded, like), ops.dtype(v))
            values.append(v)
        return type(state)(*values)

    def _take_error_feedback(self, key, scheme, info, like, read: dict):
        """Tensor ``key``'s pending error feedback (float32 [numel], gradient coordinates),
        taken out of where it is now: the group that held it, its own per-tensor state, or a
        loaded checkpoint's entry; None when there is none. ``scheme``/``info``: the tensor's
        route and facts (to read an older per-tensor checkpoint entry). ``read``: {group key: its
        error feedback} of one move (a new dict per move: a group is read once per move). A group
        left with other tensors in it keeps its state and is marked in ``_leaving``."""
        ops = self.ops
        src = self._members.pop(key, None)
        if src is not None and src in self._groups:
            out = None
            if self._has_state(src):
                grp = self._groups[src]
                if src not in read:
                    read[src] = composite.residual_of(scheme, ops, self._read_state(src), self._infos[src])
                flat = read[src]
                if flat is not None:
                    j = grp.keys.index(key)
                    out = flat[grp.offsets[j]:grp.offsets[j] + grp.numels[j]]
            self._release_group(src)
            if self._has_state(src):
                self._leaving[src] = True
            return out
        if self._has_state(key) and info is not None:  # sent alone before
            state = self._read_state(key)
            self._drop_state(key)
            self._wire.pop(key, None)
            own = self._infos.get(key, info)
            return composite.residual_of(scheme, ops, state, own)
        loaded = self._pending.pop(key, None)
        if loaded is None:
            return None
        if tuple(loaded._fields) == (ERROR_FEEDBACK,):
            return ops.reshape(ops.cast(self._to_device(self._import(loaded[0]), like), "float32"), (-1,))
        if info is None:
            return None
        # an older checkpoint's per-tensor state: read its error feedback in its own layout
        state = self._initial_state(scheme, info, like, loaded)
        return composite.residual_of(scheme, ops, state, info)

    def _release_group(self, gkey):
        """Drop group ``gkey``'s state once none of its tensors' error feedback is in it any
        more (its layout record stays: a cached plan that sends it again, e.g. Horovod's
        group after a step whose fill-ins sent its tensors alone, starts it afresh, moving
        their error feedback back in)."""
        grp = self._groups.get(gkey)
        if grp is None or any(self._members.get(k) == gkey for k in grp.keys):
            return
        if self._has_state(gkey):
            self._drop_state(gkey)
        self._leaving.pop(gkey, None)
        self._infos.pop(gkey, None)
        self._wire.pop(gkey, None)

    # ---- reporting and checkpoints, per tensor ----
    def error_feedback(self, key):
        """This rank's pending error feedback of tensor ``key`` in its own coordinates (float32
        ``[numel]``, a device tensor; what later steps will still send), wherever it is kept
        (the tensor's state, or its bucket group's slice); None when its scheme keeps none or
        the tensor has not been sent yet."""
        gkey = self._members.get(key)
        if gkey is not None and self._has_state(gkey):
            grp = self._groups[gkey]
            scheme = self.table.routes[key].scheme
            flat = composite.residual_of(scheme, self.ops, self._read_state(gkey), self._infos[gkey])
            if flat is None:
                return None
            j = grp.keys.index(key)
            return flat[grp.offsets[j]:grp.offsets[j] + grp.numels[j]]
        if self._has_state(key) and key in self.table.routes:
            return composite.residual_of(self.table.routes[key].scheme, self.ops, self._read_state(key),
                                         self._infos[key])
        return None

    def _group_scheme(self, gkey):
        """The scheme of group ``gkey`` (its tensors' route)."""
        return self.table.routes[self._groups[gkey].keys[0]].scheme
