"""Checkpoints of a compressor's per-tensor state: per rank, or gathered for a rank-0 save.

:func:`state_dict` and :func:`load_state_dict` are functions over a
:class:`~hvd_gradcomp.codec.Codec` (the compressor's methods of the same names call them): they
read its tensor book, group book and store, and gather through its engine (``codec.gather``);
the same for Horovod, DDP and FSDP.
"""
import logging

from . import composite, group_checkpoint
from .buckets import ERROR_FEEDBACK
from .records import FieldBag
from .routing import Routing

__all__ = ["state_dict", "load_state_dict"]

log = logging.getLogger("hvd_gradcomp")


def _what(value) -> str:
    """A value in a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _check_part(part, where: str):
    """Refuse a per-rank state that is not shaped as :func:`state_dict` writes it
    (before anything is loaded). Raises ValueError naming ``where`` and the entry."""
    if not isinstance(part, dict):
        raise ValueError(f"load_state_dict: {where} must be a dict (one rank's state), got {_what(part)}")
    if "tensors" not in part:
        raise ValueError(f"load_state_dict: {where} has no 'tensors' (the per-tensor state; keys "
                         f"{sorted(map(str, part))}): is it truncated, or not a compressor's state_dict()?")
    tensors = part["tensors"]
    if not isinstance(tensors, dict):
        raise ValueError(f"load_state_dict: {where}['tensors'] must be a dict of tensor -> fields, "
                         f"got {_what(tensors)}")
    for key, fields in tensors.items():
        if not isinstance(fields, dict) or not fields:
            raise ValueError(f"load_state_dict: {where}['tensors'][{key!r}] must be a non-empty dict of "
                             f"field -> tensor, got {_what(fields)}")
        for field, value in fields.items():
            if not isinstance(field, str) or value is None or isinstance(value, (str, bytes, dict)):
                raise ValueError(f"load_state_dict: {where}['tensors'][{key!r}][{field!r}] must be a "
                                 f"tensor, got {_what(value)}")
    routes = part.get("routes", {})
    if not isinstance(routes, dict) or not all(isinstance(t, str) for t in routes.values()):
        raise ValueError(f"load_state_dict: {where}['routes'] must be a dict of tensor -> scheme spec "
                         f"text, got {_what(routes)}")
    for name in ("rank", "world_size"):
        value = part.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"load_state_dict: {where}[{name!r}] must be an integer or None, got {_what(value)}")


def state_dict(codec, gather: bool = False) -> dict:
    """The compressor's state for a checkpoint.

    Args:
        gather: False (default): this rank's state, to be saved per rank and loaded on
            the same rank. True: every rank's, collected by ``codec.gather`` (one
            Horovod broadcast per rank: every rank must call it; each receives every
            rank's state, so memory is world size x residuals), for the usual "save on
            rank 0, load everywhere" habit.

    Returns:
        Per rank: ``{"spec", "tensors": {key: {field: tensor}}, "routes": {key: scheme
        spec}, "rank", "world_size"}`` (host copies). Gathered: ``{"spec", "world_size",
        "ranks": [per-rank dict of rank 0, 1, ...]}`` with values that pickle anywhere
        (PyTorch CPU tensors, NumPy arrays for TensorFlow).
    """
    local = _local_state(codec, portable=gather)
    if not gather:
        return local
    parts = codec.gather(local, "hvd_gradcomp.state_dict")
    return {"spec": codec.spec, "world_size": len(parts), "ranks": list(parts)}


def _local_state(codec, portable: bool) -> dict:
    tensors, buckets = group_checkpoint.group_entries(codec, portable)
    for key in codec.tensors.infos:
        if codec.store.has(key) and key not in codec.groups.groups:
            state = codec.store.read(key)
            tensors[key] = {f: codec.store.export(v, portable) for f, v in zip(state._fields, state)}
    for key, state in codec.tensors.pending.items():
        tensors.setdefault(key, {f: v for f, v in zip(state._fields, state)})
    routes = codec.table.texts()
    size, rank = codec.job_world()
    out = {"spec": codec.spec, "tensors": tensors, "routes": routes, "rank": rank, "world_size": size}
    if buckets:
        out["buckets"] = buckets
    return out


def _same_config(codec, spec) -> bool:
    """True if the text ``spec`` describes this compressor's routing, schemes and configs."""
    try:
        return Routing.from_spec(spec).spec() == codec.spec
    except (ValueError, TypeError, AttributeError):
        return False


