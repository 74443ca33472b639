"""What the FSDP2 paths share (:mod:`torch_backend.fsdp`, its all-reduce across replicas, and
:mod:`torch_backend.fsdp_scatter`, its reduce-scatter): the shards' keys, FSDP's private
parameter groups, the members of a shard (per parameter or per module), and which parameters
a call's flat shard holds (:class:`Presence`, :class:`CallLayout`).

**Parameters without a gradient.** FSDP2 reduces only the parameters of a group that have a
gradient in that backward (``FSDPParamGroup.post_backward`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, PyTorch 2.13: its
``fsdp_params_with_grad``; all those with ``requires_grad`` under
``set_reduce_scatter_unused_params(True)``): a frozen parameter (``requires_grad=False``: partial
fine-tuning, LoRA's base weights) is never in the flat shard, an unused one (layer drop, MoE)
not in the calls whose forward skipped it. :class:`Presence` wraps the group's
``post_backward`` to record, with FSDP's own rule and before FSDP clears them, which
parameters it is about to reduce (W) and which are trainable (T: ``requires_grad``, or W).
The compressor's layout follows T (frozen parameters are not sent at all; the plan stays the
same while ``requires_grad`` does, so the codec groups of :mod:`hvd_gradcomp.buckets` keep
their members); a call whose W is smaller than T (a trainable parameter unused in this
backward) is laid out in T with zeros where W has nothing, as DDP's bucket holds zeros for an
unused parameter: its error feedback is sent with the others, and what comes back for it,
which FSDP does not write anywhere, is kept in its error feedback again
(:meth:`Compressor.add_error_feedback`), so error feedback's balance holds
(:class:`CallLayout`).
"""
import math
import re
import warnings
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from hvd_gradcomp.buckets import Member

from .compression import check_compressor

__all__ = ["shard_key"]


def shard_key(path: str, shard_rank: int, shard_size: int) -> str:
    """The compressor's key of a shard: ``"<path>[shard <rank>/<size>]"``, ``path`` a parameter's
    name (``per="param"``) or an FSDP module's path (``per="group"``; the root: ``<root>``)."""
    return f"{path or '<root>'}[shard {shard_rank}/{shard_size}]"


def _fsdp_api():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    except ImportError as e:  # pragma: no cover - PyTorch < 2.6
        raise RuntimeError(f"torch_backend.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, "
                           f"PyTorch >= 2.6; tested with 2.13); this PyTorch is {torch.__version__}: {e}")
    return FSDPModule, FSDPMeshInfo, HSDPMeshInfo


def _checked_names(caller, model, compressor, per) -> dict:
    """``{parameter: name}`` of ``model`` after the checks both installers make first.

    Raises:
        ValueError: ``per`` is neither ``"param"`` nor ``"group"``.
        TypeError: ``model`` is not an FSDP module, ``compressor`` not a PyTorch compressor.
    """
    if per not in ("param", "group"):
        raise ValueError(f"{caller}: per must be 'param' or 'group', got {per!r}")
    if not isinstance(model, _fsdp_api()[0]):
        raise TypeError(f"{caller}: expected a module sharded by fully_shard (an FSDPModule), got "
                        f"{type(model).__name__}; call fully_shard(model, mesh=...) first")
    check_compressor(compressor, caller, "FSDP")
    return {p: n for n, p in model.named_parameters()}


def _param_groups(module, where, caller="install"):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None or any(not hasattr(g, "mesh_info") or not hasattr(g, "_all_reduce_hook") for g in groups):
        raise RuntimeError(f"{caller}: FSDP module {where!r}: this PyTorch ({torch.__version__}) has no "
                           f"FSDPParamGroup.mesh_info/_all_reduce_hook (written against 2.13)")
    return groups


def _same_ranks(a, b) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


class _Shard(NamedTuple):
    """One FSDP module's parameter group as :func:`install` finds it."""
    path: str
    module: object
    fsdp_group: object  # FSDPParamGroup
    rank: int  # shard rank
    size: int  # shard group's size
    names: list  # its parameters' names, in the group's (and the flat shard's) order
    replicas: object  # the replicas' process group


