"""Device-correct codecs (issue 26): each scheme on the CPU and on CUDA (``device`` fixture,
skipped with the reason where there is none), no host reads or host-to-device constants on any
default step, no synchronising call under ``torch.cuda.set_sync_debug_mode("error")``, each
steady step captured in a CUDA graph and replayed equal to eager, deterministic mode, and
codec products in full float32 whatever the user's TF32/bfloat16 matmul setting, on several
threads and compiled too (issue 35). The CUDA parameters run in the GPU check
(``make gpu-check``, docs/gpu.md).

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
from tests.backends import BACKENDS, as_float64, backend_tensor, missing_device, requires_backend, scheme_of

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
        from torch_backend.reference_ops import where_tree
        constant = ops.constant

        def counted_constant(value, dtype, like):
            if self.active and like is not None:
                self.reads.append("constant")
            return constant(value, dtype, like)
        return dataclasses.replace(ops, select=lambda pred, t, f: where_tree(pred, t(), f()),
                                   constant=counted_constant)

    def patch_kernels(self, monkeypatch, ops):
        """Fused kernels run with the module's ``OPS`` (torch_backend.ops._fuse_eager, the eager reference of ops.fuse): count there too."""
        import torch_backend.ops as module
        monkeypatch.setattr(module, "OPS", ops)


# Every scheme variant whose steady step must not read the host (the GPU check runs each under
# torch.cuda.set_sync_debug_mode("error"), captures it in a CUDA graph and runs it in
# deterministic mode).
VARIANTS = SPECS + ("topkc:payload_dtype=float16", "thc:bits=2", "powersgd:uncompressed_dtype=float16", "signsgd")


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("spec", VARIANTS)
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


