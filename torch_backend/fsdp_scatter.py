"""FSDP2's reduce-scatter within the shard group, compressed (:func:`install_reduce_scatter`;
re-exported by :mod:`torch_backend.fsdp`, whose docstring covers the all-reduce across replicas).

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

Parameters without a gradient in a call (frozen, or unused in that backward): as for
:func:`~torch_backend.fsdp.install` (:mod:`torch_backend.fsdp_shards`), each chunk laid out
over the trainable parameters with zeros where FSDP's flat has none; what the destination
decodes for them (FSDP writes it nowhere) goes into the destination's own error feedback of
that chunk, the sum of every rank's share, as only it received them.

Two compressors under HSDP: a compressor is bound to one process group (its world size sizes
THC's lanes and fp16's pre-scale, its checkpoints record world and rank, its keys are the
shards') and the reduce-scatter runs on the shard group, the all-reduce on the replicas', so
:func:`install_reduce_scatter` takes its own compressor and :func:`install` another; either may
be used alone. Mixed precision: the chunks are encoded in the reduce dtype, decoded in float32,
divided, cast back; a float16 value beyond its range is clamped and the destination keeps the
whole excess in its error feedback. Checkpoints: ``comp.state_dict()`` is this rank's state of
every chunk (saved with the rank's model and optimizer shards, loaded on the same shard rank
after :func:`install_reduce_scatter`); resumes exactly; a state of another mesh is refused,
as for :func:`~torch_backend.fsdp.install` (its "Checkpoints"). CUDA: the codec and the collective run
on FSDP's reduce-scatter stream, synchronously (written for it, untested on GPUs here); a
custom comm excludes FSDP's symmetric-memory and process-group allocation options.
"""
import torch
import torch.distributed as dist

from .engine import ProcessGroupEngine
from .fsdp_shards import (Layouts, _checked_names, _fsdp_api, _param_groups, _same_ranks, _shard, agreement_error,
                          fingerprint, layout_engine, loaded_error, settle, word_carrier)

__all__ = ["install_reduce_scatter"]


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

    def __init__(self, comp, group, fsdp_group, layouts, rank, size, path):
        self.compressor, self.codec = comp, comp.codec  # the user's (checkpoints) and its codec
        self.group, self.fsdp_group = group, fsdp_group
        self.layouts, self.rank, self.size, self.path = layouts, rank, size, path

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
        size, codec = self.size, self.codec
        numel = output_tensor.numel()
        if input_tensor.numel() != size * numel:
            raise ValueError(f"install_reduce_scatter: FSDP module {self.path or '<root>'!r}: input of "
                             f"{input_tensor.numel()} values for {size} chunks of {numel}")
        dtype = str(input_tensor.dtype).removeprefix("torch.")
        lay = self.layouts.now(numel, "install_reduce_scatter")
        with torch.no_grad():
            chunks = input_tensor.view(size, numel)
            entries, by_dtype = [], {}  # entries: (chunk, unit, payload, ctx, split)
            covered = True
            for j in range(size):
                plan = codec.plan_bucket(lay.members[j], dtype, "sum", self.group, input_tensor)
                covered = covered and sum(u.info.numel for u in plan.units) == lay.full
                src = lay.expand(chunks[j])  # (T's layout: zeros for a parameter without a gradient)
                for unit in plan.units:
                    x = src[unit.start:unit.stop] if unit.contiguous else src.index_select(0, unit.index)
                    payload, ctx = codec.encode_unit(unit, x.view(unit.info.shape))
                    split = composite.scatter_split(unit.scheme, unit.info)
                    if split is None:  # install refused these schemes: a route that changed since
                        raise ValueError(f"install_reduce_scatter: tensor {unit.key!r} is routed to "
                                         f"{unit.scheme.spec()}, which cannot be reduce-scattered: "
                                         f"{_scatter_refusal(unit.scheme, size)}")
                    payload = payload.reshape(-1)
                    by_dtype.setdefault(payload.dtype, []).append(len(entries))
                    entries.append((j, unit, payload, ctx, min(split, payload.numel())))
            out = output_tensor if lay.same else output_tensor.new_empty(lay.full)
            if not covered:  # coordinates no unit writes (none expected: FSDP's are float)
                out.zero_()
            # Each trainable parameter's "has a gradient here" word rides along in every region,
            # with the payloads of one dtype reduce-scattered first (checked before any decode)
            carrier = word_carrier(by_dtype, size) or torch.int32
            by_dtype.setdefault(carrier, [])
            for pdtype in [carrier] + [d for d in sorted(by_dtype, key=str) if d != carrier]:
                words = lay.present_words(pdtype, input_tensor) if pdtype == carrier else None
                self._reduce(out, [entries[i] for i in by_dtype[pdtype]], divide, lay, words)
            lay.shrink_into(out, output_tensor)
        return None

    def _reduce(self, output, entries, divide, lay, words=None):
        """One reduce-scatter (Sum) of the payloads ``entries`` of one dtype (none: ``words`` alone);
        decode and step. ``output``: this rank's chunk in T's layout (``lay``, a
        :class:`~torch_backend.fsdp_shards.CallLayout`); what FSDP will not write of it (a
        trainable parameter without a gradient in this call) goes into this rank's error
        feedback of its own chunk: the whole sum of every rank's share, as only this rank
        received it. ``words``: :meth:`CallLayout.present_words`, appended to every region and
        checked (:meth:`CallLayout.check_present`) before anything is decoded."""
        size, me, codec = self.size, self.rank, self.codec
        like = words if words is not None else entries[0][2]
        values = [[e[2][:e[4]] for e in entries if e[0] == j] for j in range(size)]
        lengths = [sum(v.numel() for v in vs) for vs in values]
        width = max(lengths)
        agreed = [e[2][e[4]:] for e in entries] + ([] if words is None else [words])
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
        if words is not None:
            refused = lay.check_present(got[got.numel() - words.numel():], size, "install_reduce_scatter",
                                        "shard group")
            if refused is not None:
                presence = self.layouts.presence
                if not presence.carried:
                    raise ValueError(refused[0])
                presence.failed = refused[1]  # install's hook, next, carries it to every replica
        off_v, off_a = 0, width
        for j, unit, payload, ctx, split in entries:
            n_a = payload.numel() - split
            tail = got[off_a:off_a + n_a]
            off_a += n_a
            if j != me:
                codec.decode_scattered(None, tail, ctx)
                continue
            out = codec.decode_scattered(got[off_v:off_v + split], tail, ctx, divide=divide).reshape(-1)
            off_v += split
            dropped = lay.dropped(unit, out)
            if dropped is not None:
                codec.add_error_feedback(ctx, dropped if divide is None else dropped * float(divide))
            out = out.to(output.dtype)
            if unit.contiguous:
                output[unit.start:unit.stop].copy_(out)
            else:
                output.index_copy_(0, unit.index, out)


