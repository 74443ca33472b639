"""The optional hooks a scheme may add to its lifecycle, for composites, checkpoints and reports.

A scheme's contract is its lifecycle (:class:`~hvd_gradcomp.base.Scheme`: ``init``,
``compress``, ``receive``, ``decompress``, ``finish``, ``wire`` and the flags). Beyond it,
the composites (``auto``, :mod:`hvd_gradcomp.auto`, which changes a tensor's scheme between
steps; the FP16 warm-up, :mod:`hvd_gradcomp.warmup`), the adapters' checkpoints
(:mod:`hvd_gradcomp.records`, :mod:`hvd_gradcomp.checkpoint`) and the half-precision output
(:func:`~hvd_gradcomp.base.finish_tensor`) ask a scheme a few more things. Each question is a
function here, ``hook(scheme, ...)``: when the scheme defines a method of the same name
(without the ``scheme`` argument) the function calls it, otherwise it answers with the default
below. Call these functions, never the methods: a scheme without an override has none.

A scheme overrides a hook only where the default is wrong for it:

- :func:`residual_of` / :func:`add_residual`: error feedback kept in another basis than the
  gradient's flat order (THC: rotated and padded), or none at all (EF21 keeps an estimate).
- :func:`payload_dtype`: any payload that is not float32.
- :func:`hand_over`: state seeded from the last FP16 warm-up step (TopKC's scores, EF21).
- :func:`init_like`, :func:`forget`, :func:`check_loaded`: state whose fields change between
  steps (``auto``), counters mirrored on the host, an old state format to refuse (PowerSGD).
- :func:`metrics`: diagnostics to report.
- :func:`carry_over`: a new bucket group's state from its tensors' earlier holders (the FP16
  warm-up's step count).
- :func:`decompress_into`: a fused decode that folds an engine's divide into its own pass and
  writes into the engine's buffer (signSGD), so no multiply or copy follows it.
- :func:`decode_factor`: decoding is the payload's cast times a constant (the casts), so an
  engine may fuse the cast, the scaling and the write into its buffer.
- :func:`sent_zeros`: ``decompress``/``finish`` read this rank's own sent words from the ctx
  (THC's and SparseLoCo's ``subtract_own``), so a rank that sent zeros instead (DDP's
  ``Join`` under the delayed hook) must decode with those words zeroed.
- :func:`scatter_split`: the payload is a values part that only ``decompress`` reads and an
  agreed part, summed exactly, that is all ``receive`` and ``finish`` read, so an engine may
  reduce-scatter it (FSDP2's reduce-scatter, :mod:`torch_backend.fsdp`).

This module imports nothing of the package (:mod:`~hvd_gradcomp.base` imports it).
"""

import inspect

__all__ = ["residual_of", "residual_field", "add_residual", "payload_dtype", "hand_over", "init_like",
           "forget", "check_loaded", "loaded_fields", "metrics", "decompress_into", "decode_factor", "carry_over", "scatter_split",
           "sent_zeros", "own_zeroed", "blocks",
           "HOOKS", "check_hooks"]

# Each hook's method, as a scheme defines it: name -> its arguments after ``self``.
HOOKS = {
    "residual_of": ("ops", "state", "info"),
    "add_residual": ("ops", "state", "info", "residual"),
    "payload_dtype": ("info",),
    "hand_over": ("ops", "state", "own", "aggregate", "info"),
    "init_like": ("ops", "info", "like", "loaded"),
    "forget": ("key",),
    "check_loaded": ("key", "loaded"),
    "metrics": ("state",),
    "decompress_into": ("ops", "payload", "ctx", "info", "factor", "into"),
    "decode_factor": ("info",),
    "carry_over": ("ops", "state", "olds", "info"),
    "scatter_split": ("info",),
    "sent_zeros": ("ops", "ctx"),
}


def _hook(scheme, name):
    return getattr(scheme, name, None)


def check_hooks(scheme_cls):
    """Raise TypeError, naming the hook and the arguments it is called with, if
    ``scheme_cls`` has an attribute of a hook's name (:data:`HOOKS`) that is not a method
    taking those arguments positionally; the functions here would otherwise fail only when a
    composite or a checkpoint first asks (``auto`` switching scheme, a load, ``metrics()``).
    Called by :func:`~hvd_gradcomp.registry.register` and for the catalogue."""
    for name, args in HOOKS.items():
        attr = inspect.getattr_static(scheme_cls, name, None)
        if attr is None:
            continue
        expected = f"{scheme_cls.__name__}.{name}(self, {', '.join(args)})"
        func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if not inspect.isfunction(func):
            raise TypeError(f"{scheme_cls.__name__}.{name} is a {type(attr).__name__}, and "
                            f"hvd_gradcomp.composite calls it as the hook {expected}; rename it")
        bound = (None,) * (len(args) + (not isinstance(attr, staticmethod)) - isinstance(attr, classmethod))
        try:
            inspect.signature(func).bind(*bound)
        except TypeError:
            raise TypeError(f"{scheme_cls.__name__}.{name}{inspect.signature(func)}: "
                            f"hvd_gradcomp.composite calls this hook as {expected}") from None