def load_state_dict(codec, state_dict: dict, rank=None):
    """Restore what :meth:`state_dict` returned.

    Args:
        state_dict: per rank, or gathered (``state_dict(gather=True)``, e.g. saved by
            rank 0 and loaded on every rank).
        rank: which saved rank's state to load; default this process's rank
            (``codec.job_world()``: the bound DDP group's, Horovod's, else, before
            ``register_comm_hook`` in a job without Horovod, ``torch.distributed``'s).
            Gathered: that rank's part. Per rank: the dict must be that rank's (a
            per-rank dict of rank 0 loaded on rank 1 would resume rank 1 with rank 0's
            error feedback: refused unless ``rank=0`` is given on purpose).

    A gathered state saved by another number of ranks (elastic) gives every rank rank 0's
    part, with the rank-local fields (:attr:`Scheme.rank_local_fields`: the residuals)
    reset to zero: what the ranks agreed on (THC's ranges, TopKC's scores, PowerSGD's
    bases, step counters) is kept, equal on every rank; the error feedback pending at the
    save is dropped (a warning says so).

    Raises:
        ValueError: the spec differs from this compressor's, the dict is another rank's,
            a tensor's route differs from this compressor's decision, or its state has
            the wrong fields or shapes (checked now for tensors already seen, else at
            their first compress, before any collective); a truncated or damaged dict
            (not a dict, no ``"tensors"`` or one that is not a dict of dicts of tensors,
            ``"ranks"`` empty or not a list, a field holding a string or None, routes
            that are not texts), saying which entry is wrong, before anything is loaded.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"load_state_dict: expected the dict state_dict() returned, got "
                         f"{type(state_dict).__name__}")
    if "spec" not in state_dict:
        raise ValueError(f"load_state_dict: state_dict has no 'spec' (keys {sorted(map(str, state_dict))}); "
                         f"is it truncated, or not a compressor's state_dict()?")
    if not _same_config(codec, state_dict.get("spec")):
        raise ValueError(f"state_dict was saved by compressor {state_dict.get('spec')!r}, "
                         f"this one is {codec.spec!r}")
    # An engine that knows every key its layout makes (torch_backend.fsdp's) screens the
    # state first: keys it never makes are refused, or with rank= given dropped with a warning.
    screen = getattr(codec.engine, "screen_state", None)
    if screen is not None:
        state_dict = screen(state_dict, rank)
    size, me = codec.job_world()
    if rank is None:
        rank = me
    if "ranks" in state_dict:
        parts = state_dict["ranks"]
        if not isinstance(parts, (list, tuple)) or not parts:
            raise ValueError(f"load_state_dict: a gathered state_dict's 'ranks' must be a non-empty "
                             f"list of per-rank states, got {_what(parts)}")
        for i, part in enumerate(parts):
            _check_part(part, f"'ranks'[{i}]")
        if size is not None and len(parts) != size:
            log.warning("hvd_gradcomp: state of %d ranks loaded on %d: every rank takes rank 0's, "
                        "with its residuals reset to zero (agreed statistics kept)", len(parts), size)
            _load_part(codec, parts[0], reset=True)
            return
        if rank is None or not 0 <= rank < len(parts):
            raise ValueError(f"load_state_dict: rank must be in [0, {len(parts)}) for a state "
                             f"gathered from {len(parts)} ranks, got {rank!r} (is hvd.init() or "
                             f"torch.distributed.init_process_group() done? else pass rank=)")
        _load_part(codec, parts[rank], reset=False)
        return
    _check_part(state_dict, "state_dict")
    saved = state_dict.get("rank")
    if saved is not None and rank is not None and saved != rank:
        raise ValueError(f"load_state_dict: this state_dict holds rank {saved}'s state (its "
                         f"error feedback), and this is rank {rank}; save with "
                         f"state_dict(gather=True) to load one file on every rank, or pass "
                         f"rank={saved} to load it here anyway")
    _load_part(codec, state_dict, reset=False)


def _import_field(codec, key, field, value):
    """A saved field as the backend's tensor; ValueError naming it if it is none."""
    try:
        return codec.store.load(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"load_state_dict: tensor {key!r} field {field!r} holds {_what(value)}, "
                         f"not a tensor ({err})") from None


def _load_part(codec, part: dict, reset: bool):
    """Load one rank's state (``reset``: zero the rank-local fields)."""
    tensors = {key: {f: _import_field(codec, key, f, v) for f, v in fields.items()}
               for key, fields in part["tensors"].items()}  # all, before anything is loaded
    codec.table.load(part.get("routes", {}))
    local = {ERROR_FEEDBACK}
    for scheme in codec.routing.schemes():
        local.update(scheme.rank_local_fields)
    for gkey, saved in part.get("buckets", {}).items():
        group_checkpoint.load_group(codec, gkey, saved, reset)
    for key, fields in tensors.items():
        if reset:
            fields = {f: codec.store.zeros_like(v) if f in local else v for f, v in fields.items()}
        route = codec.table.routes.get(key)
        if set(fields) == {ERROR_FEEDBACK}:  # a bucketed run's: into whatever holds it now
            group_checkpoint.load_error_feedback(codec, key, fields[ERROR_FEEDBACK])
            continue
        held = codec.groups.members.get(key)
        if route is not None and held is not None and codec.store.has(held):
            # a per-tensor entry for a tensor a bucket group holds now: its error feedback
            info = codec.groups.member_infos[key]
            state = codec.tensors.initial_state(route.scheme, info, codec.store.read(held)[0], FieldBag(fields))
            flat = composite.residual_of(route.scheme, codec.ops, state, info)
            if flat is not None:
                group_checkpoint.load_error_feedback(codec, key, flat)
            continue
        if route is not None and codec.store.has(key):
            scheme = route.scheme
            composite.check_loaded(scheme, key, FieldBag(fields))
            current = codec.store.read(key)
            if scheme.adaptive:  # the loaded state's fields follow its own choice
                current = composite.init_like(scheme, codec.ops, codec.tensors.infos[key], current[0], FieldBag(fields))
            composite.forget(scheme, key)  # the loaded state replaces what the scheme mirrors of it
            loaded = type(current)(**{f: fields.get(f) for f in current._fields}) \
                if set(fields) == set(current._fields) else None
            if loaded is None:
                raise ValueError(f"{scheme.name}: loaded state for tensor {key!r} has fields "
                                 f"{sorted(fields)}, expected {list(current._fields)}")
            codec.tensors.check_loaded(scheme, key, loaded, current)
            codec.store.write(key, type(current)(*[
                codec.ops.cast(codec.store.to_device(v, c), codec.ops.dtype(c)) for v, c in zip(loaded, current)]))
        else:
            codec.tensors.pending[key] = FieldBag(fields)
