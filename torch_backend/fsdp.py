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

**Frozen and unused parameters.** FSDP reduces only the parameters with a gradient in a
backward; each call is laid out as the compressor's plan over the trainable parameters, a
trainable one without a gradient sent as zeros plus its error feedback and what comes back for
it kept in its error feedback again (:mod:`torch_backend.fsdp_shards`, "Parameters without a
gradient").

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
The state is per mesh (its keys name the shard rank and the shard group's size; DCP reshards
the model and optimizer, not it): the compressor's engine
(:class:`~torch_backend.fsdp_shards.LayoutEngine`) knows every key the layout makes, and a
state with keys it never makes is refused at load (or, with ``rank=`` given, loaded without
them after a warning naming them) and at install when loaded before it.

Refused with a clear error, before any collective, on every rank: a model that is not an
``FSDPModule``, a compressor that is a factory or is bound already, blocking two-round
variants, a shard-only mesh without ``replicate_group``, a ``replicate_group`` other than the
2-D mesh's, a module with several parameter groups (``shard_placement_fn`` with several
meshes) or with an all-reduce hook already, and replicas whose shard ranks or shard sizes
differ, or whose compressors' fingerprints (:func:`~torch_backend.fsdp_shards.fingerprint`:
spec, ``per``, frozen parameters) differ, naming both (checked by one ``all_gather_object`` on
the replicas' group at install, its verdict gathered over the shard group so that every rank
raises it: :func:`~torch_backend.fsdp_shards.settle`).