def residual_of(scheme, ops, state, info):
    """This rank's pending error feedback in the gradient's own coordinates: float32
    ``[numel]`` (what the next steps will still send), or None when the state keeps none.

    Called by ``auto`` to flush the residual into an exact step before it changes scheme, and
    to measure each candidate's error; by the tests to check error feedback. Default:
    :func:`residual_field`. Override when the residual is kept in another basis (THC) or the
    ``residual`` field means something else.
    """
    hook = _hook(scheme, "residual_of")
    return hook(ops, state, info) if hook is not None else residual_field(scheme, ops, state, info)


def residual_field(scheme, ops, state, info):
    """The default of :func:`residual_of`: the state's ``residual`` field, flattened to
    float32 ``[numel]``, when it holds ``numel`` values in the tensor's flat order (TopK,
    TopKC, PowerSGD's plain 2-D reshape); None when the state has no such field or it is empty.

    Raises:
        NotImplementedError: the field holds another number of values than ``info.numel``
            (the scheme must override ``residual_of``).
    """
    residual = getattr(state, "residual", None)
    if residual is None:
        return None
    n = 1
    for s in ops.shape(residual):
        n *= s
    if n == 0:
        return None
    if n != info.numel:
        raise NotImplementedError(f"{scheme.name}: residual of {n} values for a tensor of "
                                  f"{info.numel}; override residual_of")
    return ops.reshape(residual, (info.numel,))


def add_residual(scheme, ops, state, info, residual):
    """``state`` with ``residual`` (float32 ``[numel]``, the gradient's own coordinates) added
    to its pending error feedback, or None when the state keeps none (the caller must then
    send ``residual`` itself).

    Called by ``auto`` to carry error feedback over a change of scheme, and by
    :func:`~hvd_gradcomp.base.finish_tensor` to keep what a half-precision output could not
    hold. Default: the sum with :func:`residual_of`, written back into the ``residual`` field
    in its own shape. Override with :func:`residual_of` (THC rotates ``residual`` into its
    basis).
    """
    hook = _hook(scheme, "add_residual")
    if hook is not None:
        return hook(ops, state, info, residual)
    current = residual_of(scheme, ops, state, info)
    if current is None:
        return None
    return state._replace(residual=ops.reshape(current + residual, ops.shape(state.residual)))


def payload_dtype(scheme, info) -> str:
    """The dtype of the payload Horovod all-reduces for ``info``. Called by ``auto``, which
    prices float16 sums apart (Gloo adds them in scalar code). Default ``"float32"``."""
    hook = _hook(scheme, "payload_dtype")
    return hook(info) if hook is not None else "float32"


def hand_over(scheme, ops, state, own, aggregate, info):
    """The state for the first compressed step after an FP16 warm-up, from the last FP16
    step: ``own`` (float32 [numel], this rank's gradient as decoded) and ``aggregate``
    (float32 [numel], the all-reduced one, the same on every rank; sum or mean as the
    reduction). Called once per tensor by :mod:`hvd_gradcomp.warmup`. An override must derive
    what ranks agree on from ``aggregate`` only. Default: ``state`` unchanged."""
    hook = _hook(scheme, "hand_over")
    return hook(ops, state, own, aggregate, info) if hook is not None else state


def init_like(scheme, ops, info, like, loaded):
    """The fresh state a loaded state (``loaded``: a NamedTuple-like with ``_fields``) must
    match in fields and shapes, on ``like``'s device. Called by the adapters when a checkpoint
    is loaded. Default: ``scheme.init(ops, info, like)``; ``adaptive`` schemes override it
    (``auto``: the fields of the loaded state's choice)."""
    hook = _hook(scheme, "init_like")
    return hook(ops, info, like, loaded) if hook is not None else scheme.init(ops, info, like)


def forget(scheme, key: str):
    """Tell ``scheme`` that the state under ``key`` was replaced by a loaded one. Called by the
    adapters at each load. Default: nothing; schemes that mirror state on the host (``auto``'s
    counters, the warm-up's step count) drop the mirror."""
    hook = _hook(scheme, "forget")
    if hook is not None:
        hook(key)


def check_loaded(scheme, key: str, loaded):
    """Raise ValueError, naming the reason, if ``loaded`` (a tensor's saved state: a
    NamedTuple-like with ``_fields``, or a dict) was written in a format ``scheme`` no longer
    reads. Called by the adapters before their own checks of fields and shapes. Default:
    accept."""
    hook = _hook(scheme, "check_loaded")
    if hook is not None:
        hook(key, loaded)


def loaded_fields(loaded) -> dict:
    """``{field: value}`` of a tensor's saved state as :func:`check_loaded` gets it (a dict, or a
    NamedTuple-like with ``_fields``): what a scheme's ``check_loaded`` hook reads."""
    if isinstance(loaded, dict):
        return dict(loaded)
    return dict(zip(getattr(loaded, "_fields", ()), loaded))


def metrics(scheme, state) -> dict:
    """Per-tensor diagnostics read from ``state``: ``{name: tensor}`` (no host sync), e.g.
    TopKC's ``realigned`` count. Called by the adapters' ``metrics()``. Default: ``{}``."""
    hook = _hook(scheme, "metrics")
    return hook(state) if hook is not None else {}


