"""The bucket groups' part of a checkpoint (:mod:`hvd_gradcomp.checkpoint`), as functions over
a :class:`~hvd_gradcomp.codec.Codec`: each tensor's error feedback sliced out of its group's
flat state, the fields the ranks agree on per group, and loading both back into whatever holds them now (or keeping them
until the tensor or group is next sent). The groups themselves: :mod:`hvd_gradcomp.buckets`.
"""
from . import composite
from .buckets import ERROR_FEEDBACK
from .records import FieldBag

__all__ = ["group_entries", "load_error_feedback", "load_group"]


def group_entries(codec, portable: bool):
    """``(tensors, buckets)`` of the groups for a checkpoint: per tensor ``{ERROR_FEEDBACK:
    its slice}`` (when the scheme keeps error feedback), per group ``{"members": keys,
    "fields": {agreed field: value}}``."""
    tensors, buckets = {}, {}
    for gkey, grp in codec.groups.groups.items():
        if not codec.store.has(gkey):
            continue
        scheme = codec.groups.scheme_of(gkey)
        state = codec.store.read(gkey)
        flat = composite.residual_of(scheme, codec.ops, state, codec.tensors.infos[gkey])
        for key, off, n in zip(grp.keys, grp.offsets, grp.numels):
            if codec.groups.members.get(key) == gkey and flat is not None:
                tensors[key] = {ERROR_FEEDBACK: codec.store.export(flat[off:off + n], portable)}
        local = set(scheme.rank_local_fields)
        # "local": this rank's own fields as they are (THC's rotated residual with its
        # padding), so the same group resumes bit for bit; other layouts take the slices.
        # Not of a group some tensors left (its own fields hold their stale slices).
        buckets[gkey] = {"members": list(grp.keys),
                         "fields": {f: codec.store.export(v, portable) for f, v in zip(state._fields, state)
                                    if f not in local}}
        if gkey not in codec.groups.leaving:
            buckets[gkey]["local"] = {f: codec.store.export(v, portable) for f, v in zip(state._fields, state)
                                      if f in local}
    for gkey, saved in codec.groups.pending.items():
        buckets.setdefault(gkey, saved)
    return tensors, buckets


def load_error_feedback(codec, key, value):
    """A checkpoint's error feedback for tensor ``key`` (gradient coordinates): into the
    state that holds it now, or kept until the tensor is next sent."""
    ops = codec.ops
    gkey = codec.groups.members.get(key)
    holder = gkey if gkey is not None and codec.store.has(gkey) else (key if codec.store.has(key) else None)
    if holder is None or key not in codec.table.routes:
        codec.tensors.pending[key] = FieldBag({ERROR_FEEDBACK: value})
        return
    scheme = codec.table.routes[key].scheme
    state, info = codec.store.read(holder), codec.tensors.infos[holder]
    current = composite.residual_of(scheme, ops, state, info)
    if current is None:
        return
    value = ops.reshape(ops.cast(codec.store.to_device(value, current), "float32"), (-1,))
    if holder == key:
        delta = value - current
    else:
        grp = codec.groups.groups[gkey]
        j = grp.keys.index(key)
        off, n = grp.offsets[j], grp.numels[j]
        if tuple(ops.shape(value)) != (n,):
            raise ValueError(f"loaded error feedback for tensor {key!r} has {ops.shape(value)} values, "
                             f"expected {n}")
        pad_lo = ops.zeros((off,), "float32", current)
        pad_hi = ops.zeros((info.numel - off - n,), "float32", current)
        delta = ops.concat([pad_lo, value - current[off:off + n], pad_hi], 0)
    if tuple(ops.shape(delta)) != (info.numel,):
        raise ValueError(f"loaded error feedback for tensor {key!r} has {ops.shape(value)} values, "
                         f"expected {info.numel}")
    moved = composite.add_residual(scheme, ops, state, info, delta)
    if moved is not None:
        codec.store.write(holder, moved)

def load_group(codec, gkey, saved: dict, reset: bool = False):
    """A checkpoint's fields of group ``gkey``: into the group now, or kept until it is first
    sent (loaded only into a group of the same tensors; ``reset``: without this rank's own
    fields, as on another number of ranks)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("members"), (list, tuple)) or \
            not isinstance(saved.get("fields"), dict):
        raise ValueError(f"load_state_dict: bucket entry {gkey!r} must be a dict with 'members' "
                         f"(a list of tensor keys) and 'fields' (a dict), got {saved!r:.120}")
    own = {} if reset or not isinstance(saved.get("local"), dict) else dict(saved["local"])
    grp = codec.groups.groups.get(gkey)
    if grp is not None and codec.store.has(gkey):
        if tuple(saved["members"]) == grp.keys:
            state, scheme = codec.store.read(gkey), codec.groups.scheme_of(gkey)
            composite.forget(scheme, gkey)  # what the scheme mirrors on the host (warm-up counts)
            state = codec.groups.with_agreed(scheme, state, saved["fields"], state[0])
            codec.store.write(gkey, codec.groups.with_agreed(scheme, state, own, state[0], local=True))
        return
    codec.groups.pending[gkey] = {"members": list(saved["members"]), "fields": dict(saved["fields"]),
                                  "local": own}
