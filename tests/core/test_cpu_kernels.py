"""The compiled CPU fused forms of torch_backend/kernels (cpu_thc.py, cbuild.py and csrc/*.c)
against the core's reference compositions (REFERENCE_OPS): the providers' loading and the
``HVD_GRADCOMP_KERNELS`` switch, and THC's forms kernel by kernel.

What each fused form promises (the providers' docstrings) and how it is checked here:

- THC ``_quantize_kernel``: given the reference's ``y``, payload, residual and saturation count
  equal the reference's bit for bit (random, saturated, zero-range, non-finite blocks).
- THC ``_rotate_kernel``: ``y`` within 1e-5 of each block's peak (a butterfly for the dense
  Walsh-Hadamard products), ``wanted`` within 1e-5 relative, statistics' codes within one step
  where ``4 log2(wanted)`` sits at a rounding boundary, the finite flag equal.
- THC ``_decode_kernel``: on all-reduced payloads of several ranks (Sum, Average, op unknown,
  a rank not finite, fingerprints that disagree), within float32 rounding of the reference.
- THC's new residual plus the decoded value is ``y`` plus what the flush bound held back,
  through the three forms, within float32 rounding.
- Levels equal end to end but for a tiny fraction; ``HVD_GRADCOMP_KERNELS=0`` gives the
  reference bit for bit.

Whole schemes (error feedback conserved, THC and TopKC runs close to the reference's), TopKC's
and PowerSGD's forms, the C code's independence of the vector width and cbuild:
tests/core/test_cpu_kernels_schemes.py. The shared cases: tests/core/cpu_kernel_cases.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import hadamard, thc_kernels as K  # noqa: E402
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor  # noqa: E402
from hvd_gradcomp.lanes import CODE_SCALE  # noqa: E402
from hvd_gradcomp.primitives import one_rank  # noqa: E402
from hvd_gradcomp.thc import THCConfig, THCScheme  # noqa: E402
from hvd_gradcomp.topkc import _correct_kernel, _pack_kernel, _scatter_kernel, _top_kernel  # noqa: E402
from tests.core.cpu_kernel_cases import (CONFIGS, SIZES, R, block_tol, fused_form_of, noise_bits,  # noqa: E402
                                         thc_inputs, thc_setup, with_nonfinite)
from tests.core.thc_emulation import emulate_allreduce  # noqa: E402
from torch_backend import kernels  # noqa: E402
from torch_backend.kernels import cpu_thc, cpu_topkc, tables  # noqa: E402  (ImportError: no compiler)
from torch_backend.ops import OPS, REFERENCE_OPS  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)


# ------------------------------------------------------------------ dispatch and switches

def test_providers_load_and_register():
    status = kernels.status()
    assert status["torch_backend.kernels.cpu_thc"] == "loaded", status
    assert status["torch_backend.kernels.cpu_topkc"] == "loaded", status
    _, _, _, plan = thc_setup(4096)
    assert kernels.fused_form(K._rotate_kernel, plan, "cpu") is cpu_thc.rotate
    assert kernels.fused_form(K._quantize_kernel, plan, "cpu") is cpu_thc.quantize
    assert kernels.fused_form(K._decode_kernel, plan, "cpu") is cpu_thc.decode
    assert kernels.fused_form(K._noise_kernel, plan, "cpu") is cpu_thc.noise
    assert kernels.fused_form(K._receive_kernel, plan, "cpu") is cpu_thc.receive
    assert kernels.fused_form(K._finish_kernel, plan, "cpu") is cpu_thc.finish
    assert kernels.fused_form(hadamard.sylvester, 32, "cpu") is tables.sylvester
    assert kernels.fused_form(_correct_kernel, (256, True, False, 1.0), "cpu") is cpu_topkc.correct
    assert kernels.fused_form(_pack_kernel, (256, True, False, 1.0, "float16", 0.5, 2.0, 32752.0),
                              "cpu") is cpu_topkc.pack
    assert kernels.fused_form(_scatter_kernel, (256, 1000, 2.0, "float16"), "cpu") is cpu_topkc.scatter
    assert kernels.fused_form(_top_kernel, 10, "cpu") is cpu_topkc.top
    # a block beyond MAX_BLOCK (rotation="full" of a large tensor) keeps the reference
    _, _, _, big = thc_setup(cpu_thc.MAX_BLOCK + 1, rotation="full")
    assert not cpu_thc.accepts(big) and kernels.fused_form(K._rotate_kernel, big, "cpu") is None


def test_switch_off_runs_the_reference(monkeypatch):
    """HVD_GRADCOMP_KERNELS=0: ops.fuse is the reference itself, and a THC step through OPS is
    the REFERENCE_OPS step bit for bit; unset, the fused forms run (the outputs differ in
    rounding, which is what makes this test able to fail)."""
    def run(primitives):
        scheme, info, _, _ = thc_setup(5000, n=1, op="sum")
        ops = one_rank(primitives)
        x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
        state = scheme.init(ops, info, x)
        outs = []
        for _ in range(3):
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
            outs.append(out)
        return torch.cat(outs + [state.residual])

    ref = run(REFERENCE_OPS)
    fused = run(OPS)
    assert not torch.equal(fused, ref)  # the fused forms ran
    torch.testing.assert_close(fused, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    monkeypatch.setenv(kernels.ENV, "0")
    _, _, _, plan = thc_setup(5000, n=1, op="sum")
    marker = object()
    assert kernels.dispatch(K._rotate_kernel, plan, marker) is marker
    assert torch.equal(run(OPS), ref)


# ------------------------------------------------------------------ THC, kernel by kernel

@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("d", SIZES)
def test_rotate_matches_reference(config, d):
    scheme, info, lay, plan = thc_setup(d, **config)
    x, residual, diag, hmat, _ = thc_inputs(scheme, info, lay, seed=d)
    finite = torch.tensor(True)
    rotate = fused_form_of(K._rotate_kernel, plan)
    if rotate is None:
        return
    ref = K._rotate_kernel(R, plan, x, residual, diag, hmat, finite)
    got = rotate(plan, x, residual, diag, hmat, finite)
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
    (y0, h0, w0, s0, f0), (y1, h1, w1, s1, f1) = ref, got
    tol = block_tol(y0, lay.block)
    assert ((y1 - y0).abs() <= tol).all()
    if h0.numel():
        assert ((h1 - h0).abs() <= tol).all()
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=0)
    assert bool(f1) == bool(f0) is True
    if s0.numel():
        # the codes of one rank alone (Sum of one word): equal, or one apart at a boundary
        codes0 = K.agreed_scales(R, s0, True, 1, plan.stats, lay.blocks)
        codes1 = K.agreed_scales(R, s1, True, 1, plan.stats, lay.blocks)
        c0 = torch.round(torch.log2(codes0.clamp_min(1e-38)) * CODE_SCALE)
        c1 = torch.round(torch.log2(codes1.clamp_min(1e-38)) * CODE_SCALE)
        differ = c0 != c1
        edge = (torch.log2(w0) * CODE_SCALE - torch.floor(torch.log2(w0) * CODE_SCALE) - 0.5).abs() < 1e-4
        assert not (differ & ~edge).any()
        # and exactly what pack_scales makes of the fused form's own ranges
        usable = torch.logical_and(w1 > K.TINY_SCALE, f1)
        assert torch.equal(s1, K.pack_scales(R, w1, usable, plan.stats))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("range_scale", [1.0, 0.05])  # 0.05: most coordinates saturate
def test_quantize_is_bit_exact(config, d, range_scale):
    scheme, info, lay, plan = thc_setup(d, **config)
    x, residual, diag, hmat, ranges = thc_inputs(scheme, info, lay, seed=d + 1)
    ranges = ranges * range_scale
    finite = torch.tensor(True)
    y, held, _, stats, finite = K._rotate_kernel(R, plan, x, residual, diag, hmat, finite)
    rows, cols = noise_bits(lay, 977 + d)
    fingerprint = torch.tensor(5)
    quantize = fused_form_of(K._quantize_kernel, plan)
    if quantize is None:
        return
    ref = K._quantize_kernel(R, plan, y, held, ranges, rows, cols, fingerprint, finite, stats)
    got = quantize(plan, y, held, ranges, rows, cols, fingerprint, finite, stats)
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert torch.equal(a, b)
    if range_scale < 1.0 and d > 100:
        assert int(got[2]) > d // 4  # the saturation count was exercised


@pytest.mark.parametrize("n,op", [(1, "sum"), (2, "sum"), (5, None), (16, "average"), (64, "average"),
                                  (1024, "average")])
@pytest.mark.parametrize("config", [{}, {"lane_bits": None, "bits": 8}, {"bits": 2}], ids=["default", "wide", "bits2"])
def test_quantize_bit_exact_across_layouts(n, op, config):
    """Other world sizes and ops give other lanes, guard bits and offsets (lanes.lane_layout):
    the packed words are the reference's bit for bit in each."""
    scheme, info, lay, plan = thc_setup(3000, n=n, op=op, **config)
    x, residual, diag, hmat, ranges = thc_inputs(scheme, info, lay, seed=n)
    y, held, wanted, stats, finite = K._rotate_kernel(R, plan, x, residual, diag, hmat, torch.tensor(True))
    rows, cols = noise_bits(lay, n)
    fingerprint = torch.tensor(n % 7)
    ref = K._quantize_kernel(R, plan, y, held, wanted * 0.7, rows, cols, fingerprint, finite, stats)
    got = cpu_thc.quantize(plan, y, held, wanted * 0.7, rows, cols, fingerprint, finite, stats)
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(a, b)


