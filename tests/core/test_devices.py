"""Device-correct codecs (issue 26): each scheme on the CPU and on CUDA (``device`` fixture,
skipped with the reason where there is none), no host reads or host-to-device constants on any
default step, no synchronising call under ``torch.cuda.set_sync_debug_mode("error")``, and
codec products in full float32 whatever the user's TF32/bfloat16 matmul setting.

Host reads are counted on the CPU by wrapping every ``torch.Tensor`` method that moves a
value to the host (``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__float__``,
``__int__``, ``__index__``) and every ``ops.constant`` built on a tensor's device (a host-to-
device copy on a GPU), with ``ops.select`` taking its GPU branch (both sides blended): what a
step would do on a GPU, counted on a machine without one.
"""
import dataclasses

import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import one_rank
from tests.backends import BACKENDS, as_float64, backend_tensor, scheme_of, missing_device

# Every scheme's default path (and PowerSGD's float16 vectors); a (64, 48) matrix for PowerSGD.
SPECS = ("fp16", "bf16", "topk", "topkc", "thc", "powersgd", "powersgd:rank=2")
SHAPE = (64, 48)
STEPS = 3


def _ops(backend):
    if backend == "torch":
        from torch_backend.ops import OPS
    else:
        from tf_backend.ops import OPS
    return one_rank(OPS)


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE) * (1 + 9 * (np.arange(SHAPE[1]) % 7 == 0)) for _ in range(STEPS)]


def _steps(ops, scheme, backend, device, info, grads):
    """STEPS steps of one rank (its payload is the all-reduce): [(payload, out)], final state."""
    xs = [backend_tensor(backend, g, device=device) for g in grads]
    state = scheme.init(ops, info, xs[0])
    outs = []
    for x in xs:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        outs.append((payload, out))
    return outs, state


def _info(spec):
    return TensorInfo(f"dev.{spec}", SHAPE, "float32", 1, 0, "average")


def _device_of(backend, t):
    if backend == "torch":
        return t.device.type
    return "cuda" if "GPU" in t.device.upper() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_on_device(backend, spec, device):
    """Three steps on ``device`` give the CPU's payloads and outputs (THC: to its stochastic
    rounding's edge cases), and every state tensor lives on the gradient's device."""
    ops, scheme, info, grads = _ops(backend), scheme_of(spec), _info(spec), _grads()
    outs, state = _steps(ops, scheme, backend, device, info, grads)
    ref, _ = _steps(ops, scheme_of(spec), backend, "cpu", info, grads)
    tol = 1e-3 if spec == "thc" else 1e-5
    for (p, out), (p_ref, out_ref) in zip(outs, ref):
        assert _device_of(backend, out) == device and _device_of(backend, p) == device
        a, b = as_float64(out), as_float64(out_ref)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b) + 1e-30, spec
    for field, t in zip(state._fields, state):
        assert _device_of(backend, t) == device, (spec, field)
    g = np.sum(grads, 0)
    sent = np.sum([as_float64(o) for _, o in outs], 0).reshape(SHAPE)
    if spec in ("fp16", "bf16"):  # unbiased casts: the output is the gradient, rounded
        assert np.linalg.norm(sent - g) <= 1e-2 * np.linalg.norm(g)


class _HostReads:
    """Counts host reads of torch tensors and device constants while active (module docstring)."""

    METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        import torch
        self.reads = []
        self.active = False
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            if self.active:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)
        return counted

    def gpu_ops(self, ops):
        """``ops`` as a GPU runs them: select blends both branches; device constants counted."""
        from torch_backend.ops import _where_tree
        constant = ops.constant

        def counted_constant(value, dtype, like):
            if self.active and like is not None:
                self.reads.append("constant")
            return constant(value, dtype, like)
        return dataclasses.replace(ops, select=lambda pred, t, f: _where_tree(pred, t(), f()),
                                   constant=counted_constant)

    def patch_kernels(self, monkeypatch, ops):
        """Fused kernels run with the module's ``OPS`` (torch_backend.ops._fuse_eager): count there too."""
        import torch_backend.ops as module
        monkeypatch.setattr(module, "OPS", ops)


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("spec", SPECS + ("topkc:payload_dtype=float16", "thc:bits=2", "powersgd:uncompressed_dtype=float16"))
def test_no_host_reads_on_default_steps(spec, monkeypatch):
    """No value reaches the host, and no host constant reaches the device, in any step of a
    default path (counted on the CPU, as a GPU would run it: module docstring)."""
    counter = _HostReads(monkeypatch)
    ops = counter.gpu_ops(_ops("torch"))
    counter.patch_kernels(monkeypatch, ops)
    scheme, info = scheme_of(spec), _info(spec)
    xs = [backend_tensor("torch", g) for g in _grads()]
    state = scheme.init(ops, info, xs[0])
    counter.active = True
    for x in xs:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    counter.active = False
    assert counter.reads == [], (spec, counter.reads)


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
def test_host_read_counter_sees_reads(monkeypatch):
    """The counter above is not blind: a read and a device constant are both counted."""
    import torch
    counter = _HostReads(monkeypatch)
    ops = counter.gpu_ops(_ops("torch"))
    x = torch.ones(3)
    counter.active = True
    bool(x.sum() > 0), x.max().item(), ops.constant([1, 2], "int32", x)
    counter.active = False
    assert counter.reads == ["__bool__", "item", "constant"]


