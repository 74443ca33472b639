"""hvd-gradcomp's compressors on FSDP2's all-reduce across replicas (HSDP, :func:`install`) and
on its reduce-scatter within the shard group (:func:`install_reduce_scatter`; "The
reduce-scatter" below).

Usage, for a model already sharded by ``fully_shard``::

    from torch.distributed.fsdp import fully_shard
    from torch_backend import Compression
    from torch_backend.fsdp import install
    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comp = install(model, Compression.thc())      # every rank, before the first backward

and, to compress the reduce-scatter within the shard group too (or alone, on a 1-D mesh of
FSDP without replicas), with a compressor of its own::

    rs = install_reduce_scatter(model, Compression.thc())

or with a shard-only mesh and the replicas' process group given separately:
``fully_shard(..., mesh=mesh["shard"])`` then ``install(model, comp,
replicate_group=mesh.get_group("replicate"))``.

**Where it acts.** FSDP2 reduce-scatters each parameter group's gradient within the shard group
and then, under HSDP, all-reduces the shard across the replicas (``foreach_reduce`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, PyTorch 2.13). That all-reduce
over the slow link is replaced by our compressor: :func:`install` sets
``FSDPModule.set_all_reduce_hook`` on every FSDP module. The hook receives the flat,
reduce-scattered shard gradient (the group's parameters' dim-0 shards, padded, concatenated;
the reduce dtype), compresses each part (see Identity) under its key
(:meth:`Compressor.encode`), sums the payloads with one ``dist.all_reduce`` per payload dtype
on the replicas' group, decodes and writes the results in
place; FSDP then divides and writes the parameters' ``.grad``. On a 2-D mesh FSDP would run its
own all-reduce *before* the hook, so :func:`install` turns it off by giving each parameter
group a shard-only mesh description over the same mesh (the parameters and gradients stay
DTensors on the 2-D mesh, ``(Replicate(), Shard(0))``): a private attribute of PyTorch 2.13
(``FSDPParamGroup.mesh_info``), checked at install (a clear error on versions without it).
On CUDA the hook runs on FSDP's all-reduce stream, which FSDP makes wait for the
reduce-scatter; the codec's kernels and the blocking ``all_reduce`` are issued there, and FSDP's
divide and copy into ``.grad`` follow on the same stream (written for it, untested on GPUs here).

**Divide factors.** FSDP divides the reduce-scattered shard by the shard group's size (or a
pre- and post-divide pair for float16 reduction); the hook then divides the replicas' decoded
sum by the number of replicas R, so the gradient is the mean over all S x R ranks, as native
HSDP's. With ``set_gradient_divide_factor(f)`` FSDP applies ``f`` alone and the hook sums (the
total is the sum over all ranks / f, as native HSDP's); ``set_force_sum_reduction_for_comms``
changes nothing here (the hook always sums).

**Identity.** ``per="param"`` (default): each parameter's shard is a tensor of its own, in its
padded shard shape (``[rows, ...]``: PowerSGD takes matrices), keyed ``"<parameter
name>[shard i/S]"`` and routed by the parameter's name (``"*.bias -> fp16"``), as the DDP hook
routes; the module's tensors that share a route whose math is over a vector are compressed in
one codec call, as DDP's buckets (:mod:`hvd_gradcomp.buckets`; error feedback and checkpoints
stay per tensor). ``per="group"``: the FSDP module's whole flat shard is one tensor (fewer, larger
tensors: one codec call per module; a group of several parameters is a vector, which PowerSGD
refuses, so it is sent as fp16), keyed ``"<module path>[shard i/S]"`` (the root: ``<root>``)
and routed by the module's path (``"layers.0"``), or by the parameter's name where the group
holds one. Either key is equal on every replica, stable across steps and distinct per shard
rank; each keeps its own state (error feedback, scores, ranges, bases, ``auto``'s choice).

**Accumulation.** ``set_requires_gradient_sync(False)`` skips FSDP's reduction altogether (no
hook call). ``set_requires_all_reduce(False)`` (reduce-scatter each micro-batch, all-reduce
once): the hook keeps the reduce-scattered shards and hands FSDP zeros, then compresses their
sum at the step whose all-reduce is on again, as native HSDP does.

**Mixed precision and offload.** ``MixedPrecisionPolicy(reduce_dtype=torch.float16 or
bfloat16)`` (or half-precision parameters without a reduce dtype): the shard is compressed in
that dtype, decoded and divided in float32 and cast back with the excess beyond float16's
range kept in error feedback (:meth:`Compressor.decode`). ``CPUOffloadPolicy``: the hook runs on
the compute device before FSDP copies the gradient to the CPU; the compressor's state lives on
that device.

**Checkpoints.** The compressor is bound to the replicas' group
(:class:`~torch_backend.engine.ProcessGroupEngine`): ``comp.state_dict()`` is this rank's
state (its shards' error feedback), saved with the rank's model and optimizer shards and
loaded on the same rank after :func:`install` (``comp.load_state_dict(sd)``); resumes exactly.

Refused with a clear error, before any collective, on every rank: a model that is not an
``FSDPModule``, a compressor that is a factory or is bound already, blocking two-round
variants, a shard-only mesh without ``replicate_group``, a ``replicate_group`` other than the
2-D mesh's, a module with several parameter groups (``shard_placement_fn`` with several
meshes) or with an all-reduce hook already, and replicas whose shard ranks or shard sizes
differ (checked by one ``all_gather_object`` on the replicas' group at install).

**The reduce-scatter.** :func:`install_reduce_scatter` sets ``FSDPModule.set_custom_reduce_scatter``
on every FSDP module (PyTorch 2.13's ``ReduceScatter`` protocol of
``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``: ``allocate(size, dtype=, device=)`` and
``__call__(output_tensor, input_tensor, group, op, async_op)``). ``foreach_reduce``
(``_fsdp_collectives.py``) hands it the parameter group's flat gradient ``[S * C]`` in the reduce
dtype, laid out as S chunks (``input.view(S, C)[j]``: the padded dim-0 shards of every parameter
for rank ``j``, in the group's order, exactly what the all-reduce hook of rank ``j`` receives),
already divided by FSDP's pre-divide factor; rank ``r`` must write into ``output_tensor`` ``[C]``
the reduction of every rank's chunk ``r``, with ``op`` Avg (float32/bfloat16: the mean over
the S ranks), PreMulSum(1/f) (``set_gradient_divide_factor(f)``) or Sum (float16 reduction with
a pre- and post-divide pair, or a forced sum). It is called on FSDP's reduce-scatter stream only
when S > 1. Under HSDP FSDP's all-reduce (or :func:`install`'s hook, with its own compressor)
follows on the reduced chunk.

A payload here is reduce-scattered, not all-reduced: rank ``r`` receives the sum of every
rank's region ``r`` only. So each chunk ``j`` is its own tensor (per parameter or per module, as
``per`` says), keyed ``"<name>[shard j/S]"``, the key the destination's own shard has, and
every rank encodes every chunk of its gradient; each rank's state holds, per chunk, what it
still owes of it (error feedback belongs to the sender) and the fields the ranks agree on.
Those agreed fields (THC's next ranges and step counter, signSGD's scales, the control words
that say a rank failed or the states disagree) ride inside each chunk's payload and would reach
only its destination, while every rank needs them for its next encode of that chunk. Three ways
were weighed: (a) a side collective (all-gather or broadcast) of the agreed statistics after the
reduce-scatter: a second collective per module and step, and an all-gather, which this
project's payloads never use; (b) replicating each chunk's agreed part into every destination's
region, so one reduce-scatter delivers every chunk's summed agreed part to every rank, at S
times the agreed part's bytes (THC: the statistics, about 0.06 bits a coordinate, and 4 control
words; signSGD: its scale pairs and 2 control words); (c) only the destination keeping state
per chunk: wrong, the other ranks' encodes of that chunk need it. This module does (b): one
collective per payload dtype, no all-gather. Its condition: the copies of an agreed part must be
equal bit for bit on every rank, yet a reduce-scatter (a ring, say) adds each destination's
region in its own order, so only exact sums qualify: integer words (THC's and signSGD's
lanes), never float sums. Hence the scheme's hook :func:`hvd_gradcomp.composite.scatter_split`:
a payload is ``payload[:v]``, values read by ``decompress`` only, then an agreed part summed
exactly that is all ``receive`` and ``finish`` read. Destination ``j``'s region is chunk ``j``'s
values (of every unit) followed by every chunk's agreed part; after the reduce-scatter every
rank steps every chunk's state from the summed payload with the values zeroed
(:meth:`Compressor.decode_scattered`), the same on every rank, and the destination also
decompresses its chunk, divides as ``op`` asks (once: Avg by S, PreMulSum by f, Sum not at
all), and writes ``output_tensor``. Supported: ``none``, ``fp16``, ``bf16`` (all values,
nothing agreed; fp16's agreed scale of 8 ranks and more, read from the whole summed payload,
stays at its ``1/S`` pre-scale here), ``thc``, ``signsgd``. Refused at install, naming the scheme
and why: TopKC (its agreed scores are a float sum: copies rounded in different orders would
select different chunks), TopK (its finish reads the whole payload's finiteness), PowerSGD (a
low-rank factor of the whole matrix, not elementwise per shard), ``auto`` and blocking two-round
variants.

Two compressors under HSDP: a compressor is bound to one process group (its world size sizes
THC's lanes and fp16's pre-scale, its checkpoints record world and rank, its keys are the
shards') and the reduce-scatter runs on the shard group, the all-reduce on the replicas', so
:func:`install_reduce_scatter` takes its own compressor and :func:`install` another; either may
be used alone. Mixed precision: the chunks are encoded in the reduce dtype, decoded in float32,
divided, cast back; a float16 value beyond its range is clamped and the destination keeps the
whole excess in its error feedback. Checkpoints: ``comp.state_dict()`` is this rank's state of
every chunk (saved with the rank's model and optimizer shards, loaded on the same shard rank
after :func:`install_reduce_scatter`); resumes exactly. CUDA: the codec and the collective run
on FSDP's reduce-scatter stream, synchronously (written for it, untested on GPUs here); a
custom comm excludes FSDP's symmetric-memory and process-group allocation options.
"""
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from hvd_gradcomp.buckets import Member