def test_quantize_nonfinite_and_boundaries():
    """Non-finite y (levels undefined but equal here: NaN as INT32_MIN), y exactly at +-R, u on
    level boundaries, and ranges of 0 in some blocks: bit for bit."""
    scheme, info, lay, plan = thc_setup(4096, op="sum")
    x, residual, diag, hmat, ranges = thc_inputs(scheme, info, lay, seed=9)
    y, held, wanted, stats, finite = K._rotate_kernel(R, plan, x, residual, diag, hmat, torch.tensor(True))
    y = y.clone()
    ranges = wanted.clone()
    ranges[1] = 0.0
    y[5], y[6], y[7] = float("nan"), float("inf"), -float("inf")
    y[1024 * 2 + 3] = ranges[2]  # exactly at +R
    y[1024 * 2 + 4] = -ranges[2]
    delta = ranges[3] * np.float32(K._grid(lay.levels.top))
    y[1024 * 3: 1024 * 3 + 50] = torch.arange(50, dtype=torch.float32) * delta - ranges[3]  # on the grid
    finite = torch.tensor(False)
    rows, cols = noise_bits(lay, 4242)
    fingerprint = torch.tensor(0)
    ref = K._quantize_kernel(R, plan, y, held, ranges, rows, cols, fingerprint, finite, stats)
    got = cpu_thc.quantize(plan, y, held, ranges, rows, cols, fingerprint, finite, stats)
    for a, b in zip(ref, got):
        assert torch.equal(a, b) if a.dtype != torch.float32 else torch.equal(a.isnan(), b.isnan())
        if a.dtype == torch.float32:
            assert torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("x_kind", ["nan", "inf", "overflow"])