def _shard(caller, path, module, group, names, replicas) -> _Shard:
    """The :class:`_Shard` of FSDP parameter group ``group`` of ``module`` (at ``path``), its
    parameters named from ``names`` (``{parameter: name}`` of the root's ``named_parameters``).

    Raises:
        ValueError: a parameter of the group that ``names`` does not hold (``caller`` names the
            function in the message).
    """
    members = [names.get(fp.sharded_param) for fp in group.fsdp_params]
    if None in members:
        raise ValueError(f"{caller}: FSDP module {path or '<root>'!r} holds a parameter that "
                         f"model.named_parameters() does not name; install on the root module")
    info = group.mesh_info
    return _Shard(path, module, group, info.shard_mesh_rank, info.shard_mesh_size, members, replicas)


def _members(shard: _Shard, per: str, which=None) -> list:
    """The flat shard's layout (``foreach_reduce``: each parameter's padded dim-0 shard, in the
    group's order) as the tensors the compressor keys (:class:`~hvd_gradcomp.buckets.Member`):
    per parameter, or the whole group as one (a group of one parameter: in its shape).

    ``which``: the indices (in ``fsdp_params``' order) of the parameters the flat holds; None:
    all. ``per="group"`` over a part of the group is another tensor than the whole group's, so
    its key says which part (``"<path>|<k>/<n>|<crc32 of the names>[shard i/S]"``)."""
    params = shard.fsdp_group.fsdp_params
    which = tuple(range(len(params))) if which is None else tuple(which)
    shapes = [tuple(params[i].padded_sharded_param_size) for i in which]
    names = [shard.names[i] for i in which]
    if per == "group":
        label = names[0] if len(which) == 1 else (shard.path or "<root>")
        shape = shapes[0] if len(which) == 1 else (sum(math.prod(s) for s in shapes),)
        path = shard.path or "<root>"
        if len(which) != len(params):
            path = f"{path}|{len(which)}/{len(params)}|{zlib.crc32(chr(0).join(names).encode()) & 0xFFFFFFFF:08x}"
        return [Member(shard_key(path, shard.rank, shard.size), label, shape, 0, math.prod(shape))]
    out, offset = [], 0
    for name, shape in zip(names, shapes):
        out.append(Member(shard_key(name, shard.rank, shard.size), name, shape, offset, math.prod(shape)))
        offset += math.prod(shape)
    return out


class Presence:
    """Which parameters of one FSDP parameter group the running ``post_backward`` reduces
    (module docstring, "Parameters without a gradient"): ``present`` (W) and ``trainable`` (T),
    tuples of indices into ``fsdp_params``, recorded by a wrapper of the group's
    ``post_backward`` (one per group, shared by :func:`~torch_backend.fsdp.install` and
    :func:`~torch_backend.fsdp_scatter.install_reduce_scatter`; get it with :meth:`of`)."""

    _ATTR = "_hvd_gradcomp_presence"

    def __init__(self, fsdp_group):
        self.group = fsdp_group
        everything = tuple(range(len(fsdp_group.fsdp_params)))
        self.present, self.trainable = everything, everything
        original = fsdp_group.post_backward

        def post_backward(*args, **kwargs):
            self.record()
            return original(*args, **kwargs)
        fsdp_group.post_backward = post_backward

    @classmethod
    def of(cls, fsdp_group) -> "Presence":
        """The group's :class:`Presence`, made (and ``post_backward`` wrapped) at the first call."""
        found = getattr(fsdp_group, cls._ATTR, None)
        if found is None:
            found = cls(fsdp_group)
            setattr(fsdp_group, cls._ATTR, found)
        return found

    def record(self):
        """W and T as FSDP is about to see them: a parameter is reduced when it is unsharded and
        has an accumulated gradient of an earlier backward or a gradient of this one (or, with
        ``reduce_scatter_unused_params``, requires one): FSDP 2.13's own rule."""
        g, present = self.group, []
        unused_too = bool(getattr(g, "reduce_scatter_unused_params", False))
        for i, fp in enumerate(g.fsdp_params):
            if not hasattr(fp, "_unsharded_param"):
                continue
            param = fp.unsharded_param
            if fp.unsharded_accumulated_grad is not None or param.grad is not None or \
                    (unused_too and param.requires_grad):
                present.append(i)
        self.present = tuple(present)
        self.trainable = tuple(i for i, fp in enumerate(g.fsdp_params)
                               if fp.sharded_param.requires_grad or i in present)