@pytest.mark.parametrize("spec", SPECS)
def test_no_sync_on_cuda(spec):
    """Under ``torch.cuda.set_sync_debug_mode("error")`` every default step runs on CUDA
    without a synchronising call (a host read, a blocking copy)."""
    if "torch" not in BACKENDS:
        pytest.skip("PyTorch backend not under test")
    why = missing_device("torch", "cuda")
    if why:
        pytest.skip(why)
    import torch
    ops, scheme, info = _ops("torch"), scheme_of(spec), _info(spec)
    xs = [backend_tensor("torch", g, device="cuda") for g in _grads()]
    state = scheme.init(ops, info, xs[0])
    compress_tensor(scheme, ops, xs[0], state, info)  # first call: one-time set-up allowed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
def test_torch_codec_products_ignore_reduced_precision(device):
    """With the user's matmul precision at "medium" (bfloat16 products on CPUs with oneDNN,
    TF32 on GPUs) THC's rotation and PowerSGD's orthogonalisation stay float32-exact, and the
    user's setting is what it was afterwards."""
    import torch
    from torch_backend.ops import OPS
    a = torch.randn(256, 256, dtype=torch.float64).to(device)
    b = torch.randn(256, 256, dtype=torch.float64).to(device)
    ref = (a @ b).cpu().numpy()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        raw = (a.float() @ b.float()).double().cpu().numpy()
        ours = OPS.matmul(a.float(), b.float()).double().cpu().numpy()
        c = torch.zeros(256, 256, device=device)
        ours_addmm = OPS.addmm(c, a.float(), b.float(), -1.0).double().cpu().numpy()
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-5 * scale
    assert np.abs(ours_addmm + ref).max() <= 1e-5 * scale
    if np.abs(raw - ref).max() <= 1e-5 * scale:
        pytest.skip(f"this {device} computes 'medium' float32 products in full precision anyway "
                    f"(the pin was exercised, its effect not observable)")
    # THC's rotation round trip (Walsh-Hadamard products) under the reduced setting.
    from hvd_gradcomp import hadamard
    ops = one_rank(OPS)
    x = torch.randn(4096, device=device)
    torch.set_float32_matmul_precision("medium")
    try:
        diag = hadamard.rademacher(ops, 7, 4096, x, 1.0 / 32)
        factors = hadamard.hadamard_factors(ops, 1024, x)
        back = hadamard.irht(ops, hadamard.rht(ops, x, diag, factors), diag, factors)
    finally:
        torch.set_float32_matmul_precision(before)
    assert float((back - x).abs().max()) <= 2e-6 * float(x.abs().max())


def _tf32(x):
    """Round float32 ``x`` to TF32 (10 mantissa bits, nearest even), as a GPU's tensor core
    rounds matmul operands; NumPy, host side."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    keep = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return keep.astype(np.uint32).view(np.float32)


@pytest.mark.skipif("tensorflow" not in BACKENDS, reason="TensorFlow backend not under test")
def test_tf32_split_matmul_is_float32_accurate_under_tf32():
    """TensorFlow's TF32 switch is global and read at run time, so its codec products are
    split in three TF32-exact products (tf_backend.ops._matmul). Emulating TF32 rounding of
    every product's operands: a plain product errs ~1e-3 relative, the split ~1e-6."""
    import tensorflow as tf
    from tf_backend.ops import tf32_split
    rng = np.random.default_rng(3)
    a = rng.standard_normal((128, 96)).astype(np.float32)
    b = rng.standard_normal((96, 64)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ah, al = (np.asarray(t) for t in tf32_split(tf.constant(a)))
    bh, bl = (np.asarray(t) for t in tf32_split(tf.constant(b)))
    np.testing.assert_array_equal(ah + al, a)
    np.testing.assert_array_equal(_tf32(ah), ah)  # the high parts are TF32-exact

    def mm(x, y):  # a TF32 product: operands rounded, float32-like accumulation
        return _tf32(x).astype(np.float64) @ _tf32(y).astype(np.float64)
    plain = np.abs(mm(a, b) - ref).max() / np.abs(ref).max()
    split = np.abs(mm(ah, bh) + mm(ah, bl) + mm(al, bh) - ref).max() / np.abs(ref).max()
    assert plain > 1e-4 and split < 2e-6, (plain, split)