def test_rotate_nonfinite(x_kind):
    """A NaN/inf coordinate, or a rotation that overflows ([3e38, -3e38]): not finite, in the
    same blocks (``wanted`` non-finite where the reference's is), as the reference."""
    scheme, info, lay, plan = thc_setup(3000)
    x, residual, diag, hmat, _ = thc_inputs(scheme, info, lay, seed=4)
    x = with_nonfinite(x, x_kind)
    finite = torch.tensor(True)
    ref = K._rotate_kernel(R, plan, x, residual, diag, hmat, finite)
    got = cpu_thc.rotate(plan, x, residual, diag, hmat, finite)
    assert bool(ref[4]) is False and bool(got[4]) is False
    assert torch.equal(torch.isfinite(ref[2]), torch.isfinite(got[2]))
    assert torch.equal(ref[3], got[3])  # no block usable: all statistics words zero


def _allreduced(scheme, info, lay, plan, n, op, seed, fingerprints=None, bad_rank=None, sent=None):
    """The all-reduced payload of ``n`` ranks (reference kernels), its ranges and diag/hmat.
    ``sent``: a list that receives each rank's own payload."""
    payloads, ranges = [], None
    for r in range(n):
        x, residual, diag, hmat, rng_ranges = thc_inputs(scheme, info, lay, seed=seed + r)
        if bad_rank == r:
            x = x.clone()
            x[0] = float("nan")
        finite = torch.isfinite(x.sum())
        y, held, wanted, stats, finite = K._rotate_kernel(R, plan, x, residual, diag, hmat, finite)
        ranges = rng_ranges if ranges is None else ranges  # the agreed ranges: one rank's draw
        rows, cols = noise_bits(lay, 1000 * seed + r)
        fp = torch.tensor(fingerprints[r] if fingerprints else 2)
        payloads.append(K._quantize_kernel(R, plan, y, held, ranges, rows, cols, fp, finite, stats)[0])
    if sent is not None:
        sent.extend(payloads)
    wrap = bad_rank is not None or lay.levels.others  # lanes for the others: sums may wrap
    total = emulate_allreduce([p.numpy() for p in payloads], op or "sum", n, wrap=wrap)
    return torch.from_numpy(total), ranges, diag, hmat