from .compression import check_compressor
from .engine import ProcessGroupEngine

__all__ = ["install", "install_reduce_scatter", "shard_key"]


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


def _param_groups(module, where):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None or any(not hasattr(g, "mesh_info") or not hasattr(g, "_all_reduce_hook") for g in groups):
        raise RuntimeError(f"install: FSDP module {where!r}: this PyTorch ({torch.__version__}) has no "
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


class _ShardHook:
    """The all-reduce hook of one FSDP parameter group: the shard's tensors routed and cut into
    codec units (:meth:`Compressor.plan_bucket`: one call per route), each compressed, the
    payloads summed across replicas (one all-reduce per payload dtype), decoded, divided and
    written back in place (module docstring)."""

    def __init__(self, comp, group, fsdp_group, members, replicas):
        self.comp, self.group, self.fsdp_group = comp, group, fsdp_group
        self.members, self.replicas = members, replicas
        self.partial = None  # reduce-scattered shards kept while all-reduce is off

    def __call__(self, output: torch.Tensor) -> None:
        with torch.no_grad():
            if not self.fsdp_group.all_reduce_grads:  # set_requires_all_reduce(False)
                self.partial = output.clone() if self.partial is None else self.partial + output
                output.zero_()
                return
            if self.partial is not None:
                output.add_(self.partial)
                self.partial = None
            dtype = str(output.dtype).removeprefix("torch.")
            plan = self.comp.plan_bucket(self.members, dtype, "sum", self.group, output)
            entries, by_dtype = [], {}
            for unit in plan.units:
                x = output[unit.start:unit.stop] if unit.contiguous else output.index_select(0, unit.index)
                payload, ctx = self.comp.encode_unit(unit, x.view(unit.info.shape))
                by_dtype.setdefault(payload.dtype, []).append(len(entries))
                entries.append((unit, payload, ctx))
            # FSDP's own factor, when set, is the whole divide (the hook sums): as native HSDP.
            divide = None if self.fsdp_group.gradient_divide_factor is not None else self.replicas
            for dtype in sorted(by_dtype, key=str):
                members = by_dtype[dtype]
                flat = torch.cat([entries[i][1].reshape(-1) for i in members])  # a copy
                dist.all_reduce(flat, group=self.group)
                offset = 0
                for i in members:
                    unit, payload, ctx = entries[i]
                    summed = flat[offset:offset + payload.numel()].view(payload.shape)
                    offset += payload.numel()
                    out = self.comp.decode(summed, ctx, divide=divide).reshape(-1).to(output.dtype)
                    if unit.contiguous:
                        output[unit.start:unit.stop].copy_(out)
                    else:
                        output.index_copy_(0, unit.index, out)


def install(model, compressor, replicate_group=None, per="param"):
    """Compress FSDP2's all-reduce across replicas with ``compressor``.

    Args:
        model: the root module, ``fully_shard``-ed (an ``FSDPModule``), with its sub-modules
            sharded before it; on a 2-D ``(replicate, shard)`` DeviceMesh, or on a shard-only
            mesh with ``replicate_group``.
        compressor: a new compressor from ``torch_backend.Compression`` (any spec, rules and
            ``auto`` included), used by no other model; load a checkpoint into it after
            ``install`` (it needs the replicas' group to know its rank).
        replicate_group: the process group of this rank's replicas (the ranks holding the same
            shards): required with a shard-only mesh; with a 2-D mesh None or the mesh's own
            replicate group.
        per: ``"param"`` (default): one compressed tensor per parameter shard, keyed and routed
            by the parameter's name; ``"group"``: one per FSDP module's shard (module
            docstring, Identity).

    Every rank calls it at the same point (one ``all_gather_object`` on the replicas' group
    checks that they agree on the shards; ``auto`` without ``bandwidth_gbit`` measures the
    link there). Returns the compressor, bound to the replicas' group: ranks, world size
    (the number of replicas R), ``state_dict``/``load_state_dict``.

    Raises:
        TypeError: ``model`` is not an FSDP module, ``compressor`` not a PyTorch compressor
            (or a factory such as ``Compression.fp16`` without the call).
        ValueError: ``per`` is neither; the compressor is bound already or routes a tensor to a
            blocking variant;
            no replicas' group (shard-only mesh without ``replicate_group``), a
            ``replicate_group`` that is not the mesh's, an FSDP module with several parameter
            groups or an all-reduce hook already, replicas that disagree on shard ranks, sizes
            or layout. Raised on every rank before the hook is set.
        RuntimeError: a PyTorch without FSDP2 or without the internals named above.
    """
    FSDPModule, FSDPMeshInfo, HSDPMeshInfo = _fsdp_api()
    if per not in ("param", "group"):
        raise ValueError(f"install: per must be 'param' or 'group', got {per!r}")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"install: expected a module sharded by fully_shard (an FSDPModule), got "
                        f"{type(model).__name__}; call fully_shard(model, mesh=...) first")
    check_compressor(compressor, "install", "FSDP")
    names = {p: n for n, p in model.named_parameters()}
    entries = []
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = _param_groups(module, path or "<root>")
        if not groups:
            continue  # no parameters of its own
        if len(groups) > 1:
            raise ValueError(f"install: FSDP module {path or '<root>'!r} has {len(groups)} parameter "
                             f"groups (shard_placement_fn with several meshes); FSDP's all-reduce "
                             f"hook takes one per module")
        (g,) = groups
        if g._all_reduce_hook is not None:
            raise ValueError(f"install: FSDP module {path or '<root>'!r} has an all-reduce hook "
                             f"already (install called twice, or set_all_reduce_hook by hand)")
        info = g.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            raise ValueError(f"install: FSDP module {path or '<root>'!r} is replicated, not sharded "
                             f"({type(info).__name__}); install needs fully_shard")
        if isinstance(info, HSDPMeshInfo):
            group = info.replicate_process_group
            if replicate_group is not None and not _same_ranks(group, replicate_group):
                raise ValueError(f"install: replicate_group holds ranks "
                                 f"{dist.get_process_group_ranks(replicate_group)}, but FSDP module "
                                 f"{path or '<root>'!r} is replicated over "
                                 f"{dist.get_process_group_ranks(group)} by its 2-D mesh; pass "
                                 f"replicate_group=None")
        else:
            if replicate_group is None:
                raise ValueError(f"install: FSDP module {path or '<root>'!r} is on a shard-only mesh "
                                 f"of {info.shard_mesh_size} ranks; pass replicate_group= (the "
                                 f"ranks holding the same shards, e.g. mesh2d.get_group('replicate')) "
                                 f"or shard on a 2-D (replicate, shard) mesh")
            group = replicate_group
        members = [names.get(fp.sharded_param) for fp in g.fsdp_params]
        if None in members:
            raise ValueError(f"install: FSDP module {path or '<root>'!r} holds a parameter that "
                             f"model.named_parameters() does not name; install on the root module")
        entries.append(_Shard(path, module, g, info.shard_mesh_rank, info.shard_mesh_size, members, group))
    if not entries:
        raise ValueError("install: the model has no FSDP module holding parameters")
    group = entries[0].replicas
    for e in entries[1:]:
        if not _same_ranks(e.replicas, group):
            raise ValueError(f"install: FSDP module {e.path or '<root>'!r} is replicated over ranks "
                             f"{dist.get_process_group_ranks(e.replicas)}, others over "
                             f"{dist.get_process_group_ranks(group)}; one compressor needs one "
                             f"replicas' group")
    layout = [(e.path, e.rank, e.size, sum(fp.sharded_param.to_local().numel() for fp in e.fsdp_group.fsdp_params))
              for e in entries]
    engine = ProcessGroupEngine(group)
    seen = engine.gather(layout)
    if any(other != layout for other in seen):
        bad = next(i for i, other in enumerate(seen) if other != layout)
        raise ValueError(f"install: replica {bad} of this rank's replicas' group "
                         f"{dist.get_process_group_ranks(group)} holds other shards "
                         f"{seen[bad][:3]} than this rank {layout[:3]} (module path, shard rank, "
                         f"shard size, numel): replicate_group must join the ranks with the same "
                         f"shard rank of equal shard meshes")
    compressor.bind_engine(engine)
    replicas, _ = engine.world()
    if any(s.adaptive and s.link is None for s in compressor.routing.schemes()):
        like = entries[0].fsdp_group.fsdp_params[0].sharded_param.to_local()
        compressor.calibrate(like=like.detach())
    for e in entries:
        g = e.fsdp_group
        if isinstance(g.mesh_info, HSDPMeshInfo):  # turn FSDP's own all-reduce off (docstring)
            old = g.mesh_info
            new = FSDPMeshInfo(old.mesh, shard_mesh_dim=old.shard_mesh_dim, dp_mesh_dims=old.dp_mesh_dims,
                               spmd_mesh=old.spmd_mesh)
            new.reduce_scatter_process_group = old.reduce_scatter_process_group
            g.mesh_info = new
        e.module.set_all_reduce_hook(_ShardHook(compressor, group, g, _members(e, per), replicas))
    return compressor


