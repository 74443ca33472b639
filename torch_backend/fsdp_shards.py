"""What the FSDP2 paths share (:mod:`torch_backend.fsdp`, its all-reduce across replicas, and
:mod:`torch_backend.fsdp_scatter`, its reduce-scatter): the shards' keys, FSDP's private
parameter groups, and the members of a shard (per parameter or per module)."""
import math
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


def _members(shard: _Shard, per: str) -> list:
    """The flat shard's layout (``foreach_reduce``: each parameter's padded dim-0 shard, in the
    group's order) as the tensors the compressor keys (:class:`~hvd_gradcomp.buckets.Member`):
    per parameter, or the whole group as one (a group of one parameter: in its shape)."""
    params = shard.fsdp_group.fsdp_params
    shapes = [tuple(fp.padded_sharded_param_size) for fp in params]
    if per == "group":
        label = shard.names[0] if len(params) == 1 else (shard.path or "<root>")
        shape = shapes[0] if len(params) == 1 else (sum(math.prod(s) for s in shapes),)
        return [Member(shard_key(shard.path, shard.rank, shard.size), label, shape, 0, math.prod(shape))]
    out, offset = [], 0
    for name, shape in zip(shard.names, shapes):
        out.append(Member(shard_key(name, shard.rank, shard.size), name, shape, offset, math.prod(shape)))
        offset += math.prod(shape)
    return out
