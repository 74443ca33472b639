"""Compiled kernels (``Primitives.fuse`` through torch.compile / XLA) give the values of the
uncompiled ones, share one compilation across tensor sizes, and are switched by
``HVD_GRADCOMP_COMPILE``.

Each check runs a scheme for three steps (state fed back) with the backend's ``OPS`` and with
its ``COMPILED_OPS`` on the same gradients, one rank (the payload is its own all-reduce), and
compares outputs, payloads and states. Compilers may reorder float arithmetic (fused
multiply-adds, reduction order), so floats agree to rounding, not bitwise; THC's stochastic
rounding compares a uniform with a float, so a coordinate sitting on the edge may round the
other way: levels agree on all but a handful of coordinates. Compiling costs seconds per
kernel (more on a loaded machine), which is why only two sizes per scheme are used.
"""
import warnings

import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import COMPILE_ENV, compile_requested, one_rank
from tests.backends import BACKENDS, as_float64, backend_tensor, scheme_of

SIZES = (3000, 70000)  # padded and unpadded blocks / chunks; two sizes, one compilation
SPECS = ("thc", "topkc:ratio=0.1", "topkc:ratio=0.1,residual_decay=0.9", "thc:range=current,saturation=false")


def _ops(backend):
    if backend == "torch":
        from torch_backend.ops import COMPILED_OPS, OPS
    else:
        from tf_backend.ops import COMPILED_OPS, OPS
    return one_rank(OPS), one_rank(COMPILED_OPS)


def _run(scheme, ops, backend, d, steps=3, device=None):
    info = TensorInfo(f"fuse.{d}", (d,), "float32", 4, 0, "sum")
    rng = np.random.default_rng(d)
    grads = [backend_tensor(backend, rng.standard_normal(d) * (1 + 10 * (np.arange(d) % 97 == 0)), device=device)
             for _ in range(steps)]
    state = scheme.init(ops, info, grads[0])
    outs = []
    for g in grads:
        payload, ctx = compress_tensor(scheme, ops, g, state, info)
        out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        outs.append((as_float64(payload), as_float64(out)))
    return outs, [as_float64(t) for t in state]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
def test_compiled_kernels_match_uncompiled(backend, spec, device):
    """On each device (``device`` fixture: on CUDA, PyTorch compiles through Triton)."""
    eager, compiled = _ops(backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for d in SIZES:
            scheme = scheme_of(spec)
            want, want_state = _run(scheme, eager, backend, d, device=device)
            got, got_state = _run(scheme_of(spec), compiled, backend, d, device=device)
            for step, ((wp, wo), (gp, go)) in enumerate(zip(want, got)):
                if spec.startswith("thc"):
                    # int32 words: a level that rounded the other way changes one word.
                    assert np.mean(wp != gp) < 2e-3, (spec, d, step)
                else:
                    np.testing.assert_allclose(gp, wp, rtol=1e-3, atol=1e-3 * np.abs(wp).max())
                err = np.linalg.norm(go - wo) / max(np.linalg.norm(wo), 1e-30)
                assert err < 2e-3, (spec, d, step, err)
            for w, g in zip(want_state, got_state):
                assert w.shape == g.shape
                scale = max(np.abs(w).max(), 1e-30)
                assert np.abs(g - w).max() <= 5e-3 * scale, (spec, d)
    failed = [str(w.message) for w in caught if "uncompiled" in str(w.message)]
    assert not failed, failed  # the compiler ran; nothing fell back


@pytest.mark.skipif("torch" not in BACKENDS, reason="torch backend not under test")
def test_torch_one_compilation_for_all_sizes():
    """A second and third tensor size reuse the first size's compiled THC kernels."""
    from torch._dynamo.utils import counters
    _, compiled = _ops("torch")
    scheme = scheme_of("thc:bits=2")  # its own plan: kernels not compiled by another test
    _run(scheme, compiled, "torch", 5000, steps=1)
    _run(scheme, compiled, "torch", 9000, steps=1)  # dynamic dims marked from the first call
    before = counters["stats"]["unique_graphs"]
    _run(scheme, compiled, "torch", 40000, steps=1)
    _run(scheme, compiled, "torch", 123456, steps=1)
    assert counters["stats"]["unique_graphs"] == before


def test_compile_switch(monkeypatch):
    for value, want in (("", False), ("0", False), ("off", False), ("1", True), ("true", True),
                        ("ON", True)):
        monkeypatch.setenv(COMPILE_ENV, value)
        assert compile_requested() is want
    monkeypatch.setenv(COMPILE_ENV, "yes please")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        compile_requested()


@pytest.mark.parametrize("backend", BACKENDS)
def test_select_gives_where_values_and_runs_one_branch(backend, device):
    """``Primitives.select``: the values of ``where(pred, a, b)`` for whole tensors and
    (Named)tuples with None; on PyTorch CPU and in TensorFlow only the chosen function runs
    (no pass over the other), also inside ``tf.function``; on PyTorch CUDA both run (reading
    the predicate would sync) and are blended."""
    from typing import NamedTuple

    from tests.backends import backend_ops

    class Pair(NamedTuple):
        big: object
        small: object
        none: object

    ops = backend_ops(backend)
    a = Pair(backend_tensor(backend, np.arange(6.0).reshape(2, 3), device=device),
             backend_tensor(backend, [1.0], device=device), None)
    b = Pair(backend_tensor(backend, -np.arange(6.0).reshape(2, 3), device=device),
             backend_tensor(backend, [2.0], device=device), None)
    for flag in (True, False):
        ran = []

        def pick(flag=flag):
            pred = backend_tensor(backend, 1.0 if flag else 0.0, device=device) > 0.5
            return ops.select(pred, lambda: (ran.append("a"), a)[1], lambda: (ran.append("b"), b)[1])

        if backend == "tensorflow":
            import tensorflow as tf
            got = tf.function(pick)()
        else:
            got = pick()
        want = a if flag else b
        assert got.none is None
        np.testing.assert_array_equal(as_float64(got.big), as_float64(want.big))
        np.testing.assert_array_equal(as_float64(got.small), as_float64(want.small))
        # PyTorch CPU runs one function; tf.cond traces both once but executes one.
        if backend == "torch" and device == "cpu":
            assert ran == (["a"] if flag else ["b"])
        else:
            assert sorted(ran) == ["a", "b"]


@pytest.mark.skipif("torch" not in BACKENDS, reason="torch backend not under test")
def test_torch_select_blend_for_gpu_tensors():
    """The path PyTorch takes for a pred on a GPU (both functions run, ``where`` blends them),
    checked on CPU tensors: the same values as the branch."""
    import torch

    from torch_backend.reference_ops import where_tree
    a = (torch.arange(4.0), (torch.ones(2), None))
    b = (-torch.arange(4.0), (torch.zeros(2), None))
    for flag in (True, False):
        got = where_tree(torch.tensor(flag), a, b)
        want = a if flag else b
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0]) and got[1][1] is None


