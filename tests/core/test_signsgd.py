"""Single-process tests of signSGD with error feedback (hvd_gradcomp/signsgd.py).

As in tests/core/test_thc.py, several *simulated* ranks of one tensor run in one process
(:class:`Ranks`): each rank compresses with its own state and TensorInfo; the one all-reduce is
the int64 sum of the int32 payloads (``op="sum"``) or Horovod's int32 Average emulated as
``trunc(W * (1.0 / n))`` in float64. Every output, payload and residual is checked against
:class:`RefSignSGD`, a float64 NumPy reference written from the module docstring (the lanes
unpacked with NumPy shifts). Real ranks: tests/parallel/test_signsgd.py.
"""
import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.base import EmptyState, TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec
from tests.backends import BACKENDS, as_numpy, native_tensor, one_rank_ops
from tests.core.thc_emulation import emulate_allreduce

CONTROL = 2  # contributes, not finite


def np_layout(n, op):
    """(lanes, width, guard) of 1-bit lanes from the module docstring: lanes of bit_length(n)
    bits above bit_length(n) guard bits (none under a known Sum), as many as keep the sum of
    n all-ones words below 2**31 (no offset)."""
    width = n.bit_length()
    guard = 0 if op == "sum" else n.bit_length()
    lanes = (32 - guard) // width
    while n * sum(1 << (guard + j * width) for j in range(lanes)) >= 2 ** 31:
        lanes -= 1
    return lanes, width, guard


