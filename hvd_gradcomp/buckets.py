"""One codec call per bucket: the tensors of a bucket that share a route, compressed as one flat vector.

An engine that all-reduces buckets (DDP's gradient buckets; FSDP's flat shards are one tensor
already) hands the compressor a bucket as a flat buffer and the layout of its tensors
(:class:`Member`: key, name the rules match, shape, offset in the buffer).
:meth:`Codec.plan_bucket <hvd_gradcomp.codec.Codec.plan_bucket>` routes each tensor as usual (rules by name, ``min_numel``,
``accepts``), then cuts the bucket into :class:`Unit` s:

- a **flat group**: the bucket's tensors of one route whose scheme's math is over a vector
  (:attr:`~hvd_gradcomp.base.Scheme.flattens`: the casts, TopK, TopKC, THC, signSGD). They are
  compressed as one vector of their concatenated coordinates (in bucket order), under a group
  key made from their keys (equal on every rank, since every rank's buckets hold the same
  tensors): THC's blocks and TopKC's chunks span tensor boundaries. A group whose tensors are
  contiguous in the buffer is read and written as a view (no copy); otherwise through one
  gather and one scatter with a cached index;
- a **batch** of same-shape matrices (PowerSGD, :mod:`~hvd_gradcomp.powersgd_batched`): one
  batched product, orthogonalisation and payload per shape, each matrix keeping its own state;
- ``auto``'s tensors on one flattening choice between windows, as one group
  (:mod:`~hvd_gradcomp.auto.group`); in a window each is sent alone;
- a **single tensor**: a scheme that needs the tensor's shape and has no batched form, keeps
  per-tensor estimates (TopKC's EF21), or a group of one.

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

:class:`GroupBook` is a part of :class:`~hvd_gradcomp.codec.Codec` (its ``groups``): the
groups, where each tensor's error feedback lives, and the moves between them; the codec's
``plan_bucket`` cuts buckets into units and registers their groups here.
"""
import zlib
from typing import Any, NamedTuple

from . import composite
from .base import passes_through

__all__ = ["Member", "Unit", "BucketPlan", "GroupBook", "Group", "ERROR_FEEDBACK", "group_key", "flattens"]

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


class Group(NamedTuple):
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


def flattens(scheme) -> bool:
    """True if a bucket's tensors of ``scheme`` may be compressed as one flat group."""
    return scheme.flattens and not scheme.adaptive and not scheme.blocking