@pytest.mark.parametrize("n,op", [(1, "sum"), (3, "sum"), (3, "average"), (4, None), (7, "average"), (16, "average")])
@pytest.mark.parametrize("config", [{}, {"rotation_stages": 3}, {"lane_bits": None, "bits": 6},
                                    {"saturation": False, "range": "current"}],
                         ids=["default", "B8", "wide", "current"])
@pytest.mark.parametrize("d", [37, 2500])
def test_decode_matches_reference(n, op, config, d):
    scheme, info, lay, plan = thc_setup(d, n=n, op=op, **config)
    payload, ranges, diag, hmat = _allreduced(scheme, info, lay, plan, n, op, seed=d)
    count, bad, mismatch, inferred = K._receive_kernel(R, plan, payload)
    assert int(count) == n and not bool(mismatch) and int(bad) == 0
    ref = K._decode_kernel(R, plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred)
    got = cpu_thc.decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred)
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    tol = block_tol(ref, lay.block, 1e-5) + 1e-30
    assert ((got - ref).abs() <= tol).all(), float(((got - ref).abs() - tol).max())
    # An engine's mean written into its bucket: the same loop's values times 1/3 (rounded after
    # them, as a separate product), only the gradient's d coordinates written (the block that
    # crosses d decoded aside), the bucket around them untouched.
    bucket = torch.full((d + 5,), 7.0)
    into = bucket[2:2 + d]
    out = cpu_thc.decode(plan._replace(factor=1.0 / 3), payload, ranges, diag, hmat, count, bad, mismatch,
                         inferred, None, into)
    assert out.data_ptr() == into.data_ptr() and out.shape == (d,)
    assert torch.equal(into.view(torch.int32), (got[:d] * (1.0 / 3)).view(torch.int32))
    assert (bucket[:2] == 7.0).all() and (bucket[2 + d:] == 7.0).all()


def _no_decode_fallback(*args, **kwargs):
    """Stands in for ``cpu_thc``'s fallback composition where a test needs the C loop."""
    raise AssertionError("cpu_thc.decode fell back to the composition")


@pytest.mark.parametrize("n,op", [(1, "sum"), (2, "sum"), (2, "average"), (3, "sum"), (3, "average"), (3, None),
                                  (5, "average")])