**Overlap** (``install(..., overlap=True)``, CPU parameters). On CPU, FSDP2 calls the hook in
the backward's own thread, so a blocking all-reduce across replicas stops backward until it is
back (FSDP's own all-reduce too). With overlap the hook posts its all-reduces (one in flight
at a time on the replicas' group) and returns
zeros; an autograd final callback it queues, at the end of the same backward, waits for them, decodes
and adds the sums into the ``.grad`` FSDP set (:mod:`torch_backend.fsdp_overlap`): the same
gradients, bit for bit, while the link carries each group's payload during the backward of
the groups before it. Refused with a post-accumulate-grad hook on a parameter (it would read
the gradient before the sum arrives) and on CUDA (FSDP's all-reduce stream overlaps there).

**Delayed sync** (``install(..., delay=1)``; :mod:`torch_backend.fsdp_delayed`). Each hook
posts its module's all-reduce without waiting and hands FSDP that module's previous step's
decoded mean (zeros at the first step, on every replica alike), so step t's all-reduce runs
beside step t + 1's forward and backward: the blocking run's gradients shifted by one step,
bit for bit (the hooks run this class's :meth:`~_ShardHook.take_input`,
:meth:`~_ShardHook.encode` and :meth:`~_ShardHook.decode`). ``delayed_state(model).drain()``
before a checkpoint and after the last step. Refused with ``overlap=True``.

**The reduce-scatter.** :func:`install_reduce_scatter` (in :mod:`torch_backend.fsdp_scatter`,
re-exported here; its docstring has the design) compresses FSDP's reduce-scatter within the
shard group with a compressor of its own.
"""
import torch
import torch.distributed as dist

from hvd_gradcomp.payloads import post_payloads, unpack_payloads

from .engine import ProcessGroupEngine
from .kernels import runs
from .fsdp_delayed import DelayedShardHook, check_delay, delay_verdict, wrap
from .fsdp_overlap import Overlap
from .ops import OPS
from .fsdp_scatter import install_reduce_scatter
from .fsdp_shards import (Layouts, Presence, _checked_names, _fsdp_api, _param_groups, _same_ranks, _shard,
                          agreement_error, fingerprint, layout_engine, loaded_error, settle, shard_key,
                          word_carrier)

__all__ = ["install", "install_reduce_scatter", "shard_key"]


class _ShardHook:
    """The all-reduce hook of one FSDP parameter group: the shard's tensors routed and cut into
    codec units (:meth:`Compressor.plan_bucket`: one call per route), each compressed, the
    payloads summed across replicas (one all-reduce per payload dtype), decoded, divided and
    written back in place (module docstring); with ``late`` (an
    :class:`~torch_backend.fsdp_overlap.Overlap`), written at the end of backward instead.
    ``layouts`` (:class:`~torch_backend.fsdp_shards.Layouts`): which parameters each call's
    flat holds, laid out as the compressor's (trainable) ones."""

    def __init__(self, comp, group, fsdp_group, layouts, replicas, late=None):
        self.compressor, self.codec = comp, comp.codec  # the user's (checkpoints) and its codec
        self.group, self.fsdp_group = group, fsdp_group
        self.layouts, self.replicas, self.late = layouts, replicas, late
        self.partial = None  # (T, reduce-scattered shards in T's layout) kept while all-reduce is off

    def __call__(self, output: torch.Tensor) -> None:
        with torch.no_grad():
            lay, x = self.take_input(output)
            if x is None:
                return
            late = self.late is not None
            if late:
                self._check_late()
            post = (lambda flat: self.late.post(flat, self.group)) if late else \
                (lambda flat: dist.all_reduce(flat, group=self.group))
            entries, posted = self.encode(lay, x, post)
            summed = x.clone() if late and x is output else x  # (units cover it all)

            def finish():
                with torch.no_grad():
                    self.decode(lay, summed, entries, posted)
                    if not lay.same:
                        mine = summed.new_empty(lay.numel)
                        lay.shrink_into(summed, mine)
                    self.late.write(self.fsdp_group, summed if lay.same else mine, lay.params)
            if late and self.late.defer(finish):
                output.zero_()  # FSDP sets (or adds) zeros now; the sum is added at the end of backward
            else:
                self.decode(lay, x, entries, posted)
                lay.shrink_into(x, output)

    def take_input(self, output):
        """``(lay, x)``: the call's :class:`~torch_backend.fsdp_shards.CallLayout` and its flat
        shard in T's layout (``output`` itself where W is T) plus the shards kept while the
        all-reduce was off; ``(lay, None)`` where it is off (``set_requires_all_reduce(False)``:
        ``output`` kept and zeroed, nothing to send)."""
        lay = self.layouts.now(output.numel(), "install")
        x = lay.expand(output)  # output itself unless a trainable parameter has no gradient
        if not self.fsdp_group.all_reduce_grads:  # set_requires_all_reduce(False)
            self._keep(lay, x)
            output.zero_()
            return lay, None
        if self.partial is not None:
            x = self._take(lay, x)
        return lay, x

    def encode(self, lay, x, post):
        """Encode ``x`` (T's layout) unit by unit and post the payloads, each trainable
        parameter's presence word last, through ``post(flat)`` (one call per payload dtype,
        each ``flat`` a copy: it returns a work or None). Returns ``(entries, posted)`` for
        :meth:`decode`: ``[(unit, payload, ctx)]`` and :func:`post_payloads`' answer."""
        dtype = str(x.dtype).removeprefix("torch.")
        plan = self.codec.plan_bucket(lay.members[0], dtype, "sum", self.group, x)
        entries = []
        for unit in plan.units:
            u = x[unit.start:unit.stop] if unit.contiguous else x.index_select(0, unit.index)
            payload, ctx = self.codec.encode_unit(unit, u.view(unit.info.shape))
            entries.append((unit, payload, ctx))
        # One all-reduce per payload dtype (hvd_gradcomp.payloads), each buffer a copy (a
        # payload may be a view of x). Blocking, or (overlap) posted with at most one in
        # flight on the replicas' group: Gloo aborted the process now and then with two of
        # them running at once ("terminate called without an active exception"); (delay=1)
        # posted, the groups' all-reduces of a step in flight together (fsdp_delayed).
        # Each trainable parameter's "has a gradient here" word rides along, last in the
        # buffer of its dtype (checked in decode); as int32, alone, where no payload dtype
        # sums R ones exactly
        carrier = word_carrier({p.dtype for _, p, _ in entries}, self.replicas) or torch.int32
        words = lay.present_words(carrier, x, failed=self.layouts.presence.failed or ())
        self.layouts.presence.failed = None
        return entries, post_payloads(OPS, [p for _, p, _ in entries] + [words], post, copy=True)

    def _keep(self, lay, x):
        """Add ``x`` (T's layout) to the shards kept while all-reduce is off."""
        x = x.clone() if lay.same else x  # (output itself: FSDP gets zeros)
        if self.partial is not None:
            x = self._take(lay, x)
        self.partial = (lay.trainable, x)

    def _take(self, lay, x):
        """``x`` plus the kept shards, which are dropped.

        Raises:
            ValueError: the trainable parameters changed since the shards were kept (no layout
                holds both).
        """
        trainable, kept = self.partial
        self.partial = None
        if trainable != lay.trainable:
            raise ValueError(f"install: FSDP module {self.layouts.shard.path or '<root>'!r}: the "
                             f"parameters with requires_grad changed between backward passes "
                             f"accumulated with set_requires_all_reduce(False); change "
                             f"requires_grad only after the step whose all-reduce is on")
        return x.add_(kept)

    def _check_late(self):
        """Raises ValueError where a parameter of the group has a post-accumulate-grad hook
        (it would see FSDP's zeros, not the sum: ``overlap=True`` cannot serve it)."""
        for fp in self.fsdp_group.fsdp_params:
            if getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None):
                raise ValueError("torch_backend.fsdp.install(overlap=True): a parameter of this FSDP "
                                 "module has a post-accumulate-grad hook (e.g. an optimizer in "
                                 "backward), which would read the gradient before the all-reduce "
                                 "across replicas is added; install with overlap=False")

    def decode(self, lay, output, entries, posted):
        """Wait for each posted all-reduce (``posted``: :func:`post_payloads`' answer, the
        words last) and write its units' decoded sums into ``output`` (T's layout); what FSDP
        will not write (a trainable parameter without a gradient in this call) goes back into
        its error feedback, every replica's share of the mean."""
        # FSDP's own factor, when set, is the whole divide (the hook sums): as native HSDP.
        divide = None if self.fsdp_group.gradient_divide_factor is not None else self.replicas
        packed, works = posted
        for work in works:  # every rank waits for all, then checks
            if work is not None:
                work.wait()
        reduced = unpack_payloads(OPS, packed, view=torch.Tensor.view)  # (summed in place)
        refused = lay.check_present(reduced[-1], self.replicas, "install", "replicas' group", failed=True)
        if refused is not None:
            raise ValueError(refused[0])
        for (unit, _, ctx), summed in zip(entries, reduced):
            dst = output[unit.start:unit.stop] if unit.contiguous and divide is not None else None
            out = self.codec.decode(summed, ctx, divide=divide, into=dst).reshape(-1)
            dropped = lay.dropped(unit, out)
            if dropped is not None:  # (the mean: a sum is divided by the replicas here)
                self.codec.add_error_feedback(ctx, dropped if divide else dropped / self.replicas)
            out = out.to(output.dtype)
            if unit.contiguous:
                runs.write_into(output[unit.start:unit.stop] if dst is None else dst, out)
            else:
                output.index_copy_(0, unit.index, out)


def install(model, compressor, replicate_group=None, per="param", overlap=False, delay=0):
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
        overlap: post each group's all-reduce in its hook and finish them all at the end of
            backward, so that they travel while backward goes on (module docstring, "Overlap";
            CPU tensors: on CUDA FSDP's all-reduce stream overlaps already).
        delay: 0 (default): blocking; 1: delayed sync, step t's all-reduce posted without
            waiting and its mean applied at step t + 1 (module docstring, "Delayed sync";
            :mod:`torch_backend.fsdp_delayed`: ``delayed_state(model).drain()`` and checkpoints).

    Every rank calls it at the same point (one ``all_gather_object`` on the replicas' group
    checks that they agree on the shards; ``auto`` without ``bandwidth_gbit`` measures the
    link there). Returns the compressor, bound to the replicas' group: ranks, world size
    (the number of replicas R), ``state_dict``/``load_state_dict``.

    Raises:
        TypeError: ``model`` is not an FSDP module, ``compressor`` not a PyTorch compressor
            (or a factory such as ``Compression.fp16`` without the call).
        ValueError: ``per`` is neither; ``delay`` not 0 or 1, or 1 with ``overlap=True``; the
            compressor is bound already or routes a tensor to a blocking variant;
            ``overlap=True`` on CUDA parameters;
            no replicas' group (shard-only mesh without ``replicate_group``), a
            ``replicate_group`` that is not the mesh's, an FSDP module with several parameter
            groups or an all-reduce hook already, replicas that disagree on shard ranks, sizes
            or layout, or that install another compressor spec, ``per``, ``delay`` or other frozen
            parameters (the same message on every rank, naming both). Raised on every rank
            before the hook is set.
        RuntimeError: a PyTorch without FSDP2 or without the internals named above.
    """
    FSDPModule, FSDPMeshInfo, HSDPMeshInfo = _fsdp_api()
    delay = check_delay(delay, overlap)
    names = _checked_names("install", model, compressor, per)
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
        entries.append(_shard("install", path, module, g, names, group))
    if not entries:
        raise ValueError("install: the model has no FSDP module holding parameters")
    late = None
    if overlap:
        if entries[0].fsdp_group.device.type != "cpu":
            raise ValueError(f"install(overlap=True) is for CPU parameters (Gloo), whose all-reduce "
                             f"blocks the backward; these are on {entries[0].fsdp_group.device}, where "
                             f"FSDP's all-reduce stream overlaps already: use overlap=False")
        late = Overlap()
    group = entries[0].replicas
    for e in entries[1:]:
        if not _same_ranks(e.replicas, group):
            raise ValueError(f"install: FSDP module {e.path or '<root>'!r} is replicated over ranks "
                             f"{dist.get_process_group_ranks(e.replicas)}, others over "
                             f"{dist.get_process_group_ranks(group)}; one compressor needs one "
                             f"replicas' group")
    layout = [(e.path, e.rank, e.size, sum(fp.sharded_param.to_local().numel() for fp in e.fsdp_group.fsdp_params))
              for e in entries]
    engine = layout_engine(ProcessGroupEngine(group), "install", entries, per, [entries[0].rank])
    seen = engine.gather((fingerprint(compressor, per, entries), layout, loaded_error(compressor, engine), delay))
    ranks = dist.get_process_group_ranks(group)
    verdict = next((s[2] for s in seen if s[2] is not None), None) or agreement_error(
        "install", [s[0] for s in seen], ranks, "replicas' group") or delay_verdict([s[3] for s in seen], ranks)
    seen = [s[1] for s in seen]
    if verdict is None and any(other != layout for other in seen):
        bad = next(i for i, other in enumerate(seen) if other != layout)
        verdict = (f"install: replica {bad} of this rank's replicas' group "
                   f"{dist.get_process_group_ranks(group)} holds other shards "
                   f"{seen[bad][:3]} than this rank {layout[:3]} (module path, shard rank, "
                   f"shard size, numel): replicate_group must join the ranks with the same "
                   f"shard rank of equal shard meshes")
    settle(verdict, entries[0].fsdp_group.mesh_info.shard_process_group)  # (every rank raises it)
    compressor.codec.bind_engine(engine)
    replicas, _ = engine.world()
    if any(s.adaptive and s.link is None for s in compressor.routing.schemes()):
        like = entries[0].fsdp_group.fsdp_params[0].sharded_param.to_local()
        compressor.calibrate(like=like.detach())
    hooks = []
    for e in entries:
        g = e.fsdp_group
        if isinstance(g.mesh_info, HSDPMeshInfo):  # turn FSDP's own all-reduce off (docstring)
            old = g.mesh_info
            new = FSDPMeshInfo(old.mesh, shard_mesh_dim=old.shard_mesh_dim, dp_mesh_dims=old.dp_mesh_dims,
                               spmd_mesh=old.spmd_mesh)
            new.reduce_scatter_process_group = old.reduce_scatter_process_group
            g.mesh_info = new
        g._hvd_gradcomp_replicas = group  # (install_reduce_scatter's checks reach them: settle)
        Presence.of(g).carried = True  # (a reduce-scatter's refusal rides in this hook's words)
        hook = _ShardHook(compressor, group, g, Layouts(e, per, [e.rank]), replicas, late)
        hooks.append(DelayedShardHook(hook) if delay else hook)
        e.module.set_all_reduce_hook(hooks[-1])
    if delay:  # (delayed_state(model) finds them)
        wrap(model, hooks)
    return compressor