def carry_over(scheme, ops, state, olds, info):
    """A new bucket group's fresh ``state`` with what its tensors' earlier holders agreed on
    that a fresh state would lose (``olds``: ``[(key, state)]`` of the groups or per-tensor
    states the group takes its tensors from, after DDP's bucket rebuild; every rank has the
    same). Called by :mod:`hvd_gradcomp.buckets` once per new group; error feedback moves
    apart. Default: ``state`` (agreed fields such as TopKC's scores restart, equally on every
    rank); the FP16 warm-up keeps its step count."""
    hook = _hook(scheme, "carry_over")
    return hook(ops, state, olds, info) if hook is not None else state


def decompress_into(scheme, ops, payload, ctx, info, factor=1.0, into=None):
    """``scheme.decompress`` times ``factor`` (a Python float; the product rounded after the
    decoded value, as one multiply after it), possibly written into ``into``.

    ``into``: None, or a flat float32 tensor of ``info.numel`` values (an engine's bucket slice)
    that the scheme may write the result into and return, viewed in ``info.shape`` or flat; a
    backend or scheme that cannot returns a new tensor, and the caller copies it (the engines
    compare storage). Called by :func:`~hvd_gradcomp.base.finish_tensor` for
    :meth:`~hvd_gradcomp.codec.Codec.decode`'s ``divide`` (``factor = 1 / divide``).
    Default: ``decompress``, then the multiply unless ``factor`` is 1 (``into`` unused)."""
    hook = _hook(scheme, "decompress_into")
    if hook is not None:
        return hook(ops, payload, ctx, info, factor, into)
    out = scheme.decompress(ops, payload, ctx, info)
    return out * factor if factor != 1.0 else out


def decode_factor(scheme, info):
    """The factor ``f`` when ``scheme.decompress`` is ``cast(payload, float32) * f`` and keeps no
    state (the casts: fp16's ``info.unscale``, 1 for bf16 and ``none:dtype=float32``), else None.
    Called by the DDP hook, which then writes ``payload * f / n`` into the bucket in one pass.
    Default: None."""
    hook = _hook(scheme, "decode_factor")
    return hook(info) if hook is not None else None


def sent_zeros(scheme, ops, ctx):
    """``scheme``'s compress ``ctx`` as a rank that sent a zero payload instead of its own holds
    it: a joined rank under DDP's ``Join`` posts zeros but decodes the mean its peers decode
    (:mod:`torch_backend.ddp_delayed`), so whatever of its own sent words the ctx keeps for
    ``receive``/``decompress``/``finish`` to take off the sum (THC's and SparseLoCo's ``own``
    under ``subtract_own``) must be zeros. Default: ``ctx`` itself (the ctx keeps no sent words)."""
    hook = _hook(scheme, "sent_zeros")
    return hook(ops, ctx) if hook is not None else ctx


def own_zeroed(ctx):
    """``ctx`` with its ``own`` field (this rank's sent level words, taken off the sum under
    ``subtract_own``) zeroed, or ``ctx`` itself where it keeps none: THC's and SparseLoCo's
    :func:`sent_zeros` hook."""
    return ctx if ctx.own is None else ctx._replace(own=ctx.own * 0)


def scatter_split(scheme, info):
    """Where ``scheme``'s payload for ``info`` splits for a reduce-scatter: ``v`` (an int) when

    - ``payload[:v]`` (the *values*) is read by ``decompress`` only, and sums elementwise;
    - ``payload[v:]`` (the *agreed part*: statistics, control words) and ``receive``'s and
      ``compress``'s ctx are all that ``receive`` and ``finish`` read; its sums are exact
      (integers), so every copy of it is the same bit for bit whatever order a collective
      adds them in;
    - a state stepped by ``receive`` and ``finish`` on the payload with its values zeroed is
      the state every rank must hold (the casts: no state, or fp16's agreed scale kept as it
      was, i.e. ``1/n``).

    A reduce-scatter then sends each destination's values and every tensor's agreed part, so
    every rank steps the state of every tensor it sent while only the destination decodes
    (:func:`~hvd_gradcomp.scattered.decode_scattered`). None (the default): the
    scheme cannot be reduce-scattered (float agreed fields whose copies a reduce-scatter would
    round differently: TopKC's scores, PowerSGD's factors; the whole payload read by
    ``finish``: TopK; ``auto``, the warm-up, blocking variants). Called by
    :func:`torch_backend.fsdp.install_reduce_scatter` (at install, and per tensor)."""
    hook = _hook(scheme, "scatter_split")
    return hook(info) if hook is not None else None


def blocks(scheme, info) -> bool:
    """True if ``scheme``'s compress posts a blocking side collective for ``info``'s tensor
    (the ``blocking`` variants, except on the tensors they send uncompressed): the flag and
    ``wire``, not a hook. Called by the adapters, which refuse such a scheme on a tensor
    Horovod fills in."""
    return scheme.blocking and scheme.wire(info).side_collectives > 0