@pytest.mark.parametrize("config", [{}, {"bits": 3}, {"lane_bits": None, "bits": 8}], ids=["default", "bits3", "wide"])
def test_decode_subtract_own_matches_reference(n, op, config, monkeypatch):
    """``subtract_own`` (lanes for the other ranks only): the C loop's decode of rank 0's view
    (its own words taken off, modulo 2**32, its levels added back; never the composition, its
    fallback, made to fail here) equals the reference's, and the reference's equals the plain
    layout's decode of the same levels, bit for bit."""
    d = 2500
    scheme, info, lay, plan = thc_setup(d, n=n, op=op, subtract_own=True, **config)
    assert lay.levels.others and lay.levels.offset == 0
    sent = []
    payload, ranges, diag, hmat = _allreduced(scheme, info, lay, plan, n, op, seed=3, sent=sent)
    own = sent[0][:lay.words].clone()
    count, bad, mismatch, inferred = K._receive_kernel(R, plan, payload)
    assert int(count) == n and not bool(mismatch) and int(bad) == 0
    ref = K._decode_kernel(R, plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own)
    monkeypatch.setattr(cpu_thc, "_decode_kernel", _no_decode_fallback)
    got = cpu_thc.decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own)
    monkeypatch.undo()
    tol = block_tol(ref, lay.block, 1e-5) + 1e-30
    assert ((got - ref).abs() <= tol).all(), float(((got - ref).abs() - tol).max())
    # the plain layout at the same levels, from the same ranks' levels: the same sums
    plain_scheme, _, plain, plain_plan = thc_setup(d, n=n, op=op, lane_bits=None, bits=config.get("bits", 4))
    if plain.levels.top == lay.levels.top:
        assert plain.words >= lay.words
        plain_payload = _allreduced(plain_scheme, info, plain, plain_plan, n, op, seed=3)[0]
        plain_ref = K._decode_kernel(R, plain_plan, plain_payload, ranges, diag, hmat, count, bad, mismatch,
                                     K._receive_kernel(R, plain_plan, plain_payload)[3])
        assert torch.equal(plain_ref, ref)


def test_subtract_own_runs_the_c_decode(monkeypatch):
    """Through ``ops.fuse`` a ``subtract_own`` THC decompress takes the C loop with the ctx's
    own words (the composition, its fallback, made to fail here), at world size 1 (the
    all-reduce the identity: the others' words all zero)."""
    info = TensorInfo("w", (3000,), "float32", 1, 0, "sum")
    ops = one_rank(OPS)
    x = torch.randn(3000)
    outs = []
    for own in (False, True):
        scheme = THCScheme(THCConfig(subtract_own=own))
        state = scheme.init(ops, info, torch.zeros(1))
        for step in range(3):
            payload, ctx = compress_tensor(scheme, ops, x, state, info)
            if own:
                monkeypatch.setattr(cpu_thc, "_decode_kernel", _no_decode_fallback)
                assert ctx.own is not None and ctx.own.data_ptr() != payload.data_ptr()
            out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
            outs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(outs[:3], outs[3:])) and outs[-1].abs().max() > 0.1


@pytest.mark.parametrize("case", ["bad", "mismatch"])
def test_decode_bad_rank_and_mismatch(case):
    """A rank not finite: NaN everywhere, as the reference; fingerprints that disagree: 0."""
    n, op = 3, "average"
    scheme, info, lay, plan = thc_setup(3000, n=n, op=op)
    kwargs = {"bad_rank": 1} if case == "bad" else {"fingerprints": [1, 2, 3]}
    payload, ranges, diag, hmat = _allreduced(scheme, info, lay, plan, n, op, seed=11, **kwargs)
    count, bad, mismatch, inferred = K._receive_kernel(R, plan, payload)
    ref = K._decode_kernel(R, plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred)
    got = cpu_thc.decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred)
    if case == "bad":
        assert int(bad) == 1 and ref.isnan().all() and got.isnan().all()
    else:
        assert bool(mismatch) and torch.equal(ref, got) and not got.any()