def np_blocks(d, block):
    """(B, nb): coordinates a scale, number of blocks."""
    b = min(block or d, d)
    return b, -(-d // b)


def np_words(n, op, d, block=1024):
    """(sign words, statistics words, control words) of a payload (module docstring)."""
    lanes, _, guard = np_layout(n, op)
    b, nb = np_blocks(d, block)
    return -(-nb * b // lanes), -(-2 * nb // ((31 - guard) // (1023 * n).bit_length())), CONTROL


def split_payload(payload, n, op, d, block=1024):
    """One rank's own int32 payload -> (bits [d], codes [nb], flags [nb], control [2]) with
    NumPy shifts: the sign lanes, the (code, flag) pairs in lanes of bit_length(1023 n) bits
    above the same guard bits, then the control words."""
    lanes, width, guard = np_layout(n, op)
    b, nb = np_blocks(d, block)
    swidth = (1023 * n).bit_length()
    slanes = (31 - guard) // swidth
    words = np.asarray(payload, np.int64)
    m, ms, _ = np_words(n, op, d, block)
    assert words.size == m + ms + CONTROL and (words >= 0).all()
    bits = np.concatenate([(words[:m] >> (guard + j * width)) & ((1 << width) - 1) for j in range(lanes)])[:d]
    stats = words[m:m + ms]
    pairs = np.concatenate([(stats >> (guard + j * swidth)) & ((1 << swidth) - 1) for j in range(slanes)])
    pairs = pairs[:2 * nb].reshape(nb, 2)
    return bits, pairs[:, 0], pairs[:, 1], words[m + ms:] >> guard


class RefSignSGD:
    """Every rank of one tensor in float64 (float32 where the scheme rounds: ``p = g + e`` and
    the residual are float32 tensors); one scale per block of ``block`` coordinates."""

    def __init__(self, n, d, error_feedback=True, block=1024):
        self.n, self.d, self.ef = n, d, error_feedback
        self.b, self.nb = np_blocks(d, block)
        self.residual = [np.zeros(d) for _ in range(n)]

    def codes(self, p):
        """(codes [nb], flags [nb]) of one rank's p."""
        finite = np.isfinite(np.abs(p).sum())
        codes, flags = np.zeros(self.nb, np.int64), np.zeros(self.nb, np.int64)
        for k in range(self.nb):
            s = np.abs(p[k * self.b:(k + 1) * self.b]).mean()
            if finite and s > 1e-30:
                codes[k], flags[k] = np.clip(np.round(4 * np.log2(s)) + 512, 1, 1023), 1
        return codes, flags

    def step(self, grads, op):
        ps = [np.float32(g.reshape(-1)) + np.float32(e) if self.ef else np.float32(g.reshape(-1))
              for g, e in zip(grads, self.residual)]
        ps = [p.astype(np.float64) for p in ps]
        self.stats = [self.codes(p) for p in ps]
        total = np.sum([c for c, _ in self.stats], axis=0)
        have = np.sum([f for _, f in self.stats], axis=0)
        per_block = np.where(have > 0, 2.0 ** ((total - 512.0 * have) / np.maximum(have, 1) / 4), 0.0)
        self.scale = np.repeat(per_block, self.b)[:self.d]
        self.bits = [(p >= 0).astype(np.int64) for p in ps]
        if not all(np.isfinite(np.abs(p).sum()) for p in ps):
            return np.full(self.d, np.nan)
        signs = [2.0 * b - 1.0 for b in self.bits]
        if self.ef:
            self.residual = [np.float32(p - self.scale * s).astype(np.float64) for p, s in zip(ps, signs)]
        out = self.scale * np.sum(signs, axis=0)
        return out / self.n if op != "sum" else out


class Ranks:
    """``n`` simulated ranks of one tensor; ``op``: Horovod's op; ``infer``: TensorInfo.op None."""

    def __init__(self, backend, n, shape, op="average", infer=False, **options):
        self.backend, self.n, self.op, self.shape = backend, n, op, tuple(shape)
        self.ops = one_rank_ops(backend)
        self.scheme = make_scheme("signsgd", **options)
        self.infos = [TensorInfo("layer.w", self.shape, "float32", n, r, None if infer else op) for r in range(n)]
        like = native_tensor(backend, np.zeros(self.shape, np.float32))
        self.states = [self.scheme.init(self.ops, info, like) for info in self.infos]

    def step(self, grads):
        sent = [compress_tensor(self.scheme, self.ops, native_tensor(self.backend, np.float32(g).reshape(self.shape)),
                                self.states[r], self.infos[r]) for r, g in enumerate(grads)]
        self.own = [as_numpy(p) for p, _ in sent]
        assert all(p.dtype == np.int32 for p in self.own)
        reduced = native_tensor(self.backend, emulate_allreduce(self.own, self.op, self.n))
        outs = []
        for r in range(self.n):
            out, self.states[r] = finish_tensor(self.scheme, self.ops, reduced, sent[r][1], self.states[r],
                                                self.infos[r])
            outs.append(as_numpy(out).astype(np.float64).reshape(-1))
        return outs

    def residual(self, r):
        """Rank ``r``'s pending error feedback (numpy, flat): the state keeps ``p`` and ``S``."""
        return as_numpy(composite.residual_of(self.scheme, self.ops, self.states[r], self.infos[r])).reshape(-1)


CASES = [(1, "average", False), (2, "average", False), (2, "sum", False), (3, "average", False),
         (3, "sum", False), (2, "average", True), (3, "sum", True), (8, "average", False)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,op,infer", CASES)
@pytest.mark.parametrize("ef,block", [(True, 16), (True, None), (False, 16)])
def test_ranks_match_float64_reference(backend, n, op, infer, ef, block):
    """Outputs (identical on every rank), each rank's bits, codes, flags and control words,
    and residuals, step by step, against the reference; Average's truncated words are
    recovered exactly."""
    shape, d = (7, 13), 91  # not a multiple of the block nor of the lanes
    sim = Ranks(backend, n, shape, op, infer, error_feedback=ef, block=block)
    ref = RefSignSGD(n, d, ef, block)
    gen = np.random.default_rng([n, int(infer), int(ef)])
    for step in range(4):
        # Scales that differ between coordinates, so the blocks' scales differ.
        grads = [gen.standard_normal(shape) * gen.uniform(0.1, 3.0, shape) for _ in range(n)]
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], outs[0])
            bits, codes, flags, control = split_payload(sim.own[r], n, None if infer else op, d, block)
            np.testing.assert_array_equal(bits, ref.bits[r], err_msg=f"step {step} rank {r} bits")
            np.testing.assert_array_equal(codes, ref.stats[r][0], err_msg=f"step {step} rank {r} codes")
            np.testing.assert_array_equal(flags, ref.stats[r][1])
            assert list(control) == [1, 0], (step, r)
            if ef:
                top = max(ref.scale.max(), np.abs(ref.residual[r]).max())  # float32 rounding of either
                np.testing.assert_allclose(sim.residual(r), ref.residual[r], rtol=0,
                                           atol=1e-6 * top, err_msg=f"step {step} rank {r} residual")
            else:
                assert isinstance(sim.states[r], EmptyState)
        assert ref.scale.min() > 0.05
        np.testing.assert_allclose(outs[0], expected, rtol=0, atol=1e-6 * ref.scale.max() * n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_feedback_keeps_everything(backend):
    """Under Sum, what was delivered plus what the ranks still owe is all they were given."""
    n, d = 3, 500
    sim = Ranks(backend, n, (d,), "sum")
    gen = np.random.default_rng(5)
    given = delivered = 0.0
    for _ in range(6):
        grads = [gen.standard_normal(d) * np.linspace(0.01, 2, d) for _ in range(n)]
        given = given + np.sum([np.float32(g) for g in grads], axis=0)
        delivered = delivered + sim.step(grads)[0]
    pending = np.sum([sim.residual(r) for r in range(n)], axis=0)
    np.testing.assert_allclose(delivered + pending, given, rtol=0, atol=1e-5 * np.abs(given).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_on_one_rank(backend):
    """NaN or inf on rank 1: NaN in every coordinate on every rank, rank 1's "not finite" word
    set, every rank's residual as it was; the next finite step matches the reference."""
    n, d = 3, 200
    for op, bad in (("sum", float("nan")), ("average", float("inf")), ("average", -float("inf"))):
        sim, ref = Ranks(backend, n, (d,), op), RefSignSGD(n, d)
        gen = np.random.default_rng(3)
        for _ in range(2):
            grads = [gen.standard_normal(d) for _ in range(n)]
            sim.step(grads), ref.step(grads, op)
        before = [sim.residual(r) for r in range(n)]
        grads = [gen.standard_normal(d) for _ in range(n)]
        grads[1][17] = bad
        outs = sim.step(grads)
        assert all(np.isnan(out).all() for out in outs)
        assert list(split_payload(sim.own[1], n, op, d)[3]) == [1, 1]
        for r, b in enumerate(before):
            np.testing.assert_array_equal(sim.residual(r), b)
        grads = [gen.standard_normal(d) for _ in range(n)]
        outs, expected = sim.step(grads), ref.step(grads, op)
        np.testing.assert_allclose(outs[0], expected, rtol=0, atol=1e-6 * ref.scale.max() * n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zeros_give_zeros(backend):
    """No rank has data: scale 0, output 0, residual 0, codes and flags 0."""
    sim = Ranks(backend, 2, (300,), "average", block=64)
    for _ in range(2):
        outs = sim.step([np.zeros(300), np.zeros(300)])
        assert all((out == 0).all() for out in outs)
        assert all((sim.residual(r) == 0).all() for r in range(2))
        for p in sim.own:
            _, codes, flags, control = split_payload(p, 2, "average", 300, 64)
            assert not codes.any() and not flags.any() and list(control) == [1, 0]


def test_wire_matches_payload_and_bits_per_coordinate():
    """wire() == the payload's bytes == split_payload's count of words; sign lanes per word
    as the docstring states them (32/15 bits a coordinate under Sum at 2 ranks, 32/14 under
    Average, 32/6 under Average at 8), and as :func:`np_layout` finds them."""
    ops = one_rank_ops(BACKENDS[0])
    for n, op, lanes in ((2, "sum", 15), (2, "average", 14), (3, "sum", 15), (3, "average", 14),
                          (8, "average", 6), (1024, "average", 1)):
        for block in (1024, None, 7):
            scheme = make_scheme("signsgd", block=block)
            assert np_layout(n, op)[0] == lanes == scheme.layout(TensorInfo("w", (1,), "float32", n, 0, op)).signs.lanes
            for d in (1, 15, 16, 1000, 3000):
                info = TensorInfo("w", (d,), "float32", n, 0, op)
                x = native_tensor(BACKENDS[0], np.ones(d, np.float32))
                payload, _ = compress_tensor(scheme, ops, x, scheme.init(ops, info, x), info)
                assert scheme.wire(info).payload == as_numpy(payload).nbytes
                split_payload(as_numpy(payload), n, op, d, block)  # asserts the number of words


def test_config_spec_and_errors():
    assert parse_spec("signsgd:error_feedback=false") == ("signsgd", {"error_feedback": False})
    assert make_scheme("signsgd", error_feedback=False).spec() == "signsgd:error_feedback=false"
    assert not make_scheme("signsgd").scalable
    with pytest.raises(ValueError, match="^signsgd: error_feedback must be"):
        make_scheme("signsgd", error_feedback="maybe")
    with pytest.raises(ValueError, match="^signsgd: block must be"):
        make_scheme("signsgd", block=0)
    assert parse_spec("signsgd:block=none") == ("signsgd", {"block": None})
    ops = one_rank_ops(BACKENDS[0])
    with pytest.raises(ValueError, match="^signsgd: world size must be at most 1024, got 1025$"):
        make_scheme("signsgd").init(ops, TensorInfo("w", (4,), "float32", 1025, 0, "sum"), None)


# ---------------------------------------------------------------- the fused forms (CPU)
# torch_backend/kernels/cpu_signsgd.py (csrc/signsgd.c) against the kernels' reference
# compositions (hvd_gradcomp/signsgd_kernels.py run on REFERENCE_OPS): the sign and control
# words, p (from the kept p and S), the receive and the decode bit for bit; a scale's log code may move
# by one only where 4 log2 s lies within float32 rounding of a half-integer (the block sums add
# up in another order).

def _torch_kernels():
    torch = pytest.importorskip("torch")
    from hvd_gradcomp import signsgd_kernels as K
    from torch_backend import kernels
    from torch_backend.kernels import cbuild, cpu_signsgd  # noqa: F401  (ImportError: no compiler)
    from torch_backend.ops import REFERENCE_OPS
    return torch, K, kernels, cpu_signsgd, REFERENCE_OPS


def _plan(n, op, d, ef=True, block=1024):
    scheme = make_scheme("signsgd", error_feedback=ef, block=block)
    info = TensorInfo("w", (d,), "float32", n, 0, op)
    return scheme._plan(info, scheme.layout(info))


def _bitwise(torch, a, b):
    """Equal bit for bit (NaN patterns included), as int32 views of float32."""
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _codes_agree(torch, got, want, p, n, op, d, block):
    """Sign, flag and control words equal; codes equal but where 4 log2 s (float64) lies within
    1e-4 of a half-integer."""
    g, w = split_payload(got.numpy(), n, op, d, block), split_payload(want.numpy(), n, op, d, block)
    for name, a, b in zip(("bits", "codes", "flags", "control"), g, w):
        if name != "codes":
            np.testing.assert_array_equal(a, b, err_msg=name)
    moved = np.nonzero(g[1] != w[1])[0]
    if moved.size:
        b_, nb = np_blocks(d, block)
        s = np.abs(p.double().numpy()[:nb * b_]).reshape(nb, b_).sum(1) / np.minimum(b_, d - np.arange(nb) * b_)
        frac = np.abs(np.modf(4 * np.log2(s[moved]))[0]) - 0.5
        assert (np.abs(frac) < 1e-4).all() and (np.abs(g[1][moved] - w[1][moved]) == 1).all(), moved


def test_fused_forms_are_registered():
    torch, K, kernels, cpu, _ = _torch_kernels()
    plan = _plan(2, "average", 5000)
    assert kernels.status()["torch_backend.kernels.cpu_signsgd"] == "loaded"
    for fn, form in ((K._encode_kernel, cpu.encode), (K._receive_kernel, cpu.receive),
                     (K._decode_kernel, cpu.decode)):
        assert kernels.fused_form(fn, plan, "cpu") is form


@pytest.mark.parametrize("n,op", [(1, "sum"), (2, "average"), (3, None), (8, "average"), (1024, "average")])
@pytest.mark.parametrize("d,block,ef", [(1, 1024, True), (91, 16, True), (3000, 1024, True), (5000, 7, False),
                                         (2999, None, True), (70000, 1024, True),
                                         (600001, 1000, True)])  # several tiles of the C loop
@pytest.mark.parametrize("finite", [None, True, False])
def test_encode_matches_reference(n, op, d, block, ef, finite):
    torch, K, _, cpu, R = _torch_kernels()
    plan = _plan(n, op, d, ef, block)
    gen = torch.Generator().manual_seed(d + n)
    x = torch.randn(d, generator=gen) * torch.rand(d, generator=gen) * 3.0
    x[: d // 5] *= 1e-3  # blocks of other scales
    if d > 10:
        x[7] = 0.0  # sign(0) = +1
        x[d // 2: d // 2 + 3] = -0.0
    kept = torch.randn(d, generator=gen) * 0.5 if ef else x  # the last step's p and S
    scale = torch.rand(-(-d // plan.block), generator=gen) * 0.2 if ef else x
    if ef and d > 10:
        kept[3], kept[4] = 0.0, -0.0  # [p' >= 0] of both zeros is 1
    flag = None if finite is None else torch.tensor(finite)
    got = cpu.encode(plan, torch.stack([x, -x], 1)[:, 0], kept, scale, flag)  # strided: the form copies it
    want = K._encode_kernel(R, plan, x, kept, scale, flag)
    assert _bitwise(torch, got[1], want[1])
    _codes_agree(torch, got[0], want[0], want[1], n, op, d, block)


@pytest.mark.parametrize("kind", ["nan", "inf", "overflow", "zeros"])
def test_encode_nonfinite_and_zeros(kind):
    """A NaN or inf coordinate, finite values whose |p| sums beyond float32, an all-zero tensor:
    the reference's flag, pairs ((0, 0) everywhere when not finite) and words."""
    torch, K, _, cpu, R = _torch_kernels()
    n, op, d = 3, "average", 4000
    plan = _plan(n, op, d)
    x = torch.randn(d, generator=torch.Generator().manual_seed(9))
    kept, scale = torch.zeros(d), torch.zeros(-(-d // plan.block))
    if kind == "nan":
        x[1234] = float("nan")
    elif kind == "inf":
        x[3999] = -float("inf")
    elif kind == "overflow":
        x[:8] = 3e38
    else:
        x.zero_()
    got, want = cpu.encode(plan, x, kept, scale, None), K._encode_kernel(R, plan, x, kept, scale, None)
    assert _bitwise(torch, got[1], want[1]) and _bitwise(torch, got[0], want[0])
    assert list(split_payload(want[0].numpy(), n, op, d)[3]) == [1, int(kind != "zeros")]


def _reduced(torch, K, R, plan, n, op, d, bad_rank=None):
    """Every rank's reference payload, all-reduced as Horovod would; rank 0's corrected p."""
    gen = torch.Generator().manual_seed(n * 7 + d)
    own, first = [], None
    for r in range(n):
        x = torch.randn(d, generator=gen) * (1.0 + r)
        if r == bad_rank:
            x[3] = float("nan")
        kept, scale = torch.randn(d, generator=gen) * 0.1, torch.rand(-(-d // plan.block), generator=gen) * 0.1
        payload, corrected = K._encode_kernel(R, plan, x, kept, scale, None)
        own.append(payload.numpy())
        first = corrected if first is None else first
    actual = op or "sum"
    return torch.from_numpy(np.asarray(emulate_allreduce(own, actual, n), np.int32)), first


@pytest.mark.parametrize("n,op", [(1, "sum"), (2, "sum"), (2, "average"), (3, None), (5, "average"),
                                  (16, "average"), (1024, "average")])
@pytest.mark.parametrize("d,block", [(37, 1024), (3000, 1024), (5001, 100), (777, None),
                                     (70001, 1000)])  # several tiles of the C decode
@pytest.mark.parametrize("bad", [False, True])
def test_receive_and_decode_are_bit_exact(n, op, d, block, bad):
    torch, K, _, cpu, R = _torch_kernels()
    if n == 1024 and d > 1000:
        pytest.skip("one size at 1024 ranks is enough")
    if n > 5 and d > 10000:
        pytest.skip("several decode tiles: up to 5 ranks are enough")
    plan = _plan(n, op, d, True, block)
    reduced, corrected = _reduced(torch, K, R, plan, n, op, d, bad_rank=n - 1 if bad else None)
    got, want = cpu.receive(plan, reduced, corrected), K._receive_kernel(R, plan, reduced, corrected)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert _bitwise(torch, a, b), (a, b)
    assert int(want[1]) == int(bad)
    out = cpu.decode(plan, reduced, *want)
    ref = K._decode_kernel(R, plan, reduced, *want)
    assert _bitwise(torch, out, ref)
    assert bool(torch.isnan(ref).all()) == bad and (bad or bool(ref.abs().sum() > 0))
    # An engine's mean written into its bucket: 1/n folded in (the reference's own product,
    # bit for bit), only the gradient's d coordinates written, the rest of the bucket untouched.
    folded = plan._replace(factor=1.0 / 3)
    bucket = torch.full((d + 5,), 7.0)
    into = bucket[2:2 + d]
    got = cpu.decode(folded, reduced, *want, into)
    assert got.data_ptr() == into.data_ptr() and got.shape == (d,)
    assert _bitwise(torch, into, ref[:d] * (1.0 / 3))
    assert _bitwise(torch, K._decode_kernel(R, folded, reduced, *want, into), ref * (1.0 / 3))
    assert (bucket[:2] == 7.0).all() and (bucket[2 + d:] == 7.0).all()
    assert cpu.decode(plan, reduced, *want, bucket[:d].double()).dtype == torch.float32  # not writable: a new one


@pytest.mark.parametrize("march", ["native", "x86-64"])
def test_streaming_stores_match_reference(march):
    """A p of 2**20 coordinates or more (csrc/signsgd.c's NT_MIN) goes out by non-temporal stores
    a line at a time: it (its block sums grouped by coordinate mod 16) and the decode into a
    bucket slice that starts mid-line equal the reference, for this CPU's library and baseline
    x86-64's (SSE2 streaming stores), with the bucket around the slice untouched."""
    import os
    torch, K, _, cpu, R = _torch_kernels()
    from torch_backend.kernels import cbuild
    if march != "native" and os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 baseline build")
    native = cpu._lib
    lib = native if march == "native" else cbuild.load("signsgd", ("-march=x86-64", "-mtune=generic"))
    for name in ("hgc_signsgd_encode", "hgc_signsgd_receive", "hgc_signsgd_decode"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = (getattr(native, name).argtypes,
                                                                   getattr(native, name).restype)
    n, op, d = 3, "average", (1 << 20) + 4099
    plan = _plan(n, op, d, True, 1000)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(d + 1, generator=gen)[1:] * torch.rand(d, generator=gen)  # starts mid-line
    kept, scale = torch.randn(d, generator=gen) * 0.3, torch.rand(-(-d // 1000), generator=gen) * 0.1
    cpu._lib = lib
    try:
        payload, corrected = cpu.encode(plan, x, kept, scale, None)
        want = K._encode_kernel(R, plan, x, kept, scale, None)
        assert _bitwise(torch, corrected, want[1])
        _codes_agree(torch, payload, want[0], want[1], n, op, d, 1000)
        words = want[0].numpy()
        reduced = torch.from_numpy(np.asarray(emulate_allreduce([words] * n, op, n), np.int32))
        got = cpu.receive(plan, reduced, corrected)
        ref = K._decode_kernel(R, plan._replace(factor=0.25), reduced, *got)
        bucket = torch.full((d + 9,), 7.0)
        into = bucket[3:3 + d]
        out = cpu.decode(plan._replace(factor=0.25), reduced, *got, into)
        assert out.data_ptr() == into.data_ptr() and _bitwise(torch, into, ref[:d])
        assert (bucket[:3] == 7.0).all() and (bucket[3 + d:] == 7.0).all()
        assert _bitwise(torch, cpu.decode(plan, reduced, *got), K._decode_kernel(R, plan, reduced, *got))
    finally:
        cpu._lib = native


@pytest.mark.parametrize("spec,n,op", [("signsgd", 2, "average"), ("signsgd:block=64", 3, None),
                                       ("signsgd:error_feedback=false", 2, "sum"), ("signsgd:block=none", 4, "sum")])
def test_scheme_through_fused_forms_matches_reference(spec, n, op):
    """Whole steps through OPS (the fused forms, every one of them chosen) and REFERENCE_OPS: the
    same payloads, outputs and residuals bit for bit."""
    import warnings
    torch, _, kernels, _, R = _torch_kernels()
    from hvd_gradcomp.primitives import one_rank
    from torch_backend.ops import OPS
    name, options = parse_spec(spec)
    d = 4099
    runs = []
    kernels._CHOSEN.clear()
    for ops in (one_rank(OPS), one_rank(R)):
        scheme = make_scheme(name, **options)
        info = TensorInfo("w", (d,), "float32", n, 0, op)
        gen = torch.Generator().manual_seed(4)
        state, steps = scheme.init(ops, info, torch.zeros(d)), []
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "hvd_gradcomp: the fused form", RuntimeWarning)
            for _ in range(3):
                payload, ctx = compress_tensor(scheme, ops, torch.randn(d, generator=gen), state, info)
                out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
                steps.append((payload, out, *state))
        runs.append(steps)
    for a, b in zip(*runs):
        for u, v in zip(a, b):
            assert _bitwise(torch, u, v)
    chosen = {getattr(f, "__name__", None) for f in kernels._CHOSEN.values() if f is not None}
    want = {"encode", "receive", "decode"}
    assert want <= chosen, chosen


def test_fused_result_independent_of_vector_width():
    """The library for this CPU and one for baseline x86-64 (SSE2) give the same bits."""
    import os
    torch, K, _, cpu, R = _torch_kernels()
    from torch_backend.kernels import cbuild
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 baseline build")
    other = cbuild.load("signsgd", ("-march=x86-64", "-mtune=generic"))
    native = cpu._lib
    names = ("hgc_signsgd_encode", "hgc_signsgd_receive", "hgc_signsgd_decode")
    for name in names:
        getattr(other, name).argtypes, getattr(other, name).restype = (getattr(native, name).argtypes,
                                                                       getattr(native, name).restype)
    plan = _plan(3, "average", 50001, True, 1000)

    def run(lib):
        cpu._lib = lib
        try:
            gen = torch.Generator().manual_seed(2)
            x, kept = torch.randn(50001, generator=gen) * 100, torch.randn(50001, generator=gen)
            payload, corrected = cpu.encode(plan, x, kept, torch.rand(51, generator=gen), None)
            reduced = payload * 3 // 3  # any words: the decoder's integer paths
            count, bad, scale, inferred = cpu.receive(plan, reduced, corrected)
            return [payload, corrected, scale, cpu.decode(plan, reduced, count, bad, scale, inferred)]
        finally:
            cpu._lib = native

    for a, b in zip(run(native), run(other)):
        assert _bitwise(torch, a, b)


def test_state_keeps_p_and_s_and_refuses_the_old_format():
    """The state is the last step's ``p`` and ``S`` (both rank-local, both the error feedback):
    ``residual_of`` forms ``e`` from them, ``add_residual`` keeps ``e + r`` with ``S = 0``,
    ``auto``'s flush zeroes both, and a checkpoint of the former format (a ``residual`` field,
    ``e`` itself) is refused by name."""
    torch = pytest.importorskip("torch")
    from hvd_gradcomp.signsgd import SignSGDState
    ops = one_rank_ops("torch")
    scheme = make_scheme("signsgd", block=2)
    info = TensorInfo("w", (3,), "float32", 2, 0, "sum")
    assert scheme.rank_local_fields == scheme.residual_fields == ("corrected", "scale")
    state = SignSGDState(torch.tensor([0.5, -0.25, 0.0]), torch.tensor([0.125, 1.0]))
    e = composite.residual_of(scheme, ops, state, info)
    assert e.tolist() == [0.5 + 0.125 - 0.25, -0.25 + 0.125, 0.0 + 1.0 - 2.0]
    more = composite.add_residual(scheme, ops, state, info, torch.tensor([1.0, 2.0, 3.0]))
    assert more.scale.tolist() == [0.0, 0.0] and composite.residual_of(scheme, ops, more, info).tolist() == \
        [e[0].item() + 1.0, e[1].item() + 2.0, e[2].item() + 3.0]
    auto = make_scheme("auto", candidates="fp16|signsgd:block=2")
    flushed = auto._flushed(ops, state, 1)
    assert flushed.corrected.tolist() == [0.0] * 3 and flushed.scale.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="signsgd: the saved state of tensor 'w' holds the residual e itself"):
        composite.check_loaded(scheme, "w", {"residual": torch.zeros(3)})
