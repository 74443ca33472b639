"""The compiled CPU fused forms of torch_backend/kernels (cpu_thc.py, cpu_topkc.py,
cpu_powersgd.py, cbuild.py and csrc/*.c) in whole schemes and beyond THC's kernels, against the
core's reference compositions (REFERENCE_OPS): THC's error feedback conserved over steps, whole
THC and TopKC runs close to the reference's, THC's noise bit for bit and its non-finite flag
without a separate check; TopKC's correct, top, pack and scatter forms; PowerSGD's basis and
agreement; the C code's results independent of the vector width; cbuild's cache, ``CC`` and
ImportError when the compiler fails. THC's forms kernel by kernel: tests/core/test_cpu_kernels.py.
"""
import ctypes
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import thc_kernels as K  # noqa: E402
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor, fp16_floor  # noqa: E402
from hvd_gradcomp.primitives import one_rank  # noqa: E402
from hvd_gradcomp.thc import THCConfig, THCScheme  # noqa: E402
from hvd_gradcomp.topkc import _correct_kernel, _pack_kernel, _scatter_kernel, _top_kernel  # noqa: E402
from tests.core.cpu_kernel_cases import (CONFIGS, ROOT, R, noise_bits, thc_inputs, thc_setup,  # noqa: E402
                                         with_nonfinite)
from tests.core.thc_emulation import emulate_allreduce  # noqa: E402
from torch_backend import kernels  # noqa: E402
from torch_backend.kernels import cbuild, cpu_powersgd, cpu_thc, cpu_topkc  # noqa: E402  (ImportError: no compiler)
from torch_backend.ops import OPS, REFERENCE_OPS  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)


# ------------------------------------------------------------------ whole schemes

def _run(ops, scheme, info, grads, n_steps):
    state = scheme.init(ops, info, grads[0])
    outs = []
    for t in range(n_steps):
        payload, ctx = compress_tensor(scheme, ops, grads[t], state, info)
        out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        outs.append(out)
    return outs, state


@pytest.mark.parametrize("config", [{}, {"flush": None}, {"rotation_stages": 5}, {"saturation": False}],
                         ids=["default", "noflush", "B32", "peak"])
def test_error_feedback_conserved(config):
    """One rank under Sum: the outputs of T steps plus the final residual (rotated back) sum to
    the inputs (error feedback loses nothing), within float32 rounding, through the fused
    forms; and they stay close to the reference run."""
    d, steps = 5000, 6
    scheme = THCScheme(THCConfig(**config))
    info = TensorInfo("w", (d,), "float32", 1, 0, "sum")
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(d, generator=gen) * (1.0 + 3.0 * (t % 2)) for t in range(steps)]
    outs, state = _run(one_rank(OPS), scheme, info, grads, steps)
    left = scheme.residual_of(R, state, info)
    total_in = torch.stack(grads).double().sum(0)
    total_out = torch.stack(outs).double().sum(0) + left.double()
    assert (total_out - total_in).abs().max() <= 2e-5 * total_in.abs().max()
    ref_outs, ref_state = _run(one_rank(REFERENCE_OPS), THCScheme(THCConfig(**config)), info, grads, steps)
    for a, b in zip(outs, ref_outs):
        # the rounding of the two transforms can flip a level: one grid step, spread by the
        # inverse rotation over a block (delta / sqrt(B) per coordinate), rarely
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
        assert (a - b).abs().mean() <= 1e-3 * b.abs().mean() + 1e-6