@pytest.mark.parametrize("n,op", [(1, "sum"), (3, "sum"), (3, "average"), (4, None), (7, "average")])
@pytest.mark.parametrize("config", [{}, {"rotation_stages": 3}, {"lane_bits": None, "bits": 6}],
                         ids=["default", "B8", "wide"])
@pytest.mark.parametrize("case", ["ok", "bad", "mismatch"])
def test_receive_and_finish_are_bit_exact(n, op, config, case):
    """Step 6's control words and step 8's ranges and counters: the reference's values, dtypes
    and shapes exactly, for every op, a rank not finite and fingerprints that disagree."""
    scheme, info, lay, plan = thc_setup(2500, n=n, op=op, **config)
    kwargs = {"bad": {"bad_rank": n - 1}, "mismatch": {"fingerprints": list(range(1, n + 1))}}.get(case, {})
    if case == "mismatch" and n == 1:
        kwargs = {}
    payload, ranges, _, _ = _allreduced(scheme, info, lay, plan, n, op, seed=5, **kwargs)
    ref = K._receive_kernel(R, plan, payload)
    got = cpu_thc.receive(plan, payload)
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(a, b), (a, b)
    count, bad, mismatch, inferred = ref
    assert bool(bad) == (case == "bad") and bool(mismatch) == (case == "mismatch" and n > 1)
    small = [torch.tensor(v, dtype=torch.int64) for v in (41, 3, 17, 29)]  # step, realigned, saturated, new
    ref = K._finish_kernel(R, plan, payload, ranges, *small, bad, mismatch, inferred)
    got = cpu_thc.finish(plan, payload, ranges, *small, bad, mismatch, inferred)
    assert len(got) == len(ref) == 5
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(a, b), (a, b)
    # new ranges from the statistics; all kept when a rank was not finite
    assert torch.equal(got[0], ranges) == (case == "bad")


def test_sylvester_table_is_built_once_per_device():
    """THC's Sylvester factor through ops.fuse: the reference's matrix, one tensor per size and
    device (no operations after the first call); the reference when the kernels are off."""
    x = torch.zeros(3)
    a = OPS.fuse(hadamard.sylvester, 32)(x)
    assert torch.equal(a, hadamard.sylvester(R, 32, x)) and a.dtype == torch.float32
    assert OPS.fuse(hadamard.sylvester, 32)(torch.ones(5)) is a
    assert torch.equal(OPS.fuse(hadamard.sylvester, 8)(x), a[:8, :8])


def test_levels_agree_end_to_end():
    """Each side quantises its own rotation: the levels (payload words) differ only where a
    grid position lies within rounding of a level boundary: a tiny fraction."""
    d = 1 << 17
    scheme, info, lay, plan = thc_setup(d, n=8)
    x, residual, diag, hmat, _ = thc_inputs(scheme, info, lay, seed=21)
    finite = torch.tensor(True)
    ref = K._rotate_kernel(R, plan, x, residual, diag, hmat, finite)
    got = cpu_thc.rotate(plan, x, residual, diag, hmat, finite)
    ranges = ref[2] * 0.9  # some saturation too
    rows, cols = noise_bits(lay, 77)
    fp = torch.tensor(1)
    p0 = K._quantize_kernel(R, plan, ref[0], ref[1], ranges, rows, cols, fp, ref[4], ref[3])[0]
    p1 = cpu_thc.quantize(plan, got[0], got[1], ranges, rows, cols, fp, got[4], got[3])[0]
    words = lay.words
    differ = int((p0[:words] != p1[:words]).sum())
    assert differ <= 5e-4 * words, differ
    assert torch.equal(p0[words:], p1[words:]) or int((p0[words:] != p1[words:]).sum()) <= 2


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.get("range") != "current"
                                    and cpu_thc.accepts(thc_setup(3000, **c)[3])])
