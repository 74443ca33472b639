"""PyTorch's primitives with every kernel as the core's reference composition, op by op.

:data:`REFERENCE_OPS` implements :class:`hvd_gradcomp.primitives.Primitives` with ``fuse(fn,
plan)`` returning ``fn(REFERENCE_OPS, plan, *tensors)``: no hand-written fused form
(:mod:`torch_backend.kernels`), no compiler. Tests and benchmarks compare the fused forms
against it, and the fused forms fall back on it for the plans they do not cover.
:data:`torch_backend.ops.OPS` is the same table with the fusing ``fuse``.

This module imports neither :mod:`torch_backend.kernels` nor :mod:`torch_backend.ops`, so the
kernel providers can import it (they run the reference compositions through it) without an
import circle.
"""
import torch

from hvd_gradcomp.primitives import Primitives

__all__ = ["REFERENCE_OPS", "to_torch_dtype", "exact_matmul", "exact_addmm", "reduced_fp32",
           "where_tree"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
           "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "bool": torch.bool}


def to_torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a dtype string such as ``"float16"``."""
    return _DTYPES[name]


def _dtype(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _scatter(idx, rows, shape):
    out = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
    return out.index_copy_(0, idx, rows)


def _allreduce(x, op, name, group=None):
    """Blocking side all-reduce that gives up after HVD_GRADCOMP_SIDE_TIMEOUT seconds.

    Horovod matches collectives by name; a rank whose peers never post ``name`` (they called
    compress in another order, or not at all) would wait for ever. Polling the handle lets
    every rank stop with an error that says so.
    """
    import os
    import time
    import horovod.torch as hvd
    hop = {"sum": hvd.Sum, "max": hvd.Max}[op]
    kwargs = {} if group is None else {"process_set": group}
    handle = hvd.allreduce_async(x.contiguous(), op=hop, name=name, **kwargs)
    limit = float(os.environ.get("HVD_GRADCOMP_SIDE_TIMEOUT", "60"))
    deadline, pause = time.monotonic() + limit, 1e-5
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"hvd_gradcomp: blocking side all-reduce {name!r} got no partner for {limit:g} s "
                f"(HVD_GRADCOMP_SIDE_TIMEOUT): the ranks call compress in different orders or not "
                f"at all (unused parameters, rank-dependent graphs, hvd.join). The papers' "
                f"two-round variants need every rank to compress every tensor in the same "
                f"order; use the scheme's default single-collective variant")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return hvd.synchronize(handle)



def _cond(pred, true_fn, false_fn):
    # A Python branch on pred's value: a host read (a device sync when pred is on a GPU).
    return true_fn() if bool(pred) else false_fn()


def where_tree(pred, a, b):
    if a is None:
        return None
    if isinstance(a, tuple):
        parts = [where_tree(pred, x, y) for x, y in zip(a, b)]
        return type(a)(*parts) if hasattr(a, "_fields") else type(a)(parts)
    return torch.where(pred, a, b)


# Per-call overhead counts: a scheme runs ~30-120 small operations per tensor and step, and on
# a CPU each dispatch costs microseconds (2-core VM: a float32 cast to float32 2.6 us, a
# reshape to the same shape 3.9 us, maximum with a scalar made into a tensor 11 us against
# 4.3 us for clamp_min). The primitives below skip what does nothing and take the cheaper op.
def _cast(x, dtype):
    dt = _DTYPES[dtype]
    return x if x.dtype == dt else x.to(dt)


def _scaled_cast(x, factor, dtype):
    dt = _DTYPES[dtype]
    if factor == 1.0:
        return _cast(x, dtype)
    if x.dtype == dt or torch.compiler.is_compiling():
        return (x * factor).to(dt)
    out = torch.empty(x.shape, dtype=dt, device=x.device)
    return torch.mul(x, factor, out=out)  # computed in float32, rounded once to dt on store


def _reshape(x, shape):
    # (Inside torch.compile the comparison would add shape guards: reshape as it is.)
    if not torch.compiler.is_compiling() and tuple(x.shape) == tuple(shape):
        return x
    return x.reshape(shape)


def _bound(scalar_fn, tensor_fn):
    def bound(a, b):
        if isinstance(b, (int, float)) and not isinstance(b, bool) and (
                a.is_floating_point() or isinstance(b, int)):
            return scalar_fn(a, b)  # NaN stays NaN, as with maximum/minimum
        return tensor_fn(a, torch.as_tensor(b, dtype=a.dtype, device=a.device))
    return bound


# A thin product [n, k] x [k, m] (k <= 32) with a large output is how PowerSGD forms its
# outputs and residuals (P Q^T, rank r = k). On a CPU MKL's GEMM runs it at 2-3x the time of
# writing the output once; as a batch of row blocks of the output that fit in cache it runs
# near that bound (timings: docs/bench.md, "PowerSGD"). Outputs below 2**20 elements run as
# fast either way. addmm (the residual M - P Q^T) uses the same blocks, in place.
_THIN_K, _BLOCKED_NUMEL = 32, 1 << 20


def _row_blocks(a, b):
    """Rows per block if ``a @ b`` is thin with a large output on the CPU, else 0."""
    if (a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu" and a.shape[1] <= _THIN_K
            and a.shape[0] * b.shape[1] >= _BLOCKED_NUMEL and not torch.compiler.is_compiling()):
        return 16 if b.shape[1] <= 2048 else 8  # a block's output: 32-64 KiB (measured best)
    return 0


def _matmul(a, b):
    rows = _row_blocks(a, b)
    if not rows:
        return torch.matmul(a, b)
    (n, k), m = a.shape, b.shape[1]
    whole = n - n % rows
    out = torch.empty((n, m), dtype=torch.result_type(a, b), device=a.device)
    torch.bmm(a[:whole].reshape(whole // rows, rows, k), b.expand(whole // rows, k, m),
              out=out[:whole].view(whole // rows, rows, m))
    if whole < n:
        torch.mm(a[whole:], b, out=out[whole:])
    return out


def _addmm(c, a, b, alpha):
    # In place on the caller's temporary c; the same row blocks as _matmul.
    rows = _row_blocks(a, b) if c.is_contiguous() else 0
    if not rows:
        return c.addmm_(a, b, alpha=alpha)
    (n, k), m = a.shape, b.shape[1]
    whole = n - n % rows
    c[:whole].view(whole // rows, rows, m).baddbmm_(
        a[:whole].reshape(whole // rows, rows, k), b.expand(whole // rows, k, m), alpha=alpha)
    if whole < n:
        c[whole:].addmm_(a[whole:], b, alpha=alpha)
    return c


def reduced_fp32(cuda: bool) -> bool:
    """True where PyTorch may run a float32 product below full float32 precision on this
    device: TF32 (10-bit mantissas) on a GPU, bfloat16 or TF32 through oneDNN on a CPU.

    Read-only. PyTorch >= 2.9: the per-backend ``fp32_precision`` (``cuda.matmul``, or
    ``mkldnn.matmul`` then ``mkldnn``), then ``torch.backends.fp32_precision``; the first that
    is not ``"none"`` decides, reduced unless ``"ieee"``. The legacy setters
    (``torch.set_float32_matmul_precision``, ``torch.backends.cuda.matmul.allow_tf32``) write
    these too. The legacy *getters* are never called: PyTorch raises from them once the new API
    has been used (its consistency check). Older PyTorch: ``allow_tf32`` on a GPU,
    ``get_float32_matmul_precision() == "medium"`` on a CPU.
    """
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):
        chain = (backends.cuda.matmul,) if cuda else (backends.mkldnn.matmul, backends.mkldnn)
        for node in chain + (backends,):
            precision = node.fp32_precision
            if precision != "none":
                return precision != "ieee"
        return False
    if cuda:
        return bool(backends.cuda.matmul.allow_tf32)
    return torch.get_float32_matmul_precision() == "medium"


def _float64_product(a, b):
    return _matmul(a.to(torch.float64), b.to(torch.float64))


def exact_matmul(a, b, force=False):
    """``ops.matmul`` with float32 products in full precision, whatever the user chose.

    The user's TF32 (``torch.set_float32_matmul_precision("high")``, ``allow_tf32``,
    ``fp32_precision = "tf32"``) or bfloat16 (``"medium"`` on CPUs with oneDNN) setting would
    round the codecs' products: THC's rotation round trip and PowerSGD's orthogonalisation need
    float32 (TF32 leaves a 4e-4 error in ``irht(rht(x))``). Where :func:`reduced_fp32` says
    the setting is reduced (or ``force``: the compiled kernels' exact variant,
    :func:`_fuse_compiled`), float32 operands are multiplied in float64 and the product
    rounded to float32 once (at least as exact as an IEEE float32 product); otherwise the
    product is the plain one. Nothing global is changed, so the user's setting is never
    altered, not even for a moment: products on Gloo's or DDP's callback threads can run
    while the user's threads run theirs, and no mix of PyTorch's legacy and new precision APIs
    is ever made here, so its consistency check raises in our products only where it raises
    in the user's own (issue 35; saving and restoring the setting around each product broke
    both: a user's legacy ``allow_tf32`` against our new-API ``"ieee"`` is such a mix). Cost, only under a reduced setting: two
    casts in, one out and a float64 product (on an H100/H200 about float32's throughput, on
    CPUs about half). Shapes and errors as ``torch.matmul``.
    """
    if a.dtype == torch.float32 and b.dtype == torch.float32 and (
            force or (not torch.compiler.is_compiling() and reduced_fp32(a.is_cuda))):
        return _float64_product(a, b).to(torch.float32)
    return _matmul(a, b)


def exact_addmm(c, a, b, alpha, force=False):
    """``ops.addmm`` (``c + alpha * a @ b``, in place on ``c``) with the product exact as in
    :func:`exact_matmul` (there: the float64 product rounded to ``c``'s dtype, then added)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32 and (
            force or (not torch.compiler.is_compiling() and reduced_fp32(a.is_cuda))):
        return c.add_(_float64_product(a, b).to(c.dtype), alpha=alpha)
    return _addmm(c, a, b, alpha)