def install_reduce_scatter(model, compressor, per="param", delay=0):
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
        delay: 0 only: the reduce-scatter has no delayed form (``install(..., delay=1)``
            delays the all-reduce across replicas; the reduce-scatter within the shard group,
            compressed or not, stays blocking).

    Every rank of the model calls it at the same point (one ``all_gather_object`` on the shard
    group checks that the ranks agree on the layout). Returns the compressor, bound to the
    shard group: world size S, rank the shard rank, ``state_dict``/``load_state_dict`` (this
    rank's error feedback of every chunk it sends, and the agreed fields).

    Raises:
        TypeError: ``model`` is not an FSDP module; ``compressor`` not a PyTorch compressor.
        ValueError: ``delay`` other than 0; ``per`` is neither; the compressor is bound already; a scheme of its
            routing cannot be reduce-scattered (named, with the reason: ``topkc``, ``topk``,
            ``powersgd``, ``auto``, blocking two-round variants); a shard group of one rank
            (FSDP then reduce-scatters nothing); an FSDP module with several parameter groups,
            a custom reduce-scatter already, or another shard group than the others';
            ranks that disagree on the layout, or install another compressor spec, ``per`` or
            other frozen parameters (the same message on every rank, naming both). Raised on every rank before any collective
            of the model is changed (the layout check is the one collective).
        RuntimeError: a PyTorch without FSDP2 or without the internals named in the module
            docstring.
    """
    if type(delay) is not int or delay != 0:
        raise ValueError(f"install_reduce_scatter: delay={delay!r} is not supported: the reduce-scatter within "
                         f"the shard group has no delayed form (its output is the shard FSDP writes at once); "
                         f"delay the all-reduce across replicas instead, install(model, comp, delay=1)")
    FSDPModule, FSDPMeshInfo, HSDPMeshInfo = _fsdp_api()
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError as e:  # pragma: no cover - PyTorch without set_custom_reduce_scatter
        raise RuntimeError(f"install_reduce_scatter: this PyTorch ({torch.__version__}) has no FSDP2 "
                           f"DefaultReduceScatter (written against 2.13): {e}")
    names = _checked_names("install_reduce_scatter", model, compressor, per)
    entries, group = [], None
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        where = path or "<root>"
        groups = _param_groups(module, where, "install_reduce_scatter")
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
        entries.append(_shard("install_reduce_scatter", path, module, g, names, None))
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
    engine = layout_engine(ProcessGroupEngine(group), "install_reduce_scatter", entries, per, range(size))
    seen = engine.gather((fingerprint(compressor, per, entries), entries[0].rank, layout,
                          loaded_error(compressor, engine)))
    verdict = next((s[3] for s in seen if s[3] is not None), None) or agreement_error(
        "install_reduce_scatter", [s[0] for s in seen], dist.get_process_group_ranks(group), "shard group")
    for i, (_, rank, other, _) in enumerate(seen):
        if verdict is None and (other != layout or rank != i):
            verdict = (f"install_reduce_scatter: rank {i} of the shard group "
                       f"{dist.get_process_group_ranks(group)} holds shard {rank} of "
                       f"{other[:3]}, this rank (shard {entries[0].rank}) {layout[:3]} (module "
                       f"path, shard size, padded shard shapes): the shard group's ranks must "
                       f"shard the same model in rank order")
    g = entries[0].fsdp_group  # its replicas: HSDP's, or install's (which turned HSDP's off)
    settle(verdict, g.mesh_info.replicate_process_group if isinstance(g.mesh_info, HSDPMeshInfo)
           else getattr(g, "_hvd_gradcomp_replicas", None))
    compressor.codec.bind_engine(engine)
    for e in entries:
        layouts = Layouts(e, per, range(e.size))
        e.module.set_custom_reduce_scatter(_ScatterComm(compressor, group, e.fsdp_group, layouts, e.rank,
                                                        e.size, e.path))
    return compressor