class CallLayout:
    """One call's flat shard (W, the parameters FSDP reduces) against the compressor's layout
    (T, the trainable ones): module docstring, "Parameters without a gradient". Made by
    :meth:`Layouts.now`; the same object for the same (W, T).

    Attributes:
        present, trainable: W and T (indices into ``fsdp_params``).
        members: ``members[j]``, the compressor's members of shard rank ``j``'s chunk in T's
            layout (``j`` the shard rank for :func:`~torch_backend.fsdp.install`; every rank of
            the shard group for the reduce-scatter).
        same: True when W is T (the flat is in T's layout already: no copy).
        numel: the flat chunk's length in W's layout; ``full``: in T's.
        params: the FSDP parameters of W, in the flat's order.
    """

    def __init__(self, shard, per, present, trainable, ranks):
        params = shard.fsdp_group.fsdp_params
        self.present, self.trainable = present, trainable
        self.same = present == trainable
        self.params = [params[i] for i in present]
        sizes = [math.prod(fp.padded_sharded_param_size) for fp in params]
        self.numel = sum(sizes[i] for i in present)
        self.full = sum(sizes[i] for i in trainable)
        self.members = [_members(shard._replace(rank=j), per, trainable) for j in ranks]
        # where each part of W lies in T's layout: (offset in W's flat, offset in T's, numel)
        self.moves, src, dst, absent = [], 0, 0, []
        for i in trainable:
            if i in present:
                self.moves.append((src, dst, sizes[i]))
                src += sizes[i]
            else:
                absent.append((dst, sizes[i]))
            dst += sizes[i]
        self.absent = tuple(absent)  # (offset in T's layout, numel) of T's parameters not in W

    def expand(self, flat):
        """``flat`` (W's layout, ``[numel]``) in T's: itself when W is T, else a new tensor with
        zeros where W has nothing."""
        if self.same:
            return flat
        out = flat.new_zeros(self.full)
        for src, dst, n in self.moves:
            out[dst:dst + n].copy_(flat[src:src + n])
        return out

    def shrink_into(self, full, flat):
        """Copy ``full`` (T's layout) into ``flat`` (W's), W's parts only (nothing when they are
        the same tensor)."""
        if full is flat:
            return
        for src, dst, n in self.moves:
            flat[src:src + n].copy_(full[dst:dst + n])

    def dropped(self, unit, out):
        """What FSDP drops of unit ``unit``'s decoded ``out`` (of ``members[0]``'s plan):
        float32 ``[unit numel]`` holding ``out`` where it covers a parameter of T not in W,
        zeros elsewhere; None when it covers none."""
        if self.same:
            return None
        members, spans, pos = self.members[0], [], 0
        for i in unit.members:  # the unit's coordinates: its members', in this order
            m = members[i]
            for dst, n in self.absent:
                if m.offset <= dst < m.offset + m.numel:
                    spans.append((pos + dst - m.offset, n))
            pos += m.numel
        if not spans:
            return None
        flat = out.reshape(-1).float()
        keep = torch.zeros_like(flat)
        for at, n in spans:
            keep[at:at + n] = flat[at:at + n]
        return keep


class Layouts:
    """The :class:`CallLayout` of each call of one FSDP parameter group, cached by (W, T)."""

    def __init__(self, shard, per, ranks):
        self.shard, self.per, self.ranks = shard, per, tuple(ranks)
        self.presence = Presence.of(shard.fsdp_group)
        self._cache = {}

    def now(self, numel, caller):
        """The running call's layout, checked against the flat chunk's length ``numel``.

        Raises:
            RuntimeError: ``numel`` is not the length of the parameters :class:`Presence`
                found (a PyTorch whose FSDP picks them by another rule).
        """
        p = self.presence
        key = (p.present, p.trainable)
        lay = self._cache.get(key)
        if lay is None:
            if len(self._cache) > 16:
                self._cache.clear()
            lay = self._cache[key] = CallLayout(self.shard, self.per, p.present, p.trainable, self.ranks)
        if lay.numel != numel:
            raise RuntimeError(f"{caller}: FSDP module {self.shard.path or '<root>'!r} reduced a flat "
                               f"shard of {numel} values, but its parameters with a gradient "
                               f"({[self.shard.names[i] for i in p.present]}) make {lay.numel}: this "
                               f"PyTorch ({torch.__version__}) picks them otherwise than 2.13")
        return lay


def fingerprint(compressor, per, entries) -> tuple:
    """What every rank of a compressor's group must agree on at install (issue 47): the
    compressor's canonical spec (schemes, options, rules), ``per``, and which parameters of
    each FSDP module are trainable (the layout the plan follows)."""
    return (compressor.spec, per,
            tuple((e.path, tuple(fp.sharded_param.requires_grad for fp in e.fsdp_group.fsdp_params))
                  for e in entries))