def _select(pred, true_fn, false_fn):
    # A CPU pred is read for free; on a GPU reading it would sync, so both run and are blended.
    if pred.device.type == "cpu":
        return true_fn() if bool(pred) else false_fn()
    return where_tree(pred, true_fn(), false_fn())



def _fuse_reference(fn, plan):
    """``Primitives.fuse`` of :data:`REFERENCE_OPS`: ``fn(REFERENCE_OPS, plan, *tensors)``."""
    return lambda *tensors: fn(REFERENCE_OPS, plan, *tensors)


REFERENCE_OPS = Primitives(
    name="torch",
    shape=lambda x: tuple(x.shape),
    dtype=_dtype,
    reshape=_reshape,
    concat=lambda xs, axis: torch.cat(xs, axis),
    transpose=lambda x, perm: x.permute(perm),
    zeros=lambda shape, dtype, like: torch.zeros(
        shape, dtype=_DTYPES[dtype], device=None if like is None else like.device),
    arange=lambda n, dtype, like: torch.arange(
        n, dtype=_DTYPES[dtype], device=None if like is None else like.device),
    constant=lambda value, dtype, like: torch.tensor(
        value, dtype=_DTYPES[dtype], device=None if like is None else like.device),
    cast=_cast,
    scaled_cast=_scaled_cast,
    abs=torch.abs,
    sqrt=torch.sqrt,
    floor=torch.floor,
    round=torch.round,
    log2=torch.log2,
    exp2=torch.exp2,
    minimum=_bound(torch.clamp_max, torch.minimum),
    maximum=_bound(torch.clamp_min, torch.maximum),
    clip=lambda x, lo, hi: torch.clamp(x, lo, hi),
    where=lambda c, a, b: torch.where(c, a, b),
    isfinite=torch.isfinite,
    logical_and=torch.logical_and,
    sum=lambda x, axis: x.sum() if axis is None else x.sum(axis),
    max=lambda x, axis: x.max() if axis is None else x.amax(axis),
    all=lambda x, axis: x.all() if axis is None else x.all(axis),
    # count_nonzero, not a sum of the mask: 3-4x faster on CPU (docs/bench.md, "THC")
    count=lambda x, axis: torch.count_nonzero(x) if axis is None else torch.count_nonzero(x, dim=axis),
    norm=lambda x, axis: torch.linalg.vector_norm(x, dim=axis),
    matmul=exact_matmul,
    addmm=exact_addmm,
    top_k=lambda x, k: torch.topk(x, k, sorted=True).indices,
    argsort=lambda x: torch.sort(x, descending=True, stable=True).indices,
    gather=lambda x, idx: x.index_select(0, idx),
    scatter=_scatter,
    index_add=lambda x, idx, rows: x.index_add_(0, idx, rows),
    bitcast=lambda x, dtype: x.view(_DTYPES[dtype]),
    bitwise_and=torch.bitwise_and,
    bitwise_or=torch.bitwise_or,
    bitwise_xor=torch.bitwise_xor,
    left_shift=torch.bitwise_left_shift,
    right_shift=torch.bitwise_right_shift,
    cond=_cond,
    select=_select,
    # Looked up at call time, so a harness can time it by patching reference_ops._allreduce.
    allreduce=lambda x, op, name, group=None: _allreduce(x, op, name, group),
    fuse=_fuse_reference,
    to_host=lambda x: x.detach().cpu().tolist(),
    eager=lambda: True,
)

# The primitives with every kernel as the core's reference composition, op by op: no
# hand-written fused form (torch_backend.kernels), no compiler. Tests and benchmarks compare