@pytest.mark.parametrize("n,op", [(2, "sum"), (3, "average"), (4, None)])
def test_thc_ranks_match_reference(n, op):
    """n simulated ranks, 3 steps, payloads all-reduced by hand: the fused run's outputs and
    agreed ranges track the reference run's."""
    d, steps = 3000, 3

    def simulate(ops):
        schemes = [THCScheme(THCConfig()) for _ in range(n)]
        infos = [TensorInfo("w", (d,), "float32", n, r, op) for r in range(n)]
        gen = torch.Generator().manual_seed(8)
        grads = [[torch.randn(d, generator=gen) for _ in range(n)] for _ in range(steps)]
        states = [s.init(ops, i, grads[0][0]) for s, i in zip(schemes, infos)]
        outs, payloads = [], []
        for t in range(steps):
            sent = [compress_tensor(s, ops, grads[t][r], states[r], infos[r]) for r, s in enumerate(schemes)]
            total = torch.from_numpy(emulate_allreduce([p.numpy() for p, _ in sent], op or "sum", n))
            payloads.append([p for p, _ in sent])
            step_outs = []
            for r, s in enumerate(schemes):
                out, states[r] = finish_tensor(s, ops, total, sent[r][1], states[r], infos[r])
                step_outs.append(out)
            outs.append(step_outs)
        return outs, states, payloads

    outs, states, payloads = simulate(one_rank(OPS))
    ref_outs, ref_states, ref_payloads = simulate(one_rank(REFERENCE_OPS))
    for step_outs, step_ref in zip(outs, ref_outs):
        for a in step_outs[1:]:
            assert torch.equal(a, step_outs[0])  # every rank decodes the same sum
        b = step_ref[0]
        assert (step_outs[0] - b).abs().mean() <= 2e-3 * b.abs().mean() + 1e-6
    for s, r in zip(states, ref_states):
        torch.testing.assert_close(s.ranges, r.ranges, rtol=0.2, atol=0)  # a code may move a step
        assert int(s.step) == int(r.step) and int(s.realigned) == int(r.realigned) == 0