# ---------------------------------------------------------------------------------------------
# The reduce-scatter within the shard group (install_reduce_scatter; module docstring, "The
# reduce-scatter").

# Why each scheme that cannot be reduce-scattered cannot (by scheme name; any other: generic).
_NOT_SCATTERED = {
    "topkc": "its agreed chunk scores are a float sum, and a reduce-scatter adds each "
             "destination's copy of them in its own order, so the copies differ in the last bits "
             "and the ranks would select different chunks",
    "topk": "its finish reads the finiteness of the whole dense payload, which only the "
            "destination receives (and it saves no bytes: the accuracy reference)",
    "powersgd": "its payload is a low-rank factor of the whole matrix with an agreed float "
                "factor in the state: it does not sum elementwise per shard",
    "auto": "it changes a tensor's scheme from agreed float measurements, and may choose "
            "schemes that cannot be reduce-scattered",
}
_SCATTERED = "none, fp16, bf16, thc, signsgd"


def _scatter_refusal(scheme, size: int):
    """Why ``scheme`` cannot be reduce-scattered on a shard group of ``size`` ranks, or None."""
    from hvd_gradcomp import composite
    from hvd_gradcomp.base import TensorInfo
    probe = TensorInfo("<probe>", (4096,), "float32", size, 0, "sum")
    if scheme.blocking:
        return "it is a blocking two-round variant (a side all-reduce inside compress)"
    if scheme.adaptive or composite.scatter_split(scheme, probe) is None:
        return _NOT_SCATTERED.get(scheme.name, "its payload has no values part that sums elementwise "
                                               "apart from an exactly summed agreed part "
                                               "(hvd_gradcomp.composite.scatter_split)")
    return None