@pytest.mark.parametrize("n,op,finite", [(4, "average", True), (2, "sum", False), (3, None, None)])
def test_encode_is_the_three_forms(config, n, op, finite):
    """``cpu_thc.encode`` (one C call) gives what ``rotate``, ``noise`` and ``quantize`` give in
    turn, bit for bit: payload (levels, statistics, control words), residual, y, held and the
    saturation count; ``finite`` None (the block ranges alone decide) as True; a rank not
    finite says so in its control word. And ``ops.fuse`` runs it for the whole kernel."""
    scheme, info, lay, plan = thc_setup(3000, n=n, op=op, **config)
    x, residual, diag, hmat, ranges = thc_inputs(scheme, info, lay, seed=5)
    key, fingerprint = torch.tensor(12345, dtype=torch.int64), torch.tensor(3, dtype=torch.int64)
    flag = None if finite is None else torch.tensor(finite)
    y, held, _, stats, ok = cpu_thc.rotate(plan, x, residual, diag, hmat,
                                           torch.tensor(True) if flag is None else flag)
    rows, cols = cpu_thc.noise(plan, key, ranges)
    want = (*cpu_thc.quantize(plan, y, held, ranges, rows, cols, fingerprint, ok, stats),
            y if plan.error_feedback else y[:0], held)  # y only where error feedback keeps it
    got = cpu_thc.encode(plan, x, residual, diag, hmat, ranges, key, fingerprint, flag)
    assert OPS.fuse(K._encode_kernel, plan)(x, residual, diag, hmat, ranges, key, fingerprint, flag)[0].equal(got[0])
    payload, left, y2, held2, saturated = got
    for name, a, b in (("payload", payload, want[0]), ("residual", left, want[1]), ("y", y2, want[3]),
                       ("held", held2, want[4]), ("saturated", saturated, want[2])):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert int(payload[-3]) >> lay.levels.guard == (0 if finite in (True, None) else 1)
    ref = K._encode_kernel(R, plan, x, residual, diag, hmat, ranges, key, fingerprint, flag)
    assert [t.shape for t in ref] == [t.shape for t in got] and [t.dtype for t in ref] == [t.dtype for t in got]
    # against the composition: levels equal but at rounding boundaries of the rotation, the
    # statistics' codes within one step, the control words and the saturation count exactly
    words = lay.words
    assert int((ref[0][:words] != payload[:words]).sum()) <= max(2, words // 500)
    assert torch.equal(ref[0][-K._CONTROL:], payload[-K._CONTROL:])
    assert int(ref[4]) == int(saturated) or abs(int(ref[4]) - int(saturated)) <= 2
    if plan.error_feedback:
        assert torch.allclose(ref[2], y2, rtol=0, atol=1e-5 * float(y2.abs().max()))


@pytest.mark.parametrize("config", [{}, {"flush": None}, {"rotation_stages": 6, "saturation": False}],
                         ids=["default", "noflush", "B64-peak"])
def test_residual_plus_decoded_is_y(config):
    """One rank under Sum, through the three fused forms: the new residual plus the decoded
    value (rotated again) is ``y`` plus what the flush bound held back, within float32
    rounding: quantisation loses nothing that error feedback does not keep."""
    scheme, info, lay, plan = thc_setup(6000, n=1, op="sum", **config)
    x, residual, diag, hmat, _ = thc_inputs(scheme, info, lay, seed=13)
    finite = torch.tensor(True)
    y, held, wanted, stats, finite = cpu_thc.rotate(plan, x, residual, diag, hmat, finite)
    ranges = wanted * 0.8  # some coordinates saturate: the residual keeps their excess
    rows, cols = noise_bits(lay, 31)
    payload, left, saturated = cpu_thc.quantize(plan, y, held, ranges, rows, cols, torch.tensor(0), finite,
                                                stats)
    assert int(saturated) > 0
    count, bad, mismatch, inferred = K._receive_kernel(R, plan, payload)
    out = cpu_thc.decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred)
    again = hadamard.rht(R, out, diag, hadamard.nested_factors(lay.block, hmat))
    kept = y + held if held.numel() else y
    assert ((again + left - kept).abs() <= block_tol(kept, lay.block, 2e-6) + 1e-30).all()