class GroupBook:
    """The bucket groups of one codec (module docstring) and where each tensor's error feedback
    lives.

    Fields (handed in): ``ops``; ``store`` (the codec's :class:`~hvd_gradcomp.store.Store`);
    ``tensors`` (its :class:`~hvd_gradcomp.records.TensorBook`: infos, wire bytes, loaded
    states); ``table`` (its :class:`~hvd_gradcomp.routing.RouteTable`: each tensor's scheme).
    Owned: ``groups`` {group key: :class:`Group`} of every group planned; ``members`` {tensor
    key: group key} of the group whose state holds the tensor's error feedback now;
    ``holders`` {tensor key: the unit key whose payload carries it now} (reports count the bytes
    of these only: a group of an earlier layout no longer sends); ``pending`` {group key: saved
    fields} from a checkpoint; ``member_infos`` {tensor key: its own TensorInfo}; ``leaving``
    {group key: True} of the groups that some of their tensors left while they kept state for
    the others (their state still holds stale error feedback of the tensors that left: when
    such a group is sent again, :meth:`_rejoin` moves those tensors' error feedback back in, in
    place of the stale slices).
    """

    __slots__ = ("ops", "store", "tensors", "table", "groups", "members", "holders", "pending",
                 "member_infos", "leaving")

    def __init__(self, ops, store, tensors, table):
        self.ops, self.store, self.tensors, self.table = ops, store, tensors, table
        self.groups, self.members, self.holders = {}, {}, {}
        self.pending, self.member_infos, self.leaving = {}, {}, {}

    def add(self, gkey, keys, numels, infos):
        """Record group ``gkey`` of the tensors ``keys`` (in its vector's order) of ``numels``
        coordinates, and each member's own ``infos`` ({key: TensorInfo})."""
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        self.groups.setdefault(gkey, Group(tuple(keys), tuple(offsets), tuple(numels)))
        self.member_infos.update(infos)

    def scheme_of(self, gkey):
        """The scheme of group ``gkey`` (its tensors' route)."""
        return self.table.routes[self.groups[gkey].keys[0]].scheme

    def saved_order(self, idx, members):
        """The order of a group's tensors: a loaded checkpoint's group of the same tensors keeps
        its order (so its agreed fields load, and the resume is exact, even where this run's
        first buckets order them otherwise: DDP's before its rebuild), else the bucket's."""
        if self.pending:
            keys = {members[i].key: i for i in idx}
            for saved in self.pending.values():
                order = saved["members"]
                if len(order) == len(keys) and set(order) == set(keys):
                    return tuple(keys[k] for k in order)
        return idx

    # ---- where a tensor's error feedback lives ----
    def state_for(self, scheme, info, like):
        """The state ``info.key`` (a tensor or group) is compressed with now: a group's, moving
        its members' error feedback in at its first step (or back, :meth:`_rejoin`); a tensor
        sent alone whose error feedback a group held; else the tensor book's."""
        key = info.key
        if key in self.leaving and self.store.has(key):
            return self._rejoin(scheme, info, like)
        if self.store.has(key):
            return self.store.read(key)
        if key in self.groups:
            return self._group_state(scheme, info, like)
        if key in self.members or self._saved_error_feedback(key):
            # a tensor sent alone now whose error feedback a group holds (or a bucketed save)
            carried = self.take_error_feedback(key, scheme, info, like, {})
            state = scheme.init(self.ops, info, like)
            if carried is not None:
                state = composite.add_residual(scheme, self.ops, state, info, carried) or state
            if len(state):
                self.store.create(key, state)
                return self.store.read(key)
            return state
        return self.tensors.state_for(scheme, info, like)

    def _saved_error_feedback(self, key) -> bool:
        loaded = self.tensors.pending.get(key)
        return loaded is not None and tuple(loaded._fields) == (ERROR_FEEDBACK,)

    def _group_state(self, scheme, info, like):
        """A new group's first state: the fields the ranks agree on from a checkpoint of the
        same group (else fresh), and every member's pending error feedback moved in."""
        ops = self.ops
        grp = self.groups[info.key]
        state = scheme.init(ops, info, like)
        if not len(state):  # a stateless scheme (the casts): nothing to move, at its first step
            if self.members.get(grp.keys[0]) != info.key:  # only release the earlier holders
                for key in grp.keys:
                    self.take_error_feedback(key, scheme, self.member_infos.get(key), like, {})
                    self.members[key] = info.key
            return state
        olds = self._holders_of(grp.keys)
        saved = self.pending.pop(info.key, None)
        exact = False
        if saved is not None and tuple(saved["members"]) == grp.keys and not olds:
            state = self.with_agreed(scheme, state, saved["fields"], like)
            if saved.get("local"):  # this rank's own fields of the same group: taken as saved
                state = self.with_agreed(scheme, state, saved["local"], like, local=True)
                exact = True  # (no tensor of it has moved on since the save: nothing holds one)
        elif olds:  # what the earlier holders agreed on that a fresh state would lose
            state = composite.carry_over(scheme, ops, state, olds, info)
        parts, found, read = [], False, {}
        for key, numel in zip(grp.keys, grp.numels):
            if exact and self._saved_error_feedback(key):
                del self.tensors.pending[key]  # already in the group's own fields
            part = self.take_error_feedback(key, scheme, self.member_infos.get(key), like, read)
            found = found or part is not None
            parts.append(ops.zeros((numel,), "float32", like) if part is None else part)
            self.members[key] = info.key
        if found:
            carried = parts[0] if len(parts) == 1 else ops.concat(parts, 0)
            state = composite.add_residual(scheme, ops, state, info, carried) or state
        if len(state):
            self.store.create(info.key, state)
            return self.store.read(info.key)
        return state

    def _rejoin(self, scheme, info, like):
        """Group ``info.key``'s state, sent again after some of its tensors left it (for another
        layout's group, or alone) while it kept state for the others: each such tensor's error
        feedback moves back in from where it is now, replacing the stale slice the group still
        holds (kept, it would be sent twice and the other holder's lost). Agreed fields stay."""
        ops, gkey = self.ops, info.key
        grp = self.groups[gkey]
        state = self.store.read(gkey)
        current = composite.residual_of(scheme, ops, state, self.tensors.infos.get(gkey, info))
        parts, read = [], {}
        for key, off, numel in zip(grp.keys, grp.offsets, grp.numels):
            carried, stale = None, None
            if self.members.get(key) != gkey:
                carried = self.take_error_feedback(key, scheme, self.member_infos.get(key), like, read)
                self.members[key] = gkey
                stale = None if current is None else current[off:off + numel]
            parts.append(ops.zeros((numel,), "float32", like) if stale is None else
                         (-stale if carried is None else carried - stale))
        self.leaving.pop(gkey, None)
        if current is not None:
            delta = parts[0] if len(parts) == 1 else ops.concat(parts, 0)
            moved = composite.add_residual(scheme, ops, state, self.tensors.infos.get(gkey, info), delta)
            if moved is not None:
                self.store.write(gkey, moved)
        return self.store.read(gkey)

    def _holders_of(self, keys) -> list:
        """``[(key, state)]`` of the groups and per-tensor states that hold the tensors ``keys``
        now (before a new group takes them over), each once."""
        out, seen = [], set()
        for key in keys:
            holder = self.members.get(key)
            holder = holder if holder is not None and self.store.has(holder) else \
                (key if self.store.has(key) else None)
            if holder is not None and holder not in seen:
                seen.add(holder)
                out.append((holder, self.store.read(holder)))
        return out

    def with_agreed(self, scheme, state, fields: dict, like, local: bool = False):
        """``state`` with the fields every rank agrees on taken from a checkpoint's ``fields``
        (those whose shape matches; the rank-local ones stay), or with ``local``, the rank-local
        ones."""
        ops, rank_local = self.ops, set(scheme.rank_local_fields)
        values = []
        for f, v in zip(state._fields, state):
            loaded = fields.get(f)
            if (f in rank_local) == local and loaded is not None:
                loaded = self.store.load(loaded)
                if tuple(ops.shape(loaded)) == tuple(ops.shape(v)):
                    v = ops.cast(self.store.to_device(loaded, like), ops.dtype(v))
            values.append(v)
        return type(state)(*values)

    def take_error_feedback(self, key, scheme, info, like, read: dict):
        """Tensor ``key``'s pending error feedback (float32 [numel], gradient coordinates),
        taken out of where it is now: the group that held it, its own per-tensor state, or a
        loaded checkpoint's entry; None when there is none. ``scheme``/``info``: the tensor's
        route and facts (to read an older per-tensor checkpoint entry). ``read``: {group key: its
        error feedback} of one move (a new dict per move: a group is read once per move). A group
        left with other tensors in it keeps its state and is marked in ``_leaving``."""
        ops = self.ops
        src = self.members.pop(key, None)
        if src is not None and src in self.groups:
            out = None
            if self.store.has(src):
                grp = self.groups[src]
                if src not in read:
                    read[src] = composite.residual_of(scheme, ops, self.store.read(src), self.tensors.infos[src])
                flat = read[src]
                if flat is not None:
                    j = grp.keys.index(key)
                    out = flat[grp.offsets[j]:grp.offsets[j] + grp.numels[j]]
            self._release_group(src)
            if self.store.has(src):
                self.leaving[src] = True
            return out
        if self.store.has(key) and info is not None:  # sent alone before
            state = self.store.read(key)
            self.store.drop(key)
            self.tensors.wire.pop(key, None)
            own = self.tensors.infos.get(key, info)
            return composite.residual_of(scheme, ops, state, own)
        loaded = self.tensors.pending.pop(key, None)
        if loaded is None:
            return None
        if tuple(loaded._fields) == (ERROR_FEEDBACK,):
            return ops.reshape(ops.cast(self.store.to_device(self.store.load(loaded[0]), like), "float32"), (-1,))
        if info is None:
            return None
        # an older checkpoint's per-tensor state: read its error feedback in its own layout
        state = self.tensors.initial_state(scheme, info, like, loaded)
        return composite.residual_of(scheme, ops, state, info)

    def _release_group(self, gkey):
        """Drop group ``gkey``'s state once none of its tensors' error feedback is in it any
        more (its layout record stays: a cached plan that sends it again, e.g. Horovod's
        group after a step whose fill-ins sent its tensors alone, starts it afresh, moving
        their error feedback back in)."""
        grp = self.groups.get(gkey)
        if grp is None or any(self.members.get(k) == gkey for k in grp.keys):
            return
        if self.store.has(gkey):
            self.store.drop(gkey)
        self.leaving.pop(gkey, None)
        self.tensors.infos.pop(gkey, None)
        self.tensors.wire.pop(gkey, None)

    # ---- reporting and checkpoints, per tensor ----
    def error_feedback(self, key):
        """This rank's pending error feedback of tensor ``key`` in its own coordinates (float32
        ``[numel]``, a device tensor; what later steps will still send), wherever it is kept
        (the tensor's state, or its bucket group's slice); None when its scheme keeps none or
        the tensor has not been sent yet."""
        gkey = self.members.get(key)
        if gkey is not None and self.store.has(gkey):
            grp = self.groups[gkey]
            scheme = self.table.routes[key].scheme
            flat = composite.residual_of(scheme, self.ops, self.store.read(gkey), self.tensors.infos[gkey])
            if flat is None:
                return None
            j = grp.keys.index(key)
            return flat[grp.offsets[j]:grp.offsets[j] + grp.numels[j]]
        if self.store.has(key) and key in self.table.routes:
            return composite.residual_of(self.table.routes[key].scheme, self.ops, self.store.read(key),
                                         self.tensors.infos[key])
        return None