def agreement_error(caller, seen, ranks, group_name):
    """The message of the first difference between the ranks' :func:`fingerprint` s ``seen``
    (one per rank of the group, gathered: the same list on every rank, hence the same message
    on every rank of it), or None; ``ranks``: the group's global ranks."""
    first = seen[0]
    for i, other in enumerate(seen):
        if other == first:
            continue
        where = f"{caller}: the ranks of the {group_name} {ranks} disagree:"
        if other[0] != first[0]:
            return (f"{where} rank {ranks[0]} installs compressor {first[0]!r}, rank {ranks[i]} "
                    f"{other[0]!r}; every rank must install the same spec (the ranks sum each other's "
                    f"payloads, whose layout the spec decides)")
        if other[1] != first[1]:
            return (f"{where} rank {ranks[0]} installs per={first[1]!r}, rank {ranks[i]} per={other[1]!r}; "
                    f"every rank must install with the same per")
        for (path, mine), (_, theirs) in zip(first[2], other[2]):
            if mine != theirs:
                return (f"{where} FSDP module {path or '<root>'!r} has requires_grad {list(mine)} on rank "
                        f"{ranks[0]} and {list(theirs)} on rank {ranks[i]}; every rank must freeze the "
                        f"same parameters")
        return f"{where} rank {ranks[0]} and rank {ranks[i]} hold other FSDP modules"
    return None


def settle(verdict, other_group):
    """Raise ValueError(``verdict``) on every rank of the model: the verdicts of one group's
    check (None: it passed) are gathered over the model's other group (``other_group``: the
    shard group for :func:`~torch_backend.fsdp.install`'s check on the replicas' group, and
    the reverse; None or one rank: nothing to gather), so a difference on some replicas' group
    reaches every rank of the 2-D mesh, each raising the first verdict in that group's order.
    One ``all_gather_object``, every rank calling it at the same point."""
    if other_group is not None and dist.get_world_size(other_group) > 1:
        found = [None] * dist.get_world_size(other_group)
        dist.all_gather_object(found, verdict, group=other_group)
        verdict = next((v for v in found if v is not None), None)
    if verdict is not None:
        raise ValueError(verdict)