@pytest.mark.skipif("torch" not in BACKENDS, reason="torch backend not under test")
def test_torch_thin_matmul_in_row_blocks():
    """The torch backend forms thin products with a large output ([n, k] x [k, m], k <= 32,
    n m >= 2**20: PowerSGD's P Q^T; addmm's M - P Q^T in place) as a batch of row blocks;
    the values are torch.matmul's,
    with or without a remainder of rows, for a transposed (strided) left factor too, and for
    other shapes the plain product is used."""
    import torch
    from torch_backend.ops import OPS
    gen = torch.Generator().manual_seed(0)
    cases = [((2048, 4), (4, 2048)), ((1003, 3), (3, 2048)), ((600, 1), (1, 4608)), ((5, 2), (2, 1 << 18)),
             ((64, 4), (4, 64)), ((300, 40), (40, 4000))]
    for (n, k), (_, m) in cases:
        a, b = torch.randn(n, k, generator=gen), torch.randn(k, m, generator=gen)
        want = a.double() @ b.double()
        for left in (a, a.T.contiguous().T):
            got = OPS.matmul(left, b)
            assert got.shape == (n, m) and got.dtype == torch.float32
            np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
            c = torch.randn(n, m, generator=gen)
            expect = c.double() - 0.5 * want
            got = OPS.addmm(c, left, b, -0.5)
            assert got.data_ptr() == c.data_ptr()  # in place on the caller's temporary
            np.testing.assert_allclose(got.double().numpy(), expect.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_addmm_values(backend):
    """addmm(c, a, b, alpha) = c + alpha a b in both backends (the value; PyTorch may reuse c)."""
    from tests.backends import backend_ops
    ops = backend_ops(backend)
    rng = np.random.default_rng(4)
    for n, k, m in ((5, 2, 7), (40, 4, 30)):
        a, b, c = rng.standard_normal((n, k)), rng.standard_normal((k, m)), rng.standard_normal((n, m))
        got = as_float64(ops.addmm(backend_tensor(backend, c), backend_tensor(backend, a),
                                   backend_tensor(backend, b), -1.0))
        np.testing.assert_allclose(got, c - a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_count_bitcast_values(backend):
    """clip (Python-number bounds, NaN kept), count (int64 number of True, whole or per axis)
    and bitcast (int32 <-> float32 bits, both ways) in both backends."""
    from tests.backends import backend_ops
    ops = backend_ops(backend)
    x = np.array([[-3.0, -1.0, 0.5], [2.0, 9.0, np.nan]], np.float32)
    got = as_float64(ops.clip(backend_tensor(backend, x), -1.0, 2.0))
    np.testing.assert_array_equal(got, np.clip(x, -1.0, 2.0))
    assert np.isnan(got[1, 2])
    mask = backend_tensor(backend, x) > 0.0
    assert ops.dtype(ops.count(mask, None)) == "int64" and int(as_float64(ops.count(mask, None))) == 3
    np.testing.assert_array_equal(as_float64(ops.count(mask, 1)), [1, 2])
    ints = np.array([0x3F800000, 0x3F800000 | 0x7FFFFF, 0x40490FDB, 0], np.int32)
    as_float = ops.bitcast(backend_tensor(backend, ints, "int32"), "float32")
    np.testing.assert_array_equal(as_float64(as_float), ints.view(np.float32))
    back = ops.bitcast(as_float, "int32")
    assert ops.dtype(back) == "int32"
    np.testing.assert_array_equal(as_float64(back), ints)
