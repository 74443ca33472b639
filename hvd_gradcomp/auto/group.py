"""``auto`` per route group: a bucket's ``auto`` tensors on one flattening choice, between windows,
sent as one auto tensor of their flat vector (issue 51: auto decides per tensor, encodes per
route group, so its operations per step follow its routes, not its tensors).

Decisions stay per tensor (:mod:`hvd_gradcomp.auto.scheme`): each tensor runs its windows,
probes and sync steps alone, as before. Between windows (a *plain* step: the tensor's next
step is outside its window, its position is known, it owes no ``carry``) the codec's
:meth:`~hvd_gradcomp.codec.Codec.plan_bucket` groups the bucket's tensors that sit on the same
choice whose scheme flattens (:func:`~hvd_gradcomp.buckets.flattens`: fp16, THC, TopKC, ...)
into one unit, a bucket group (:mod:`hvd_gradcomp.buckets`) whose scheme is an
:class:`AutoGroup`: ``auto``'s own lifecycle on the group's flat vector (one count lane, one
step counter, the candidate's state over the vector: THC's blocks and TopKC's chunks span
tensors, as in any flat group). The group's key is the bucket group's key of its members and
the choice's spec, so a group of other choice is another group.

The group starts at its first member's step (the members of one bucket step together; where
they do not, they take the first's schedule) and moves the members' error feedback in (the
bucket groups' rule); its agreed fields (fp16's scale, THC's ranges, TopKC's scores) start
afresh, equally on every rank. Before a member's next window step the plan no longer groups
it (:func:`group_choice` changes, so the plan does): it is sent alone again, from the group's
step and choice (:meth:`~hvd_gradcomp.auto.scheme.AutoScheme.init`) with its slice of the
group's error feedback. Checkpoints: the bucket groups' format (each member's error feedback
under its key, the group's counters and agreed fields under the group key).
"""
from ..base import Scheme, TensorInfo, WireBytes
from ..buckets import flattens, group_key

__all__ = ["AutoGroup", "group_choice", "group_choices", "auto_group_key", "auto_group"]


def _position(auto, key):
    """``(step, choice, world size)`` of tensor ``key``'s next step on the host: its own mirror,
    or that of the :class:`AutoGroup` holding it; None before its first step."""
    gkey = auto.held_by.get(key)
    return auto._counters.get(gkey if gkey is not None else key)


def group_choice(auto, key, world_size: int, store) -> int:
    """The choice under which ``key``'s tensor may be grouped at its next step (a plain step on a
    flattening candidate, no ``carry`` owed), else -1. Host facts only (the mirrors, the stored
    state's field names); :meth:`Codec.plan_bucket <hvd_gradcomp.codec.Codec.plan_bucket>`
    re-plans a bucket when one of its tensors' value changes."""
    at = _position(auto, key)
    if at is None or at[2] != world_size or auto._phase(at[0])[0]:
        return -1
    choice = at[1]
    if not flattens(auto.candidates[choice]):
        return -1
    holder = auto.held_by.get(key, key)
    if store.has(holder) and "carry" in store.read(holder)._fields:
        return -1
    return choice


def group_choices(routed, world_size: int, store) -> tuple:
    """:func:`group_choice` of each ``(auto, key)`` of ``routed`` (None for a pair whose ``auto``
    is None: a tensor routed elsewhere), computed once per holder: the members an
    :class:`AutoGroup` holds share its position, choice and stored state, so a bucket's plan
    key costs one :func:`group_choice` per group and per tensor sent alone, not per tensor."""
    memo, out = {}, []
    for auto, key in routed:
        if auto is None:
            out.append(None)
            continue
        holder = (id(auto), auto.held_by.get(key, key))
        choice = memo.get(holder)
        if choice is None:
            choice = memo[holder] = group_choice(auto, key, world_size, store)
        out.append(choice)
    return tuple(out)


def auto_group_key(auto, keys, choice: int) -> str:
    """The group key of the tensors ``keys`` (in order) on ``choice``: the bucket group's key and
    the choice's spec."""
    return f"{group_key(keys)}:{auto.specs[choice]}"


def auto_group(auto, gkey, keys, choice) -> "AutoGroup":
    """The :class:`AutoGroup` of ``gkey`` (made once, kept in ``auto.groups``)."""
    grp = auto.groups.get(gkey)
    if grp is None or grp.keys != tuple(keys):
        grp = auto.groups[gkey] = AutoGroup(auto, gkey, keys, choice)
    return grp


class AutoGroup(Scheme):
    """``auto``'s lifecycle on a group's flat vector, pinned to one choice (module docstring).

    Args:
        auto: the :class:`~hvd_gradcomp.auto.scheme.AutoScheme` the members are routed to.
        gkey: the group's key (:func:`auto_group_key`); keys: the members' keys, in order.
        choice: the candidate index the members sit on.
    """

    name = "auto"
    adaptive = True

    def __init__(self, auto, gkey, keys, choice):
        self.auto, self.gkey, self.keys, self.choice = auto, gkey, tuple(keys), choice
        self.config = auto.config
        self.scalable = auto.scalable
        self.rank_local_fields = auto.rank_local_fields
        self.step = None  # the device step counter of the group's last state (members leaving: AutoScheme.init)

    def init(self, ops, info: TensorInfo, like):
        """The group's first state: the first member's step, the choice, the candidate's fresh
        state over the vector; the members are held by this group from now on."""
        auto = self.auto
        at = _position(auto, self.keys[0])
        step = 0 if at is None else at[0]
        for key in self.keys:
            auto.held_by[key] = self.gkey
        auto._counters[self.gkey] = (step, self.choice, info.world_size)
        state = auto._state(ops, like, step, self.choice, auto.candidates[self.choice].init(ops, info, like))
        self.step = state.step
        return state

    def compress(self, ops, x, state, info, finite):
        return self.auto.compress(ops, x, state, info, finite)

    def receive(self, ops, payload, ctx, info):
        return self.auto.receive(ops, payload, ctx, info)

    def decompress(self, ops, payload, ctx, info):
        return self.auto.decompress(ops, payload, ctx, info)

    def finish(self, ops, payload, ctx, state, info):
        new = self.auto.finish(ops, payload, ctx, state, info)
        self.step = new.step
        return new

    def residual_of(self, ops, state, info):
        return self.auto.residual_of(ops, state, info)

    def add_residual(self, ops, state, info, residual):
        return self.auto.add_residual(ops, state, info, residual)

    def payload_dtype(self, info):
        from .. import composite
        return composite.payload_dtype(self.auto.candidates[self.choice], info)

    def wire(self, info: TensorInfo) -> WireBytes:
        return self.auto.wire(info)

    def metrics(self, state) -> dict:
        return self.auto.metrics(state)

    def sent_zeros(self, ops, ctx):
        return self.auto.sent_zeros(ops, ctx)

    def spec(self) -> str:
        return self.auto.spec()