class _ScatterComm:
    """FSDP2's reduce-scatter of one parameter group, compressed (module docstring, "The
    reduce-scatter"): a ``torch.distributed.fsdp`` ``ReduceScatter`` (``allocate`` and
    ``__call__(output_tensor, input_tensor, group, op, async_op)``).

    ``input_tensor``: the group's flat gradient, ``[S * C]`` in the reduce dtype, chunk ``j``
    (``input_tensor.view(S, C)[j]``) the padded dim-0 shards of rank ``j``; ``output_tensor``:
    ``[C]``, this rank's reduced chunk. Each chunk is cut into the compressor's units by its
    members (keyed ``"<name>[shard j/S]"``, the keys the destination's shard has) and encoded;
    one ``dist.reduce_scatter_tensor`` (Sum) per payload dtype carries, in destination ``j``'s
    region, chunk ``j``'s values and every chunk's agreed part; every rank then steps the
    state of every chunk it sent and decodes its own (:meth:`Compressor.decode_scattered`),
    divided as FSDP's ``op`` asks, into ``output_tensor``. Runs synchronously on the current
    (FSDP's reduce-scatter) stream and returns None.
    """

    def __init__(self, comp, group, fsdp_group, chunks, rank, size, path):
        self.comp, self.group, self.fsdp_group = comp, group, fsdp_group
        self.chunks, self.rank, self.size, self.path = chunks, rank, size, path

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _divide(self, op):
        """FSDP's ``op`` as the divisor of the decoded sum: Sum (FSDP pre/post-divides, or its
        sum reduction is forced) None, Avg the shard group's size, PreMulSum(1/f) f, the
        group's ``gradient_divide_factor``."""
        R = dist.ReduceOp
        if op == R.SUM:
            return None
        if op == R.AVG:
            return self.size
        factor = self.fsdp_group.gradient_divide_factor
        if op == R.PREMUL_SUM and factor is not None:
            return float(factor)
        raise ValueError(f"install_reduce_scatter: FSDP module {self.path or '<root>'!r} asked for a "
                         f"reduce-scatter with op {op!r}; the compressed reduce-scatter takes Sum, Avg "
                         f"and PreMulSum(1 / gradient_divide_factor)")

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        from hvd_gradcomp import composite
        if group is not None and dist.get_world_size(group) != self.size:
            raise ValueError(f"install_reduce_scatter: FSDP module {self.path or '<root>'!r} reduce-"
                             f"scatters over {dist.get_world_size(group)} ranks, installed for "
                             f"{self.size}")
        divide = self._divide(op)
        size, comp = self.size, self.comp
        numel = output_tensor.numel()
        if input_tensor.numel() != size * numel:
            raise ValueError(f"install_reduce_scatter: FSDP module {self.path or '<root>'!r}: input of "
                             f"{input_tensor.numel()} values for {size} chunks of {numel}")
        dtype = str(input_tensor.dtype).removeprefix("torch.")
        with torch.no_grad():
            chunks = input_tensor.view(size, numel)
            entries, by_dtype = [], {}  # entries: (chunk, unit, payload, ctx, split)
            covered = True
            for j in range(size):
                plan = comp.plan_bucket(self.chunks[j], dtype, "sum", self.group, input_tensor)
                covered = covered and sum(u.info.numel for u in plan.units) == numel
                for unit in plan.units:
                    src = chunks[j]
                    x = src[unit.start:unit.stop] if unit.contiguous else src.index_select(0, unit.index)
                    payload, ctx = comp.encode_unit(unit, x.view(unit.info.shape))
                    split = composite.scatter_split(unit.scheme, unit.info)
                    if split is None:  # install refused these schemes: a route that changed since
                        raise ValueError(f"install_reduce_scatter: tensor {unit.key!r} is routed to "
                                         f"{unit.scheme.spec()}, which cannot be reduce-scattered: "
                                         f"{_scatter_refusal(unit.scheme, size)}")
                    payload = payload.reshape(-1)
                    by_dtype.setdefault(payload.dtype, []).append(len(entries))
                    entries.append((j, unit, payload, ctx, min(split, payload.numel())))
            if not covered:  # coordinates no unit writes (none expected: FSDP's are float)
                output_tensor.zero_()
            for pdtype in sorted(by_dtype, key=str):
                self._reduce(output_tensor, [entries[i] for i in by_dtype[pdtype]], divide)
        return None

    def _reduce(self, output, entries, divide):
        """One reduce-scatter (Sum) of the payloads ``entries`` of one dtype; decode and step."""
        size, me, comp = self.size, self.rank, self.comp
        like = entries[0][2]
        values = [[e[2][:e[4]] for e in entries if e[0] == j] for j in range(size)]
        lengths = [sum(v.numel() for v in vs) for vs in values]
        width = max(lengths)
        agreed = [e[2][e[4]:] for e in entries]
        regions = []
        for j in range(size):
            parts = list(values[j])
            if lengths[j] < width:  # equal chunks give equal lengths; padded all the same
                parts.append(like.new_zeros(width - lengths[j]))
            regions.append(torch.cat(parts + agreed))
        send = torch.cat(regions)
        got = like.new_empty(regions[0].numel())
        # reduce_scatter_single where PyTorch has it (2.13 deprecates reduce_scatter_tensor)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(got, send, group=self.group)
        off_v, off_a = 0, width
        for j, unit, payload, ctx, split in entries:
            n_a = payload.numel() - split
            tail = got[off_a:off_a + n_a]
            off_a += n_a
            if j != me:
                comp.decode_scattered(None, tail, ctx)
                continue
            out = comp.decode_scattered(got[off_v:off_v + split], tail, ctx, divide=divide).reshape(-1)
            off_v += split
            out = out.to(output.dtype)
            if unit.contiguous:
                output[unit.start:unit.stop].copy_(out)
            else:
                output.index_copy_(0, unit.index, out)