def _auto_host_reads(monkeypatch, dtype, steps=12):
    """Host reads of ``auto`` (fp16|bf16, neither keeps error feedback) over ``steps`` steps
    of a ``dtype`` gradient, counted as in :func:`test_no_host_reads_on_default_steps`."""
    counter = _HostReads(monkeypatch)
    ops = counter.gpu_ops(_ops("torch"))
    counter.patch_kernels(monkeypatch, ops)
    scheme = scheme_of("auto:candidates=fp16|bf16,bandwidth_gbit=1,latency_ms=0.1,warmup=2,every=4").bind(ops)
    info = TensorInfo("dev.auto", SHAPE, dtype, 1, 0, "average")
    grads = [backend_tensor("torch", g, dtype) for g in _grads() * (steps // STEPS)]
    state = scheme.init(ops, info, grads[0])
    counter.active = True
    for x in grads:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        _, state = finish_tensor(scheme, ops, payload, ctx, state, info, dtype=dtype)
    counter.active = False
    return counter.reads


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_half_gradients_add_no_host_reads(dtype, monkeypatch):
    """Issue 35, risk 5: ``auto`` reads the host at its decision steps only; a half-precision
    gradient adds no read (it added one per tensor and step, to see whether its saturated
    output owed a carry), and no carry appears in its state."""
    from hvd_gradcomp import composite
    full = _auto_host_reads(monkeypatch, "float32")
    half = _auto_host_reads(monkeypatch, dtype)
    assert len(full) > 0 and half == full, (full, half)
    ops = _ops("torch")
    scheme = scheme_of("auto:candidates=fp16|bf16,bandwidth_gbit=1,latency_ms=0.1").bind(ops)
    info = TensorInfo("dev.auto", SHAPE, dtype, 1, 0, "average")
    x = backend_tensor("torch", _grads()[0], dtype)
    state = scheme.init(ops, info, x)
    for _ in range(2):  # stepped: a residual of a half output makes no carry (a fresh state not
        # stepped yet takes moved-in error feedback as one: auto/group.py)
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        _, state = finish_tensor(scheme, ops, payload, ctx, state, info, dtype=dtype)
        assert "carry" not in state._fields
    assert composite.add_residual(scheme, ops, state, info, ops.zeros((info.numel,), "float32", None)) is None


@pytest.mark.parametrize("spec", VARIANTS)
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


def _same(a, b):
    """``a`` and ``b`` (tensors, or named tuples of tensors and None) equal bit for bit."""
    import torch
    if a is None or b is None:
        return a is b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("spec", VARIANTS)
def test_cuda_graph_replay_equals_eager(spec):
    """A whole steady codec step (compress, the one-rank all-reduce, decompress, finish)
    captured in a CUDA graph after two warm-up steps (first-call set-up, allocator), replayed
    on a new gradient copied into the captured input: its payload, output and next state equal
    the eager step's from the same state, bit for bit. A host read or sync inside the step
    fails the capture."""
    why = missing_device("torch", "cuda")
    if why:
        pytest.skip(why)
    import torch
    ops, scheme, info = _ops("torch"), scheme_of(spec), _info(spec)
    xs = [backend_tensor("torch", g, device="cuda") for g in _grads()]
    state = scheme.init(ops, info, xs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs[:2]:
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    torch.cuda.current_stream().wait_stream(side)
    static_x = xs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        payload, ctx = compress_tensor(scheme, ops, static_x, state, info)
        out, after = finish_tensor(scheme, ops, payload, ctx, state, info)
    static_x.copy_(xs[2])
    graph.replay()
    ref_payload, ref_ctx = compress_tensor(scheme, ops, xs[2], state, info)
    ref_out, ref_after = finish_tensor(scheme, ops, ref_payload, ref_ctx, state, info)
    torch.cuda.synchronize()
    assert _same(payload, ref_payload) and _same(out, ref_out), spec
    assert _same(after, ref_after), spec


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("spec", VARIANTS)
def test_deterministic_mode(spec, device, monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` every step runs (no operation lacks a
    deterministic implementation on this device: PyTorch would raise) and two runs of the
    same steps give the same payloads, outputs and states, bit for bit."""
    import torch
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
    ops, info, grads = _ops("torch"), _info(spec), _grads()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = _steps(ops, scheme_of(spec), "torch", device, info, grads)
        second = _steps(ops, scheme_of(spec), "torch", device, info, grads)
    finally:
        torch.use_deterministic_algorithms(before)
    for (p1, o1), (p2, o2) in zip(first[0], second[0]):
        assert _same(p1, p2) and _same(o1, o2), spec
    assert _same(first[1], second[1]), spec


# Each way a user turns reduced float32 products on, through PyTorch's legacy and new APIs,
# with the devices whose products it reduces: (CUDA, CPU).
PRECISION_WAYS = {
    "set_float32_matmul_precision('high')": (lambda t: t.set_float32_matmul_precision("high"), (True, True)),
    "set_float32_matmul_precision('medium')": (lambda t: t.set_float32_matmul_precision("medium"), (True, True)),
    "cuda.matmul.allow_tf32=True": (lambda t: setattr(t.backends.cuda.matmul, "allow_tf32", True), (True, False)),
    "backends.fp32_precision='tf32'": (lambda t: setattr(t.backends, "fp32_precision", "tf32"), (True, True)),
    "cuda.matmul.fp32_precision='tf32'": (lambda t: setattr(t.backends.cuda.matmul, "fp32_precision", "tf32"), (True, False)),
    "mkldnn.matmul.fp32_precision='bf16'": (lambda t: setattr(t.backends.mkldnn.matmul, "fp32_precision", "bf16"), (False, True)),
    # (PyTorch sets backends.fp32_precision to "bf16" with it, which CUDA's "none" inherits.)
    "mkldnn.fp32_precision='bf16'": (lambda t: setattr(t.backends.mkldnn, "fp32_precision", "bf16"), (True, True)),
}
_PRECISION_NODES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                    "mkldnn.conv", "mkldnn.rnn")


def _precision_snapshot():
    """Every float32 precision setting PyTorch has, legacy getters included ("raises" where
    PyTorch's consistency check raises from them after the new API was used)."""
    import functools
    import torch
    out = {}
    for path in _PRECISION_NODES:
        node = functools.reduce(getattr, path.split("."), torch.backends) if path else torch.backends
        out[path or "backends"] = node.fp32_precision
    for name, get in (("legacy", torch.get_float32_matmul_precision),
                      ("allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)):
        try:
            out[name] = get()
        except RuntimeError:
            out[name] = "raises"
    return out


@pytest.fixture
def user_precision():
    """Restores PyTorch's float32 precision settings after a test that changes them."""
    import functools
    import torch
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip(f"PyTorch {torch.__version__} has no fp32_precision API (added in 2.9)")
    before = _precision_snapshot()
    yield before
    torch.set_float32_matmul_precision("highest")
    for path in _PRECISION_NODES:
        node = functools.reduce(getattr, path.split("."), torch.backends) if path else torch.backends
        node.fp32_precision = before[path or "backends"]
    assert _precision_snapshot() == before


def _rotation_round_trip(ops, plan, x, diag, hmat):
    """A fused kernel (``ops.fuse``): THC's rotation and its inverse, float32 [P]."""
    from hvd_gradcomp import hadamard
    factors = hadamard.nested_factors(plan[0], hmat)
    return hadamard.irht(ops, hadamard.rht(ops, x, diag, factors), diag, factors)


def _codec_product_errors(ops, device, seed=0):
    """Relative max errors of ``ops.matmul``, ``ops.addmm`` (256 x 256, against float64) and of
    THC's rotation round trip (4096 coordinates, two 32-wide factors) run through ``ops.fuse``."""
    import torch
    from hvd_gradcomp import hadamard
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(256, 256, dtype=torch.float64, generator=gen).to(device) for _ in range(2))
    ref = (a @ b).cpu()
    scale = float(ref.abs().max())
    mm = (ops.matmul(a.float(), b.float()).double().cpu() - ref).abs().max() / scale
    addmm = (ops.addmm(torch.zeros(256, 256, device=device), a.float(), b.float(), -1.0).double().cpu()
             + ref).abs().max() / scale
    x = torch.randn(4096, generator=gen).to(device)
    diag = hadamard.rademacher(ops, 7, 4096, x, 1.0 / 32)
    hmat = hadamard.sylvester(ops, 32, x)
    back = ops.fuse(_rotation_round_trip, (1024,))(x, diag, hmat)
    return float(mm), float(addmm), float((back - x).abs().max() / x.abs().max())


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("way", PRECISION_WAYS)
def test_reduced_precision_is_seen(way, user_precision):
    """Each way of turning TF32/bfloat16 products on is seen, for the devices it affects,
    without calling the legacy getters that raise once the new API is in use (read on the
    CPU for CUDA too: only flags are read)."""
    import torch
    from torch_backend.reference_ops import reduced_fp32
    assert (reduced_fp32(True), reduced_fp32(False)) == (False, False)
    set_way, expected = PRECISION_WAYS[way]
    set_way(torch)
    assert (reduced_fp32(True), reduced_fp32(False)) == expected


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("way", PRECISION_WAYS)
def test_codec_products_exact_under_each_precision_way(way, device, user_precision):
    """Under each way a user reduces float32 products (TF32 on GPUs, bfloat16 through oneDNN on
    CPUs), our matmul, addmm and THC's rotation round trip stay float32-exact, nothing raises
    (PyTorch's check of mixed legacy/new settings), and every setting reads as the user left
    it, the legacy getters included."""
    import torch
    from torch_backend.ops import OPS
    PRECISION_WAYS[way][0](torch)
    user = _precision_snapshot()
    mm, addmm, rotation = _codec_product_errors(one_rank(OPS), device)
    assert _precision_snapshot() == user
    assert mm <= 1e-6 and addmm <= 1e-6 and rotation <= 2e-6, (mm, addmm, rotation)


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
@pytest.mark.parametrize("way", ["set_float32_matmul_precision('medium')", "mkldnn.matmul.fp32_precision='bf16'"])
def test_codec_products_on_two_threads_leave_the_setting_alone(way, user_precision):
    """Issue 35, risk 2: DDP's ``then`` callbacks run on Gloo's threads. Two threads run codec
    products (with bfloat16 products turned on, the CPU's reduced setting) while the main thread
    reads the user's settings: every reading is what the user set, and every product is exact.
    (A save/set/restore pin around each product fails both: readers see its "ieee", and one
    thread's restore lets the other's product run reduced.)"""
    import threading
    import torch
    from torch_backend.ops import OPS
    PRECISION_WAYS[way][0](torch)
    user = _precision_snapshot()
    ops, errors, failures = one_rank(OPS), [], []

    def work(seed):
        try:
            for i in range(12):
                errors.append(_codec_product_errors(ops, "cpu", seed + i))
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(100 * k,)) for k in range(2)]
    for t in threads:
        t.start()
    readings = 0
    while any(t.is_alive() for t in threads):
        assert _precision_snapshot() == user
        readings += 1
    for t in threads:
        t.join()
    assert not failures, failures
    assert readings > 0 and len(errors) == 24
    worst = np.max(errors, axis=0)
    assert worst[0] <= 1e-6 and worst[1] <= 1e-6 and worst[2] <= 2e-6, worst


@pytest.mark.skipif("torch" not in BACKENDS, reason="PyTorch backend not under test")
def test_compiled_rotation_exact_under_reduced_precision(device, user_precision):
    """Issue 35, risk 3: with ``HVD_GRADCOMP_COMPILE=1`` (``COMPILED_OPS``) and the user's
    float32 products reduced ("medium": TF32 on GPUs, bfloat16 on CPUs), THC's rotation round
    trip compiled by Inductor stays float32-exact; the same kernel compiled over plain float32
    products shows the reduction where this device has it (else the test says so and skips)."""
    import dataclasses
    import torch
    from torch_backend.ops import COMPILED_OPS, OPS
    from torch_backend.reference_ops import _matmul
    torch.set_float32_matmul_precision("medium")
    _, _, rotation = _codec_product_errors(one_rank(COMPILED_OPS), device)
    assert rotation <= 2e-6, rotation
    plain = dataclasses.replace(OPS, matmul=_matmul)
    from hvd_gradcomp import hadamard
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5)).to(device)
    diag, hmat = hadamard.rademacher(plain, 7, 4096, x, 1.0 / 32), hadamard.sylvester(plain, 32, x)
    raw = torch.compile(lambda *t: _rotation_round_trip(plain, (1024,), *t), fullgraph=True)(x, diag, hmat)
    raw_error = float((raw - x).abs().max() / x.abs().max())
    if raw_error <= 2e-6:
        pytest.skip(f"this {device} runs 'medium' float32 products in full precision when compiled "
                    f"(raw error {raw_error:.1e}): the exact variant ran, its effect is not observable")


def _tf32(x):
    """Round float32 ``x`` to TF32 (10 mantissa bits, nearest even), as a GPU's tensor core
    rounds matmul operands; NumPy, host side."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    keep = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return keep.astype(np.uint32).view(np.float32)


@requires_backend("tensorflow")
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


# The Triton fused forms (torch_backend/kernels/triton_thc.py, triton_topkc.py) run compiled on
# CUDA, against the reference composition on the same device: the checks that
# tests/core/test_triton_kernels.py runs in Triton's interpreter on CPU tensors
# (tests/core/triton_checks.py). The steps above (no sync, CUDA graphs, deterministic mode) run
# through the same forms on CUDA, where they are the default.
def _triton_checks():
    """tests.core.triton_checks, or a skip saying why the Triton forms cannot run here."""
    import importlib.util
    if "torch" not in BACKENDS:
        pytest.skip("PyTorch backend not under test")
    why = missing_device("torch", "cuda")
    if why:
        pytest.skip(why)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the reference runs on CUDA (make setup installs it)")
    from torch_backend import kernels
    if kernels.mode() == "off":
        pytest.skip(f"{kernels.ENV}=off: no fused form runs")
    from tests.core import triton_checks
    return triton_checks


def test_triton_thc_kernels_on_cuda():
    """THC's rotate, quantise-and-pack and decode Triton kernels on CUDA tensors against the
    reference on CUDA: every case of tests/core/triton_checks.py (bit for bit where the math is
    exact, within its tolerances elsewhere)."""
    checks = _triton_checks()
    problems = [p for case in checks.THC_CASES for p in checks.check_thc("cuda", *case)]
    assert problems == [], "\n".join(problems)


def test_triton_topkc_kernel_on_cuda():
    """TopKC's correct kernel in Triton on CUDA against the reference on CUDA."""
    checks = _triton_checks()
    problems = [p for case in checks.TOPKC_CASES for p in checks.check_topkc("cuda", *case)]
    assert problems == [], "\n".join(problems)


def test_triton_powersgd_kernels_on_cuda():
    """PowerSGD's Triton basis, batched basis and check on receipt on CUDA against the reference
    on CUDA (tests/core/triton_powersgd_checks.py)."""
    c = _triton_checks()
    problems = ([p for case in c.POWERSGD_CASES for p in c.check_powersgd("cuda", *case)]
                + c.check_powersgd_agree("cuda")
                + [p for case in c.POWERSGD_BATCHED_CASES for p in c.check_powersgd_batched("cuda", *case)])
    assert problems == [], "\n".join(problems)


def test_triton_forms_in_schemes_on_cuda():
    """Whole THC and TopKC steps through ``one_rank(OPS)`` on CUDA (the Triton forms, chosen
    by ``ops.fuse`` with no fallback warning) against ``one_rank(REFERENCE_OPS)``; plans
    outside the forms' reach (THC blocks other than 1024) run the reference, bit for bit."""
    checks = _triton_checks()
    problems = checks.check_schemes("cuda") + checks.check_refusals("cuda")
    assert problems == [], "\n".join(problems)