@pytest.mark.parametrize("key", [0, 1, 0x9E3779B9, 2 ** 32 - 1, 123456789])
@pytest.mark.parametrize("d, config", [(5000, {}), (3000, {"rotation_stages": 5}), (70, {"rotation": "full"})])
def test_noise_is_bit_exact(key, d, config):
    """The C hash of step 3's bits equals the reference composition's (rng.bits32) bit for
    bit, for keys across [0, 2**32) and several block layouts."""
    _, _, lay, plan = thc_setup(d, **config)
    ranges = torch.zeros(lay.blocks)
    want = K._noise_kernel(R, plan, torch.tensor(key), ranges)
    got = cpu_thc.noise(plan, torch.tensor(key), ranges)
    for a, b in zip(want, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(a, b)


def test_topkc_correct_matches_reference():
    for d in (1, 5, 1000, 1024, 4097):
        for chunk in (1, 7, 256):
            for ef, blocking, decay in [(True, False, 1.0), (True, False, 0.95), (True, True, 1.0),
                                        (True, True, 0.9), (False, False, 1.0), (False, True, 1.0)]:
                gen = torch.Generator().manual_seed(d + chunk)
                flat = torch.randn(d, generator=gen)
                residual = torch.randn(d, generator=gen) if ef else flat
                plan = (chunk, ef, blocking, decay)
                ref = _correct_kernel(R, plan, flat, residual)
                got = cpu_topkc.correct(plan, flat, residual)
                assert len(got) == len(ref) == 2
                for a, b in zip(ref, got):
                    assert (a.shape, a.dtype) == (b.shape, b.dtype)
                assert torch.equal(ref[0], got[0])
                torch.testing.assert_close(got[1], ref[1], rtol=2e-6, atol=0)
                if not ef and -(-d // chunk) * chunk == d:  # the reference's view of the gradient
                    assert got[0].data_ptr() == flat.data_ptr()
    flat = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    for blocking in (True, False):
        ref = _correct_kernel(R, (2, True, blocking, 1.0), flat, torch.zeros(4))
        got = cpu_topkc.correct((2, True, blocking, 1.0), flat, torch.zeros(4))
        assert torch.equal(ref[1].isnan(), got[1].isnan())
        assert torch.equal(ref[1].nan_to_num(), got[1].nan_to_num())


@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_topkc_top_is_the_stable_argsort(kind):
    """The radix selection gives the reference's indices exactly: ties by lower index, NaN
    above +inf, -0 equal to +0, subnormals in their place; k from 0 to m."""
    gen = torch.Generator().manual_seed(3)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 3.0])
    for m in (1, 2, 17, 1000, 5000):
        if kind == "randn":
            v = torch.randn(m, generator=gen)
        elif kind == "ties":
            v = torch.randint(0, 5, (m,), generator=gen).float()
        else:
            v = special[torch.randint(0, len(special), (m,), generator=gen)]
        for k in sorted({0, 1, m // 10, m // 2, m}):
            want, got = _top_kernel(R, k, v), cpu_topkc.top(k, v)
            assert (want.shape, want.dtype) == (got.shape, got.dtype) and torch.equal(want, got), (m, k)


def _pack_inputs(d, chunk, ef, blocking, decay, seed):
    """(flat, chunks, scores, idx) as TopKC's compress hands them to _pack_kernel: the
    reference's correct kernel on a gradient with a few coordinates beyond float16's range
    (saturated) and some below its normal range (subnormal or 0 in float16)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(d, generator=gen) * 100.0
    flat[::97] *= 3000.0
    flat[5::89] *= 1e-9
    residual = torch.randn(d, generator=gen) if ef else flat
    chunks, scores = _correct_kernel(R, (chunk, ef, blocking, decay), flat, residual)
    m = chunks.shape[0]
    idx = torch.randperm(m, generator=gen)[:max(1, m // 10)]
    return flat, chunks, scores, idx


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("n", [1, 3])
def test_topkc_pack_and_scatter_are_bit_exact(dtype, n):
    """_pack_kernel's payload values, sent and residual, and _scatter_kernel's output, equal
    the reference's bit for bit (the vote too); the rescored score part within float32
    rounding before its cast (a norm), bit for bit where nothing is rescored."""
    limit = fp16_floor(65504.0 / n)
    for d in (1, 5, 1000, 1024, 4097):
        for chunk in (1, 7, 256):
            m = -(-d // chunk)
            for ef, blocking, decay in [(True, False, 1.0), (True, False, 0.95), (True, True, 1.0),
                                        (False, False, 1.0), (False, True, 1.0)]:
                flat, chunks, scores, idx = _pack_inputs(d, chunk, ef, blocking, decay, d + chunk + n)
                k = idx.shape[0]
                plan = (chunk, ef, blocking, decay, dtype, 1.0 / n, float(n), limit)
                finite = (torch.tensor(True),) if d % 2 else ()  # poison()'s + 0 (-0 becomes +0), or none
                ref = _pack_kernel(R, plan, flat, chunks.clone(), scores.clone(), idx, *finite)
                got = cpu_topkc.pack(plan, flat, chunks.clone(), scores.clone(), idx, *finite)
                tag = (d, chunk, ef, blocking, decay)
                for a, b in zip(ref, got):
                    assert (a.shape, a.dtype) == (b.shape, b.dtype), tag
                assert torch.equal(ref[0][:k * chunk], got[0][:k * chunk]), tag
                assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2]), tag
                if not blocking:
                    assert torch.equal(ref[0][k * chunk + m:], got[0][k * chunk + m:]), tag  # the vote
                    part = slice(k * chunk, k * chunk + m)
                    if ef:
                        torch.testing.assert_close(got[0][part].float(), ref[0][part].float(), rtol=2e-3, atol=0)
                    else:
                        assert torch.equal(ref[0][part], got[0][part]), tag
                for split in ((), (torch.tensor(False),), (torch.tensor(True),)):
                    splan = (chunk, d, float(n), dtype)
                    want = _scatter_kernel(R, splan, ref[0], idx, *split)
                    out = cpu_topkc.scatter(splan, ref[0], idx, *split)
                    assert (out.shape, out.dtype) == (want.shape, want.dtype) and torch.equal(out, want), tag


def test_topkc_pack_float16_cast_and_nonfinite():
    """The C float32 -> float16 cast is PyTorch's for every kind of value (normal, subnormal,
    ties, overflow past the limit, infinities), and a NaN stays a NaN in the payload, in sent,
    the residual and the decoded output."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), dtype=torch.int64, generator=gen)
    randoms = bits.to(torch.int32).view(torch.float32)
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties = (halves[:-1] + (halves[1:] - halves[:-1]) / 2)  # midpoints where both neighbours are finite
    values = torch.cat([randoms, halves, ties, halves.nextafter(torch.tensor(float("inf"))),
                        torch.tensor([float("inf"), -float("inf"), 65519.0, 65520.0, 1e-8, -6e-8])])
    values = values[torch.isfinite(values) | torch.isinf(values)]
    values = torch.cat([values, torch.zeros(-values.numel() % 64)])
    plan = (64, True, False, 1.0, "float16", 1.0, 1.0, 65504.0)
    chunks = values.view(-1, 64)
    idx = torch.arange(chunks.shape[0])
    ref = _pack_kernel(R, plan, values, chunks.clone(), torch.zeros(chunks.shape[0]), idx)
    got = cpu_topkc.pack(plan, values, chunks.clone(), torch.zeros(chunks.shape[0]), idx)
    k = values.numel()
    assert torch.equal(ref[0][:k].view(torch.int16), got[0][:k].view(torch.int16))
    assert torch.equal(ref[1].view(torch.int32), got[1].view(torch.int32))
    flat = torch.randn(1000)
    flat[3] = float("nan")
    chunks, scores = _correct_kernel(R, (100, True, False, 1.0), flat, torch.zeros(1000))
    plan = (100, True, False, 1.0, "float16", 0.5, 2.0, fp16_floor(65504.0 / 2))
    idx = torch.tensor([0, 4, 9])
    ref = _pack_kernel(R, plan, flat, chunks.clone(), scores.clone(), idx)
    got = cpu_topkc.pack(plan, flat, chunks.clone(), scores.clone(), idx)
    for a, b in zip(ref, got):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    out = cpu_topkc.scatter((100, 1000, 2.0, "float16"), got[0], idx)
    assert out[3].isnan() and int(out.isnan().sum()) == 1
    for dtype in ("float16", "float32"):  # a step that is not finite: the payload all NaN
        plan = (100, True, False, 1.0, dtype, 0.5, 2.0, fp16_floor(65504.0 / 2))
        got = cpu_topkc.pack(plan, flat, chunks.clone(), scores.clone(), idx, torch.tensor(False))
        want = _pack_kernel(R, plan, flat, chunks.clone(), scores.clone(), idx, torch.tensor(False))
        assert got[0].dtype == want[0].dtype and bool(got[0].isnan().all()) and bool(want[0].isnan().all())
        assert torch.equal(got[2].nan_to_num(), want[2].nan_to_num())


def test_topkc_pack_and_scatter_refuse_bad_indices():
    """A repeated or out-of-range chunk index raises IndexError (nothing is written)."""
    flat, chunks, scores, _ = _pack_inputs(1000, 100, True, False, 1.0, 1)
    plan = (100, True, False, 1.0, "float16", 1.0, 1.0, 65504.0)
    for idx in (torch.tensor([1, 1]), torch.tensor([10]), torch.tensor([-1])):
        with pytest.raises(IndexError):
            cpu_topkc.pack(plan, flat, chunks.clone(), scores.clone(), idx)
        with pytest.raises(IndexError):
            cpu_topkc.scatter((100, 1000, 1.0, "float16"), torch.zeros(300, dtype=torch.float16), idx)


@pytest.mark.parametrize("spec", ["topkc:0.1", "topkc:ratio=0.05,residual_decay=0.9,chunk=100"])
def test_topkc_scheme_matches_reference(spec):
    """TopKC through OPS (fused) and REFERENCE_OPS: the same payload values and selections;
    scores within float32 rounding before their float16 cast."""
    from hvd_gradcomp.registry import make_scheme, parse_spec
    d, steps = 10000, 4
    info = TensorInfo("w", (d,), "float32", 1, 0, "sum")
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(d, generator=gen) for _ in range(steps)]
    name, options = parse_spec(spec)
    outs, state = _run(one_rank(OPS), make_scheme(name, **options), info, grads, steps)
    ref_outs, ref_state = _run(one_rank(REFERENCE_OPS), make_scheme(name, **options), info, grads, steps)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * float(b.abs().max()))
    torch.testing.assert_close(state.residual, ref_state.residual, rtol=0, atol=1e-3)