class LayoutEngine:
    """A :class:`~torch_backend.engine.ProcessGroupEngine` (``world``, ``gather``,
    ``allreduce``, delegated) that also knows every key an FSDP installer's layout makes, to
    screen a compressor state loaded into it (issue 47, item 6): the state is per mesh, its
    keys naming the shard rank and the shard group's size.

    Args:
        engine: the process group's engine.
        caller: ``"install"`` or ``"install_reduce_scatter"`` (named in messages).
        keys: the exact keys the layout makes (every parameter's, frozen ones included, for
            every shard rank this rank's compressor encodes).
        patterns: compiled regexes of the other keys it may make (``per="group"`` over a
            trainable part of a module: :func:`_members`).
        where: the layout in words, for messages.
    """

    def __init__(self, engine, caller, keys, patterns, where):
        self.inner, self.caller, self.keys = engine, caller, frozenset(keys)
        self.patterns, self.where = tuple(patterns), where

    def world(self):
        return self.inner.world()

    def gather(self, obj):
        return self.inner.gather(obj)

    def allreduce(self, x, average: bool):
        return self.inner.allreduce(x, average)

    def makes(self, key) -> bool:
        """Whether this layout ever makes the compressor key ``key``."""
        return key in self.keys or any(p.fullmatch(key) for p in self.patterns)

    def foreign(self, part: dict) -> list:
        """The keys of one rank's saved state (``tensors``, ``routes``, the members of its
        ``buckets``) that this layout never makes, sorted."""
        keys = set(part.get("tensors", {})) | set(part.get("routes", {}))
        for saved in part.get("buckets", {}).values():
            keys.update(saved.get("members", ()) if isinstance(saved, dict) else ())
        return sorted(k for k in keys if isinstance(k, str) and not self.makes(k))

    def screen_state(self, state_dict, rank=None):
        """``state_dict`` as :meth:`Compressor.load_state_dict` may load it here (called by it
        before anything is loaded; ``rank``: its ``rank=``, None when not given).

        Returns it unchanged where every key of the part that would load (per rank: the
        dict; gathered: this rank's part, or rank 0's when the world size differs) is one
        this layout makes. Where some are not: with ``rank=`` given (the user asked for it
        explicitly) a copy without them, after a warning naming them (their error feedback
        is dropped); else ValueError.

        Raises:
            ValueError: keys this layout never makes and no ``rank=`` (module docstring of
                :mod:`torch_backend.fsdp`, "Checkpoints").
        """
        if not isinstance(state_dict, dict):
            return state_dict  # (load_state_dict refuses it, naming what it is)
        parts = state_dict.get("ranks")
        gathered = parts is not None
        if gathered:
            if not isinstance(parts, (list, tuple)) or not parts:
                return state_dict
            size, me = self.world()
            index = 0 if len(parts) != size else (me if rank is None else rank)
            if not isinstance(index, int) or not 0 <= index < len(parts) or not isinstance(parts[index], dict):
                return state_dict
            part = parts[index]
        else:
            part = state_dict
        foreign = self.foreign(part)
        if not foreign:
            return state_dict
        total = len(set(part.get("tensors", {})) | set(part.get("routes", {})))
        shown = ", ".join(repr(k) for k in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        example = next(iter(sorted(self.keys)), None)
        if rank is None:
            raise ValueError(
                f"load_state_dict: this compressor state holds {len(foreign)} tensor key(s) that "
                f"{self.caller}'s layout here never makes ({shown}; here: {self.where}, keys such as "
                f"{example!r}), so their error feedback would wait unused: it was saved on another "
                f"FSDP mesh (another shard group size or shard rank) or by another model. A "
                f"compressor's state is per mesh: the model and optimizer reshard through DCP, the "
                f"compressor's state does not. Resume on the same mesh with each rank loading its own "
                f"file, or start this compressor fresh (skip load_state_dict: error feedback builds up "
                f"again within a few steps), or pass rank= explicitly to load the keys that fit and "
                f"drop the others with a warning")
        warnings.warn(f"hvd_gradcomp: load_state_dict(rank={rank}) into {self.caller}'s layout "
                      f"({self.where}) drops {len(foreign)} of the state's {total} tensor key(s) that "
                      f"this layout never makes, with their error feedback: {foreign}", stacklevel=3)
        gone = set(foreign)
        kept = dict(part)
        kept["tensors"] = {k: v for k, v in part.get("tensors", {}).items() if k not in gone}
        kept["routes"] = {k: v for k, v in part.get("routes", {}).items() if k not in gone}
        if "buckets" in part:
            kept["buckets"] = {g: v for g, v in part["buckets"].items()
                               if not (isinstance(v, dict) and gone.intersection(v.get("members", ())))}
        if not gathered:
            return kept
        out = dict(state_dict)
        out["ranks"] = [kept if i == index else p for i, p in enumerate(parts)]
        return out

    def __repr__(self):
        return f"LayoutEngine({self.inner!r}, {self.caller})"


def layout_engine(engine, caller, entries, per, shard_ranks) -> LayoutEngine:
    """The :class:`LayoutEngine` of ``entries`` (the installer's :class:`_Shard` s) whose
    compressor encodes the chunks of shard ranks ``shard_ranks`` (install: its own;
    the reduce-scatter: all)."""
    keys, patterns = set(), []
    size = entries[0].size
    for e in entries:
        path = e.path or "<root>"
        for j in shard_ranks:
            keys.update(m.key for m in _members(e._replace(rank=j), per))
            if per == "group":
                patterns.append(re.compile(re.escape(path) + r"\|\d+/\d+\|[0-9a-f]{8}" +
                                           re.escape(f"[shard {j}/{size}]")))
    ranks = f"shard rank {shard_ranks[0]}" if len(shard_ranks) == 1 else f"shard ranks 0..{size - 1}"
    return LayoutEngine(engine, caller, keys, patterns, f"{ranks} of a shard group of {size}, per={per!r}")


def loaded_error(compressor, engine: LayoutEngine):
    """The message refusing, at install, a state loaded into ``compressor`` before it
    (``load_state_dict`` before ``install``: its keys wait in the compressor, as
    :meth:`state_dict` shows) whose keys the layout never makes (as
    :meth:`LayoutEngine.screen_state` without ``rank=``), or None. Posts no collective (the
    installer gathers the verdict with its layout check)."""
    state = compressor.state_dict()
    if not (state.get("tensors") or state.get("buckets")):
        return None
    try:
        engine.screen_state(state)
    except ValueError as err:
        return (f"{engine.caller}: the compressor holds a state loaded before {engine.caller} "
                f"(load it after {engine.caller}, where rank= drops what does not fit); {err}")
    return None
