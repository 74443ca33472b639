"""The engine-neutral entry points of a compressor: what the DDP hook, FSDP and update sync call
instead of Horovod's ``compress``/``decompress`` (any engine that posts the all-reduce itself).

- :meth:`EngineCodec.bind_engine`: the engine's collectives (world, object gather, blocking
  all-reduce) replace Horovod's outside compress.
- :meth:`EngineCodec.encode` / :meth:`EngineCodec.decode`: one tensor under an explicit key,
  no calling frame read; ``decode(divide=n)`` forms a mean in float32 (DDP's).
- :meth:`EngineCodec.linear_decode`: the factor of a cast's decoding, for a fused write.
- :meth:`EngineCodec.decode_joined`: the state step of a rank that contributed zeros (Join).
- :meth:`EngineCodec.decode_scattered`: a reduce-scatter's step of one tensor this rank sent:
  the destination decodes, every sender steps the state from the agreed part only.

A bucket's units: :meth:`~hvd_gradcomp.buckets.Buckets.plan_bucket` and ``encode_unit``. A
mixin of :class:`hvd_gradcomp.adapter.HorovodCompressor` (its ``_compress_one``, state hooks and
``_engine`` slot).
"""
import dataclasses
import logging

from . import composite
from .base import HALF_MAX, EmptyState, finish_tensor, saturate_output
from .calls import Call, scheme_info

__all__ = ["EngineCodec"]

log = logging.getLogger("hvd_gradcomp")