@pytest.mark.parametrize("config", CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "default"
                                                   for c in CONFIGS])
@pytest.mark.parametrize("bad", ["nan", "inf", "pair"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_thc_flags_nonfinite_without_a_separate_check(config, bad, fused, monkeypatch):
    """THC takes no separate finite check (``guards_nonfinite`` False): a NaN, an inf, or an
    inf/-inf pair in the gradient still sets the rank's "not finite" control word and makes the
    output all NaN, and the state stays as it was, in every configuration, fused or not."""
    if not fused:
        monkeypatch.setenv(kernels.ENV, "0")
    scheme, info, lay, plan = thc_setup(3000, n=1, op="sum", **config)
    assert scheme.guards_nonfinite is False
    ops = one_rank(OPS)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    state = scheme.init(ops, info, x)
    payload, ctx = compress_tensor(scheme, ops, x, state, info)  # one good step: ranges agreed
    _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    x = with_nonfinite(x, bad)
    payload, ctx = compress_tensor(scheme, ops, x, state, info)
    assert int(payload[-3]) >> lay.levels.guard == 1  # the "not finite" word
    out, after = finish_tensor(scheme, ops, payload, ctx, state, info)
    assert out.isnan().all()
    for field, a, b in zip(state._fields, after, state):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), field


# ------------------------------------------------------------------ PowerSGD's basis
@pytest.mark.parametrize("r,n", [(1, 5), (4, 256), (8, 1001), (3, 7)])
def test_powersgd_basis_matches_reference(r, n):
    """``cpu_powersgd.basis``: within float32 rounding of ``basis_rows``' composition, with its
    guards: a zero row takes the fill's, a dependent row comes out exactly zero, the others
    orthonormal."""
    from hvd_gradcomp.orthogonalize import DEPENDENT_TOL, basis_rows
    gen = torch.Generator().manual_seed(r * 1000 + n)
    pt = torch.randn(r, n, generator=gen)
    fill = torch.rand(r, n, generator=gen) * 2.0 - 1.0
    if r >= 3:
        pt[1] = 0.0  # takes fill's row
        pt[2] = pt[0] * -3.0  # dependent: exactly zero
    want = basis_rows(R, DEPENDENT_TOL, pt, fill)
    got = cpu_powersgd.basis(DEPENDENT_TOL, pt, fill)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6
    live = got.abs().sum(1) > 0
    assert torch.equal(live, want.abs().sum(1) > 0)
    if r >= 3:
        assert not live[2] and (got[2] == 0).all() and live[1]
    gram = got[live] @ got[live].T
    assert (gram - torch.eye(int(live.sum()))).abs().max() <= 1e-5


def test_powersgd_basis_nonfinite_fallback_and_dispatch():
    """A NaN row stays non-finite (and so do the rows after it), as in the reference; more
    rows than the C loop takes, or another dtype, run the reference; PowerSGD's finish runs the
    fused form through ``ops.fuse``."""
    from hvd_gradcomp.orthogonalize import DEPENDENT_TOL, basis_rows
    pt = torch.randn(3, 10)
    pt[1, 4] = float("nan")
    got, want = cpu_powersgd.basis(DEPENDENT_TOL, pt, pt), basis_rows(R, DEPENDENT_TOL, pt, pt)
    assert torch.equal(got.isnan(), want.isnan()) and got[1:].isnan().all() and not got[0].isnan().any()
    for big in (torch.randn(cpu_powersgd.MAX_RANK + 1, 70), torch.randn(3, 70, dtype=torch.float64)):
        assert torch.equal(cpu_powersgd.basis(DEPENDENT_TOL, big, big), basis_rows(R, DEPENDENT_TOL, big, big))
    # the C loop itself refuses more rows than its coefficient array holds, writing nothing
    big = torch.randn(cpu_powersgd.MAX_RANK + 1, 8)
    out = torch.zeros_like(big)
    assert cpu_powersgd._lib.hgc_basis(big.data_ptr(), big.data_ptr(), 8, cpu_powersgd.MAX_RANK + 1,
                                       DEPENDENT_TOL, out.data_ptr()) == -1 and not out.any()
    assert kernels.fused_form(basis_rows, DEPENDENT_TOL, "cpu") is cpu_powersgd.basis
    kernels._CHOSEN.clear()
    from hvd_gradcomp.powersgd import PowerSGDConfig, PowerSGDScheme
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    info = TensorInfo("w", (64, 32), "float32", 1, 0, "sum")
    ops = one_rank(OPS)
    state = scheme.init(ops, info, torch.zeros(1))
    for _ in range(2):
        payload, ctx = compress_tensor(scheme, ops, torch.randn(64, 32), state, info)
        _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    assert cpu_powersgd.basis in kernels._CHOSEN.values()


def test_powersgd_agree_matches_reference():
    """``cpu_powersgd.agree``: PowerSGD's check on receipt, the reference's ``(keep, ok)`` for
    payloads whose ranks agree, disagree in parity or in a fingerprint (within and beyond the
    tolerance), hold a NaN (keep 1, not ok) or an inf, at 1, 2 and 64 ranks."""
    from hvd_gradcomp.powersgd import _agree_kernel
    gen = torch.Generator().manual_seed(3)
    cases = []
    for n in (1, 2, 64):
        body = torch.randn(40, generator=gen)
        f = torch.randn(2, generator=gen)
        agreed = torch.tensor([n, 0.0, n * f[0], n * f[0] ** 2, n * f[1], n * f[1] ** 2])
        parity = agreed.clone()
        parity[1] = 1.0
        print_ = agreed.clone()
        print_[3] = print_[3] * 1.01 + 0.5  # S2 n > S1^2: fingerprints differ
        near = agreed.clone()
        near[3] = near[3] * (1.0 + 2.0 ** -23)  # within the tolerance
        for control in (agreed, parity, print_, near):
            cases.append((n, torch.cat([body, control])))
        nan = torch.cat([body, agreed])
        nan[5] = float("nan")
        inf = torch.cat([body, agreed])
        inf[-1] = float("inf")
        cases += [(n, nan), (n, inf)]
    seen = set()
    for n, payload in cases:
        keep, ok = cpu_powersgd.agree(n, payload)
        want_keep, want_ok = _agree_kernel(R, n, payload)
        assert keep.dtype == torch.float32 and ok.dtype == torch.bool and keep.shape == () and ok.shape == ()
        assert float(keep) == float(want_keep) and bool(ok) == bool(want_ok), (n, payload[-6:])
        seen.add((float(keep), bool(ok)))
    assert seen == {(1.0, True), (0.0, True), (1.0, False), (0.0, False)}  # (an inf S2: a spread of inf)
    assert kernels.fused_form(_agree_kernel, 2, "cpu") is cpu_powersgd.agree


# ------------------------------------------------------------------ the C code and its build

def test_result_independent_of_vector_width():
    """The library for this CPU, one for baseline x86-64 (SSE2 only) and one with the scalar
    Walsh-Hadamard form compute the same bits: the C source fixes every float operation."""
    variants = [("-DHGC_SCALAR_WHT",)]
    if os.uname().machine in ("x86_64", "AMD64"):
        variants.append(("-march=x86-64", "-mtune=generic"))
    scheme, info, lay, plan = thc_setup(20000, n=3)
    x, residual, diag, hmat, ranges = thc_inputs(scheme, info, lay, seed=31)
    rows, cols = noise_bits(lay, 5)

    def run(lib):
        padded, block = lay.padded, lay.block
        y, held = torch.empty(padded), torch.empty(padded)
        wanted = torch.empty(lay.blocks)
        P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.hgc_thc_rotate.argtypes = [P, I, P, I, I, P, P, P, P, F, F]
        lib.hgc_thc_rotate(x.data_ptr(), x.numel(), diag.data_ptr(), padded, block, residual.data_ptr(),
                           y.data_ptr(), held.data_ptr(), wanted.data_ptr(),
                           plan.threshold / math.sqrt(block), 1.0)
        words = lay.words
        payload = torch.randint(0, 1 << 20, (words,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
        one, zero = torch.tensor(3), torch.tensor(0)
        no = torch.tensor(False)
        lev = lay.levels
        lib.hgc_thc_decode.argtypes = [P, P, I, I, I, P, I, I, I, I, I, I, P, P, P, P, F, F, F, ctypes.c_int, F, P, P]
        lib.hgc_thc_decode.restype = ctypes.c_int32
        outs = []
        for own in (None, torch.randint(0, 1 << 20, (words,), dtype=torch.int32,
                                        generator=torch.Generator().manual_seed(2))):
            # the whole [P], and an engine's [d] with 1/2 folded in (the block that crosses d aside)
            for size, factor in ((padded, 1.0), (x.numel(), 0.5)):
                out = torch.empty(size)
                assert lib.hgc_thc_decode(payload.data_ptr(), ranges.data_ptr(), padded, size, block,
                                          diag.data_ptr(), lev.lanes, lev.width, lev.guard, lev.offset, 3, 0,
                                          one.data_ptr(), zero.data_ptr(), no.data_ptr(), no.data_ptr(),
                                          K._grid(lev.top), 0.5 * K._top_level(lev.top), 1.0 / 3,
                                          int(factor != 1.0), factor, None if own is None else own.data_ptr(),
                                          out.data_ptr()) == 0
                outs.append(out)
        return torch.cat([y, held, wanted] + outs)

    native = run(cbuild.load("thc"))
    for flags in variants:
        other = run(cbuild.load("thc", flags))
        assert torch.equal(native.view(torch.int32), other.view(torch.int32)), flags


def test_build_cache_and_compiler_errors(tmp_path, monkeypatch):
    """The library lands in $HVD_GRADCOMP_CACHE/kernels/<hash>/ with no temporary left; a
    failing $CC is an ImportError naming the compiler."""
    monkeypatch.setenv("HVD_GRADCOMP_CACHE", str(tmp_path))
    lib = cbuild.load("topkc")
    assert lib.hgc_topkc_correct
    built = list((tmp_path / "kernels").glob("*/*"))
    assert [p.name for p in built] == ["libtopkc.so"], built
    monkeypatch.setenv("CC", "false")
    with pytest.raises(ImportError, match="false"):
        cbuild.load("topkc", ("-DANOTHER_BUILD",))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(ImportError, match="no-such-cc"):
        cbuild.load("thc", ("-DANOTHER_BUILD",))


def test_ranks_compile_at_once(tmp_path):
    """Four processes that find an empty cache compile at once and all load the library."""
    env = dict(os.environ, HVD_GRADCOMP_CACHE=str(tmp_path), PYTHONPATH=ROOT)
    code = "from torch_backend.kernels import cbuild; print(bool(cbuild.load('topkc').hgc_topkc_correct))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "True" for p, (out, _) in zip(procs, results)), results
    assert [p.name for p in (tmp_path / "kernels").glob("*/*")] == ["libtopkc.so"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_runs_gather_and_scatter_match_index_ops(dtype):
    """torch_backend.kernels.runs: a non-contiguous flat group copied run by run equals
    index_select / index_copy_ with the unit's index, for any buffer dtype; adjacent members
    merge into one run."""
    from hvd_gradcomp.buckets import Unit
    from torch_backend.kernels import runs
    members = [(0, 5), (5, 12), (20, 31), (40, 41)]  # the first two touch: one run
    index = torch.cat([torch.arange(a, b) for a, b in members])
    unit = Unit("g", None, None, (0, 1, 2, 3), -1, -1, index, ((0, 12), (20, 31), (40, 41)))
    buffer = torch.randn(50).to(dtype)
    assert torch.equal(runs.gather(buffer, unit), buffer.index_select(0, index))
    assert runs.gather(buffer, unit).dtype == dtype
    values = torch.randn(index.numel())
    want = buffer.clone().index_copy_(0, index, values.to(dtype))
    runs.scatter(buffer, unit, values)
    assert torch.equal(buffer, want)



@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86-64 baseline build")
def test_topkc_result_independent_of_vector_width(monkeypatch):
    """TopKC's library for this CPU (F16C casts, non-temporal stores where it has them) and one
    for baseline x86-64 (software casts, memcpy) compute the same bits."""
    native = cpu_topkc._lib
    other = cbuild.load("topkc", ("-march=x86-64", "-mtune=generic"))
    for name in ("hgc_topkc_correct", "hgc_topkc_pack", "hgc_topkc_scatter", "hgc_topkc_top"):
        getattr(other, name).argtypes = getattr(native, name).argtypes
        getattr(other, name).restype = getattr(native, name).restype

    monkeypatch.setattr(cpu_topkc, "STREAM_MIN", 1)  # the non-temporal stores too

    def run(lib):
        monkeypatch.setattr(cpu_topkc, "_lib", lib)
        gen = torch.Generator().manual_seed(1)
        flat, residual = torch.randn(100000, generator=gen) * 1000, torch.randn(100000, generator=gen)
        chunks, scores = cpu_topkc.correct((256, True, False, 1.0), flat, residual)
        idx = cpu_topkc.top(40, scores)
        payload, sent, left = cpu_topkc.pack((256, True, False, 1.0, "float16", 0.25, 4.0, 16376.0), flat,
                                             chunks.clone(), scores.clone(), idx, torch.tensor(True))
        out = cpu_topkc.scatter((256, 100000, 4.0, "float16"), payload, idx)
        return [chunks, scores, idx, payload.view(torch.int16), sent, left, out]

    for a, b in zip(run(native), run(other)):
        assert torch.equal(a, b)