def install_reduce_scatter(model, compressor, per="param"):
    """Compress FSDP2's reduce-scatter within the shard group with ``compressor``.

    Args:
        model: the root module, ``fully_shard``-ed (an ``FSDPModule``) with its sub-modules
            sharded before it, on a shard group of at least 2 ranks (a 1-D mesh, or a 2-D
            ``(replicate, shard)`` mesh: HSDP).
        compressor: a new compressor from ``torch_backend.Compression`` whose every scheme
            can be reduce-scattered (``none``, ``fp16``, ``bf16``, ``thc``, ``signsgd``, with
            their options and rules among them), used by no other model nor by :func:`install`
            (under HSDP that takes a compressor of its own); load a checkpoint into it after
            this call.
        per: ``"param"`` (default) or ``"group"``, as :func:`install`: the tensors each shard
            chunk is cut into, keyed ``"<parameter name>[shard j/S]"`` or ``"<module
            path>[shard j/S]"``.

    Every rank of the model calls it at the same point (one ``all_gather_object`` on the shard
    group checks that the ranks agree on the layout). Returns the compressor, bound to the
    shard group: world size S, rank the shard rank, ``state_dict``/``load_state_dict`` (this
    rank's error feedback of every chunk it sends, and the agreed fields).

    Raises:
        TypeError: ``model`` is not an FSDP module; ``compressor`` not a PyTorch compressor.
        ValueError: ``per`` is neither; the compressor is bound already; a scheme of its
            routing cannot be reduce-scattered (named, with the reason: ``topkc``, ``topk``,
            ``powersgd``, ``auto``, blocking two-round variants); a shard group of one rank
            (FSDP then reduce-scatters nothing); an FSDP module with several parameter groups,
            a custom reduce-scatter already, or another shard group than the others';
            ranks that disagree on the layout. Raised on every rank before any collective
            of the model is changed (the layout check is the one collective).
        RuntimeError: a PyTorch without FSDP2 or without the internals named in the module
            docstring.
    """
    FSDPModule, FSDPMeshInfo, HSDPMeshInfo = _fsdp_api()
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError as e:  # pragma: no cover - PyTorch without set_custom_reduce_scatter
        raise RuntimeError(f"install_reduce_scatter: this PyTorch ({torch.__version__}) has no FSDP2 "
                           f"DefaultReduceScatter (written against 2.13): {e}")
    if per not in ("param", "group"):
        raise ValueError(f"install_reduce_scatter: per must be 'param' or 'group', got {per!r}")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"install_reduce_scatter: expected a module sharded by fully_shard (an "
                        f"FSDPModule), got {type(model).__name__}; call fully_shard(model, mesh=...) first")
    check_compressor(compressor, "install_reduce_scatter", "FSDP")
    names = {p: n for n, p in model.named_parameters()}
    entries, group = [], None
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        where = path or "<root>"
        groups = _param_groups(module, where)
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} has {len(groups)} parameter "
                             f"groups (shard_placement_fn with several meshes); FSDP's custom "
                             f"reduce-scatter takes one per module")
        (g,) = groups
        if not isinstance(getattr(g, "_reduce_scatter_comm", None), DefaultReduceScatter):
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} has a custom reduce-scatter "
                             f"already ({type(getattr(g, '_reduce_scatter_comm', None)).__name__}: "
                             f"install_reduce_scatter called twice, or set_custom_reduce_scatter by hand)")
        info = g.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} is replicated, not sharded "
                             f"({type(info).__name__}); it has no reduce-scatter")
        shard_group = g._reduce_scatter_process_group
        if info.shard_mesh_size < 2:
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} is sharded over 1 rank: FSDP "
                             f"reduce-scatters nothing there (a shard group of at least 2 ranks is needed; "
                             f"to compress across replicas use install)")
        if group is None:
            group = shard_group
        elif not _same_ranks(group, shard_group):
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} reduce-scatters over ranks "
                             f"{dist.get_process_group_ranks(shard_group)}, others over "
                             f"{dist.get_process_group_ranks(group)}; one compressor needs one shard group")
        members = [names.get(fp.sharded_param) for fp in g.fsdp_params]
        if None in members:
            raise ValueError(f"install_reduce_scatter: FSDP module {where!r} holds a parameter that "
                             f"model.named_parameters() does not name; install on the root module")
        entries.append(_Shard(path, module, g, info.shard_mesh_rank, info.shard_mesh_size, members, None))
    if not entries:
        raise ValueError("install_reduce_scatter: the model has no FSDP module holding parameters")
    size = entries[0].size
    refused = {s.spec(): why for s in compressor.routing.schemes()
               if (why := _scatter_refusal(s, size)) is not None}
    if refused:
        spec, why = next(iter(sorted(refused.items())))
        raise ValueError(f"install_reduce_scatter: {compressor.spec!r} routes tensors to {spec}, which "
                         f"cannot be reduce-scattered: {why}. Schemes that can: {_SCATTERED}; "
                         f"{spec} stays available across replicas (install)")
    layout = [(e.path, e.size, [tuple(fp.padded_sharded_param_size) for fp in e.fsdp_group.fsdp_params])
              for e in entries]
    engine = ProcessGroupEngine(group)
    seen = engine.gather((entries[0].rank, layout))
    for i, (rank, other) in enumerate(seen):
        if other != layout or rank != i:
            raise ValueError(f"install_reduce_scatter: rank {i} of the shard group "
                             f"{dist.get_process_group_ranks(group)} holds shard {rank} of "
                             f"{other[:3]}, this rank (shard {entries[0].rank}) {layout[:3]} (module "
                             f"path, shard size, padded shard shapes): the shard group's ranks must "
                             f"shard the same model in rank order")
    compressor.bind_engine(engine)
    for e in entries:
        chunks = [_members(e._replace(rank=j), per) for j in range(e.size)]
        e.module.set_custom_reduce_scatter(_ScatterComm(compressor, group, e.fsdp_group, chunks, e.rank,
                                                        e.size, e.path))
    return compressor