class EngineCodec:
    """The engine-neutral entry points (module docstring)."""

    __slots__ = ()

    def bind_engine(self, engine):
        """Use ``engine``'s collectives outside compress instead of Horovod's.

        Args:
            engine: an :class:`hvd_gradcomp.engine.Engine` (``world() -> (size, rank)``,
                ``gather(obj) -> [obj of rank 0, 1, ...]``, ``allreduce(x, average) -> tensor``
                (blocking); ``post``/``wait`` for the engine's own payloads), e.g.
                ``torch_backend.engine.ProcessGroupEngine(group)``. The world size and rank of
                every tensor, ``state_dict(gather=True)``, the route check and ``calibrate()``
                then follow it.

        Returns self. Raises ValueError if another engine is already bound (a compressor
        belongs to one training run: its state is kept per tensor key).
        """
        if self._engine is not None and self._engine is not engine:
            raise ValueError(f"compressor {self.spec!r} is already bound to {self._engine!r}; each "
                             f"model needs its own compressor (its state is kept per tensor key)")
        self._engine = engine
        return self

    @property
    def engine(self):
        """The engine bound by :meth:`bind_engine`, or None (Horovod's collectives)."""
        return self._engine

    def encode(self, tensor, key: str, op: str = "sum", group=None, label=None):
        """Compress one gradient under an explicit key, for an engine that posts the all-reduce
        itself (no Horovod calling frame is read).

        Args:
            tensor: the gradient (any shape, a float dtype; other dtypes and empty tensors are
                returned as their own payload with ctx None).
            key: its stable identity, equal on every rank (a parameter name, a shard's path).
            op: ``"sum"`` or ``"average"``: how the engine combines the ranks' payloads.
            group: the engine's process group (recorded in the tensor's info; not its identity).
            label: the name routing rules match (default ``key``).

        Returns ``(payload, ctx)``: the engine all-reduces ``payload`` (in its dtype, elementwise,
        with ``op``) and hands the result to :meth:`decode` with ``ctx``. Posts no collective.

        Raises:
            ValueError: what :meth:`compress` refuses (a shape change under one key, a route
                that differs from a loaded checkpoint's, ...), before any collective.
        """
        if op not in ("sum", "average"):
            raise ValueError(f"{self.spec}: encode({key!r}): op must be 'sum' or 'average', got {op!r}")
        if self._is_sparse(tensor):
            raise ValueError(f"{self.spec}: tensor {key!r} has a sparse gradient; all-reduce it "
                             f"uncompressed (or make it dense) instead of encoding it")
        payload, ctx, _ = self._compress_one(tensor, Call(key=key, op=op, process_set=group,
                                                          label=label if label is not None else key))
        return payload, ctx

    def decode(self, payload, ctx, divide=None):
        """The all-reduced ``payload`` of :meth:`encode` mapped back; the tensor's state moves on.

        Args:
            payload: the all-reduced payload (same shape and dtype as encode returned).
            ctx: encode's ctx.
            divide: None: the sum (op ``"sum"``) or mean (``"average"``) in the gradient's dtype,
                as :meth:`decompress`. A number n: the decoded value divided by n in float32
                before the cast to the gradient's dtype (DDP's mean of a sum), so a float16
                gradient's mean is never formed from an overflowing float16 sum; a finite value
                beyond a half dtype's range is clamped and the excess kept in error feedback.
        """
        if divide is None:
            return self.decompress(payload, ctx)
        if ctx is None:
            return payload / divide
        info, inner, scale, scheme = ctx
        sinfo = scheme_info(info, scale)
        has_state = self._has_state(info.key)
        state = self._read_state(info.key) if has_state else EmptyState()
        out, new_state = finish_tensor(scheme, self.ops, payload, inner, state, sinfo, dtype="float32")
        if divide != 1:  # (times 1.0 is the identity: no pass over the output at world size 1)
            out = out * (1.0 / divide)
        if info.dtype in HALF_MAX:  # clamp the mean: each rank keeps the excess (Average's share)
            out, new_state = saturate_output(scheme, self.ops, out, new_state,
                                             dataclasses.replace(sinfo, op="average"), HALF_MAX[info.dtype], scale)
        if scale is not None:
            out = out * scale
        if info.dtype != "float32":
            out = self.ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def linear_decode(self, ctx):
        """The factor ``f`` when decoding ``ctx``'s payload is its float32 cast times ``f`` and
        moves no state (the casts, without a loss scale), so an engine may fuse the cast, the
        scaling and the write into its own buffer; else None."""
        if ctx is None or ctx.scale is not None or self._has_state(ctx.info.key):
            return None
        return composite.decode_factor(ctx.scheme, scheme_info(ctx.info, ctx.scale))

    def decode_joined(self, payload, ctx):
        """The state step of a rank that contributed zeros (DDP's ``Join``): the fields every
        rank agrees on move on from the all-reduced ``payload``, this rank's own fields
        (:attr:`~hvd_gradcomp.base.Scheme.rank_local_fields`: its error feedback) stay as they
        were. Nothing is returned (the joined rank has no gradient to write)."""
        if ctx is None or not self._has_state(ctx.info.key):  # passed through, or stateless
            return
        info, inner, scale, scheme = ctx
        info = scheme_info(info, scale)
        old = self._read_state(info.key)
        _, new = finish_tensor(scheme, self.ops, payload, inner, old, info)
        if new is old:
            return
        local = [f for f in scheme.rank_local_fields if f in new._fields]
        if tuple(new._fields) == tuple(old._fields) and all(
                tuple(self.ops.shape(getattr(old, f))) == tuple(self.ops.shape(getattr(new, f))) for f in local):
            new = new._replace(**{f: getattr(old, f) for f in local})
        else:  # an adaptive scheme changed the tensor's scheme on the agreed figures
            new = new._replace(**{f: 0.0 * getattr(new, f) for f in local})
            if ("joined", info.key) not in self._warned:  # once per tensor and compressor
                self._warned.add(("joined", info.key))
                log.warning("hvd_gradcomp: %s changed scheme while this rank had joined; its pending "
                            "error feedback on this rank is dropped", info.key)
        self._write_state(info.key, new)

    def decode_scattered(self, values, agreed, ctx, divide=None):
        """One tensor's step after a reduce-scatter of its payload (FSDP2's,
        :func:`torch_backend.fsdp.install_reduce_scatter`): every rank sent the tensor; one
        rank, the destination, received the sum of its values; every rank the sum of its
        agreed part.

        Args:
            values: on the destination, the summed values (``payload[:split]``, ``split`` the
                :func:`~hvd_gradcomp.composite.scatter_split` of the tensor's scheme; 1-D, the
                payload's dtype); None on every other rank.
            agreed: the summed agreed part (``payload[split:]``, 1-D, possibly empty), the same
                bit for bit on every rank.
            ctx: :meth:`encode`'s (or ``encode_unit``'s) ctx on this rank.
            divide: as :meth:`decode` (None: the sum; n: divided by n in float32).

        The state steps, on every rank, by ``receive`` and ``finish`` of the payload with its
        values zeroed, so the fields the ranks agree on stay equal everywhere and each rank's
        own fields (error feedback: what it sent of the tensor) move on; the destination
        decompresses the whole payload with the same ``receive`` ctx. A half-precision output
        is clamped as in :meth:`decode`, the destination keeping all of the excess (no other
        rank sees the output). Returns the decoded tensor in the gradient's shape and dtype on
        the destination, else None.

        Raises:
            ValueError: the tensor's scheme has no split (``scatter_split`` None), or ``values``
                is not as long as its split says; before any state moves.
        """
        ops = self.ops
        decode = values is not None
        if ctx is None:  # passed through as it is (none): the payload is the values
            if not decode:
                return None
            return values if divide is None else values / divide
        info, inner, scale, scheme = ctx
        sinfo = scheme_info(info, scale)
        has_state = self._has_state(info.key)
        if not decode and not has_state:
            return None
        state = self._read_state(info.key) if has_state else EmptyState()
        payload = None
        if decode:
            payload = values if ops.shape(agreed)[0] == 0 else ops.concat([values, agreed], 0)
        if not has_state:  # by the contract receive reads the agreed part only
            masked = payload
        else:
            split = self._split_of(scheme, sinfo, ops.shape(agreed)[0], values)
            masked = ops.concat([ops.zeros((split,), ops.dtype(agreed), agreed), agreed], 0) if split else agreed
        inner = scheme.receive(ops, masked, inner, sinfo)
        new_state = scheme.finish(ops, masked, inner, state, sinfo) if has_state else state
        out = None
        if decode:
            out = ops.reshape(scheme.decompress(ops, payload, inner, sinfo), info.shape)
            if divide is not None:
                out = out * (1.0 / divide)
            if info.dtype in HALF_MAX:
                out, new_state = saturate_output(scheme, ops, out, new_state, sinfo, HALF_MAX[info.dtype], scale,
                                                 keep=1.0 if divide is None else float(divide))
            if scale is not None:
                out = out * scale
            if info.dtype != "float32":
                out = ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def _split_of(self, scheme, info, agreed: int, values) -> int:
        """The values' length of ``scheme``'s payload for ``info`` (ValueError where the scheme
        cannot be reduce-scattered, or the parts do not add up)."""
        ops = self.ops
        split = composite.scatter_split(scheme, info)
        if split is None:
            raise ValueError(f"{scheme.spec()}: tensor {info.key!r} cannot be reduce-scattered "
                             f"(hvd_gradcomp.composite.scatter_split)")
        if values is not None and ops.shape(values)[0] != split:
            raise ValueError(f"{scheme.spec()}: tensor {info.key!r}: {tuple(values.shape)[0]} values "
                             f"reduce-scattered, its payload has {split} (and {agreed} agreed)")
        return split
