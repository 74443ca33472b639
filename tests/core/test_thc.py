"""THC (hvd_gradcomp/thc.py): its configuration and spec, the payload layout and wire size,
the rotation diagonal, and the protocol across simulated ranks (tests/core/thc_emulation.py):
Sum and Average with the op known or inferred, tiny tensors, metrics; each output against the
float64 reference. What goes wrong across ranks (non-finite gradients, an overflowing rotation,
fingerprint mismatches, a lagging or joined rank): tests/core/test_thc_faults.py.

The per-step arithmetic (quantiser, error bounds, error feedback, per-block ranges, flush
bound): tests/core/test_thc_kernels.py; the integer lanes: tests/core/test_lanes.py;
everything that needs real ranks: tests/parallel/test_thc.py; the rotation itself
(hvd_gradcomp/hadamard.py): tests/core/test_hadamard.py.

The choice of the default ``rotation_stages`` and its measurements: docs/thc.md, "Choice of
``rotation_stages``".
"""
import dataclasses
import math

import numpy as np
import pytest

from hvd_gradcomp import thc
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec
from hvd_gradcomp.routing import Routing
from hvd_gradcomp.thc import THCConfig, THCScheme, saturation_threshold
from tests.backends import BACKENDS, as_numpy as _np, native_tensor as _tensor, one_rank_ops
from tests.core.thc_emulation import (CODE_MAX, T_1024, Ranks, emulate_allreduce, fails_cleanly_on_rank_1, layout_of,
                                      np_layout, reference_codes, reference_ranges, split_payload, student_t)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- config and constants

@pytest.mark.parametrize("options", [
    {"bits": 0}, {"bits": 17}, {"bits": 2.0}, {"rotation": "half"}, {"rotation_stages": 0},
    {"rotation_stages": 31}, {"saturation_rate": 0.0}, {"saturation_rate": 0.7},
    {"seed": -1}, {"saturation": 1}, {"error_feedback": "yes"},
    {"range": "both"}, {"range": None},
])
def test_config_rejects(options):
    with pytest.raises(ValueError, match="^thc: "):
        THCConfig(**options)


def test_spec_and_registry():
    name, options = parse_spec("thc:bits=2,rotation=full,saturation=false,saturation_rate=0.01,range=current")
    scheme = make_scheme(name, **options)
    assert scheme.config == THCConfig(bits=2, rotation="full", saturation=False, saturation_rate=0.01,
                                      range="current")
    assert scheme.blocking and not THCScheme().blocking and not THCScheme().scalable
    name2, options2 = parse_spec(scheme.spec())
    assert make_scheme(name2, **options2).config == scheme.config
    assert THCScheme().spec() == "thc"
    # The size threshold is the routing's, not an option of the scheme.
    with pytest.raises(ValueError, match=r"^thc: unknown option\(s\) \['min_numel'\]"):
        make_scheme("thc", min_numel=1024)
    with pytest.raises(ValueError, match=r"^thc: unknown option 'min_numel'"):
        parse_spec("thc:min_numel=1024")


def test_saturation_threshold():
    # THC's constant: the two-sided N(0,1) point clipping 1 coordinate in 1024.
    assert abs(saturation_threshold(1 / 1024) - T_1024) < 1e-14
    assert abs(saturation_threshold(0.05) - 1.959963984540054) < 1e-14
    assert abs(math.erfc(saturation_threshold(1e-6) / math.sqrt(2)) - 1e-6) < 1e-15


def _clip_and_round_error(top, t, z, ranks=1):
    """Monte Carlo of what grid_saturation_rate minimises: clip z to [-t, t] (the same for
    every rank), round stochastically on top steps (in expectation delta^2 p (1 - p), its
    variance shrunk by the ranks' mean); the mean squared error."""
    c = np.clip(z, -t, t)
    delta = 2 * t / top
    p = (c + t) / delta % 1.0
    return float(np.mean(delta * delta * p * (1 - p) / ranks + (z - c) ** 2))


def test_grid_saturation_rate():
    """THC's 1/1024 from 15 levels above 0 up; below, a threshold whose error a Monte Carlo of
    N(0, 1) finds within 1% of the best on a grid of thresholds, far below 1/1024's for coarse
    grids at few ranks; more ranks (or finer grids) clip less."""
    assert thc.grid_saturation_rate(15) == thc.grid_saturation_rate(255, 2) == 1 / 1024
    z = np.random.default_rng(3).standard_normal(400_000)
    for top, ranks in ((1, 1), (3, 1), (7, 1), (3, 2), (3, 8), (3, 64)):
        t = saturation_threshold(thc.grid_saturation_rate(top, ranks))
        best = min(_clip_and_round_error(top, s, z, ranks) for s in np.arange(0.3, 3.5, 0.02))
        assert _clip_and_round_error(top, t, z, ranks) <= 1.01 * best
        if ranks <= 2:
            assert _clip_and_round_error(top, t, z, ranks) < 0.5 * _clip_and_round_error(top, T_1024, z, ranks)
    rates = [thc.grid_saturation_rate(top) for top in (1, 2, 3, 7, 14)]
    assert rates == sorted(rates, reverse=True)  # finer grids clip less
    rates = [thc.grid_saturation_rate(3, n) for n in (1, 2, 8, 64)]
    assert rates == sorted(rates, reverse=True)  # so do more ranks


def test_saturation_rate_default_follows_the_levels():
    """saturation_rate=None (default): each layout's T from its levels and ranks (bits=2: 4
    levels; bits=4 at 64 ranks under lane_bits=8: fewer); an explicit rate is kept at every
    layout."""
    def threshold(cfg, n, scheme=None):
        s = scheme or THCScheme(cfg)
        info = TensorInfo("w", (4096,), "float32", n, 0, "sum")
        return s._plan(info, s.layout(info)).threshold
    assert THCConfig().saturation_rate is None
    one = THCScheme()  # one scheme, two layouts: a threshold per level count, not one cached
    assert threshold(None, 2, one) == pytest.approx(T_1024, abs=1e-14)
    top = one.layout(TensorInfo("w", (4096,), "float32", 64, 0, "sum")).levels.top
    assert top < 15 and threshold(None, 64, one) == saturation_threshold(thc.grid_saturation_rate(top, 64))
    assert threshold(None, 2, one) == pytest.approx(T_1024, abs=1e-14)  # still, after the 64-rank layout
    assert threshold(THCConfig(bits=2), 2) == pytest.approx(1.498, abs=1e-3)
    assert threshold(THCConfig(bits=2), 8) == pytest.approx(1.953, abs=1e-3)
    assert threshold(THCConfig(bits=2, saturation_rate=1 / 1024), 2) == pytest.approx(T_1024, abs=1e-14)
    assert threshold(THCConfig(bits=2, saturation=False), 2) == 0.0
    name, options = parse_spec("thc:saturation_rate=0.05")
    assert make_scheme(name, **options).config == THCConfig(saturation_rate=0.05)
    assert THCScheme(THCConfig(bits=2)).spec() == "thc:bits=2"


# ---------------------------------------------------------------- layout and wire size

def test_control_words_fit_at_every_world_size():
    """n ranks' fingerprint s**2 < 2**(2h), shifted above the guard bits, stays below 2**31."""
    scheme = THCScheme()
    for n, op in [(n, op) for n in range(1, thc.MAX_WORLD_SIZE + 1) for op in ("sum", None)]:
        lay = scheme.layout(TensorInfo("w", (4096,), "float32", n, 0, op))
        h, g = lay.fingerprint_bits, lay.levels.guard
        assert h >= 4 and lay.stats.guard == g
        assert (n * ((1 << h) - 1) ** 2) << g < 2 ** 31
        assert (n * CODE_MAX) < 2 ** lay.stats.width


def test_layout_errors_before_any_collective():
    scheme = THCScheme(THCConfig(bits=16, lane_bits=None))
    ops = one_rank_ops("torch")
    import torch
    info = TensorInfo("w", (4096,), "float32", 256, 0)
    with pytest.raises(ValueError, match="thc: bits=16 with 256 ranks"):
        scheme.wire(info)
    with pytest.raises(ValueError, match="thc: bits=16 with 256 ranks"):
        scheme.init(ops, info, torch.zeros(4096))
    lay = np_layout(16, 2, 4096, 1024, lane_bits=None)
    # 4096 words of 16-bit levels, 4 of statistics (8 codes and flags, 2 lanes of 11 bits), 4 control
    assert scheme.wire(TensorInfo("w", (4096,), "float32", 2, 0)).payload == 4 * lay["total"] == 4 * (4096 + 4 + 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rotation,range_", [("partial", "previous"), ("full", "previous"), ("partial", "current")])
def test_wire_matches_payload(backend, rotation, range_):
    """wire() == the int32 payload's bytes (and the side all-reduce's, with range="current")."""
    for d, n, bits, op in [(5000, 2, 4, "sum"), (1024, 4, 2, "sum"), (70000, 16, 8, "sum"), (3000, 3, 4, "sum"),
                           (5000, 64, 4, "average"), (3000, 128, 4, "sum"), (3000, 128, 4, None)]:
        scheme = THCScheme(THCConfig(bits=bits, rotation=rotation, range=range_))
        info = TensorInfo("w", (d,), "float32", n, 1, op)
        side = []
        ops = dataclasses.replace(one_rank_ops(backend), allreduce=lambda v, *a, **k: side.append(_np(v)) or v)
        x = _tensor(backend, np.random.default_rng(d).standard_normal(d).astype(np.float32))
        payload, _ = compress_tensor(scheme, ops, x, scheme.init(ops, info, x), info)
        wire = scheme.wire(info)
        lay = layout_of(scheme, info)
        own = _np(payload)
        assert own.dtype == np.int32 and own.size == lay["total"]
        assert wire.payload == own.nbytes == 4 * lay["total"]
        if range_ == "current":
            assert (wire.side, wire.side_collectives) == (4 * lay["blocks"], 1)
            assert len(side) == 1 and side[0].nbytes == wire.side
        else:
            assert (wire.side, wire.side_collectives) == (0, 0) and not side
        got = scheme.layout(info)
        assert (got.block, got.padded, got.blocks, got.words, got.stats_words) == \
            (lay["block"], lay["padded"], lay["blocks"], lay["words"], lay["stats_words"])


# ---------------------------------------------------------------- rotation

@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_diagonal_is_fixed_per_tensor(backend):
    """Step 1's D: kept in the state, the same on every rank and step; its own per key and seed."""
    ops = one_rank_ops(backend)
    like = _tensor(backend, np.zeros(3000, np.float32))
    scheme = THCScheme()
    infos = [TensorInfo("layer.w", (3000,), "float32", 4, r) for r in range(4)]
    diags = [_np(scheme.init(ops, info, like).diag) for info in infos]
    assert diags[0].shape == (3072,) and np.allclose(np.abs(diags[0]) * 32, 1, atol=1e-7)
    for dg in diags[1:]:
        np.testing.assert_array_equal(dg, diags[0])
    np.testing.assert_array_equal(_np(scheme.rotation_diagonal(ops, infos[2], like)), diags[0])
    other_key = _np(scheme.rotation_diagonal(ops, TensorInfo("layer.b", (3000,), "float32", 4, 0), like))
    other_seed = _np(THCScheme(THCConfig(seed=1)).rotation_diagonal(ops, infos[0], like))
    assert (other_key != diags[0]).mean() > 0.4 and (other_seed != diags[0]).mean() > 0.4
    # ...and it stays in the state across steps.
    sim = Ranks(backend, 2, (3000,))
    for t in range(3):
        log = sim.step([np.random.default_rng([t, r]).standard_normal(3000) for r in range(2)])
        for st in log["after"]:
            np.testing.assert_array_equal(_np(st.diag), diags[0])


# ---------------------------------------------------------------- simulated ranks

SIM_CONFIGS = {
    "default": THCConfig(),
    "simple": THCConfig(rotation="full", saturation=False, range="current", bits=2),
    "full_previous": THCConfig(rotation="full", saturation=False, bits=2),
    "bits8_k6": THCConfig(bits=8, rotation_stages=6),
    "no_ef": THCConfig(error_feedback=False, bits=3),
}


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("config", sorted(SIM_CONFIGS))
@pytest.mark.parametrize("infer", [False, True], ids=["op_known", "op_inferred"])
def test_simulated_sum_and_average(n, config, infer):
    """Decoded == sum (Sum) or mean (Average) of the ranks' own decoded contributions.

    Four steps; each output against the float64 reference from the ranks' own levels,
    identical on every rank; the exact lane sums recovered from Average's truncated words;
    the agreed ranges of the next step against the reference from every rank's statistics;
    the op either given (TensorInfo.op) or inferred from the count word.
    """
    cfg = SIM_CONFIGS[config]
    for op in ("sum", "average"):
        sim = Ranks("torch", n, (70, 50), cfg, op=op, infer=infer)
        gen = np.random.default_rng([n, len(config), infer])
        for t in range(4):
            xs = [gen.standard_normal((70, 50)) * gen.uniform(0.5, 2.0) for _ in range(n)]
            log = sim.step(xs)
            ref = sim.check_reference(log)
            own = list(log["own"].values())
            if cfg.range == "previous" and t == 0:
                assert (ref == 0).all()
            else:
                assert np.abs(ref).max() > 0.1
            # The lanes of the all-reduced payload hold the exact sums of the ranks' levels.
            exact = emulate_allreduce(own, "sum", n)
            got = split_payload(exact, sim.lay, n)[0]
            np.testing.assert_array_equal(got, np.sum([split_payload(p, sim.lay)[0] for p in own], axis=0))
            if op == "sum":
                np.testing.assert_array_equal(log["reduced"], exact)
            for st in log["after"]:
                assert int(st.step) == t + 1 and int(st.realigned) == 0
                if cfg.range == "previous":
                    np.testing.assert_allclose(_np(st.ranges), reference_ranges(own, sim.lay), rtol=5e-6)
                np.testing.assert_array_equal(_np(st.ranges), _np(log["after"][0].ranges))
            if cfg.range == "current":  # the side all-reduce's Max of the ranks' wanted ranges
                wanted = [reference_codes(_np(c.corrected), sim.lay, cfg.saturation, cfg.saturation_rate)[2] for c in log["ctxs"].values()]
                np.testing.assert_allclose(log["side"], np.max(wanted, axis=0), rtol=1e-5)
                np.testing.assert_array_equal(_np(log["ctxs"][0].ranges), log["side"])


def _step_own_and_plain(own, plain, xs, contribute=None):
    """One step of the ``subtract_own`` ranks and of the summing ones on the same gradients:
    the former against the float64 reference, and every rank's output the same bit for bit in
    both (None for a joined rank in both). Returns (own's log, plain's log, the reference)."""
    a, b = own.step(xs, contribute), plain.step(xs, contribute)
    ref = own.check_reference(a)
    for x, y in zip(a["outs"], b["outs"]):
        assert (x is None and y is None) or np.array_equal(x, y)
    return a, b, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("infer", [False, True], ids=["op_known", "op_inferred"])
def test_subtract_own_decodes_as_the_summing_layout(backend, n, infer):
    """``subtract_own``: lanes for the other ranks' sum, whose all-reduced words may wrap; each
    rank's output is the float64 reference's from the ranks' own levels, and bit for bit the
    output of the summing layout at the same levels (same rounding, same grid), in no more
    words (fewer at 2 and 3 ranks); the states and next ranges too. A rank in ``hvd.join()``
    (contributing zeros) and a rank whose gradient is not finite are handled as with the
    summing layout."""
    for op in ("sum", "average"):
        own = Ranks(backend, n, (70, 50), THCConfig(subtract_own=True), op=op, infer=infer)
        plain = Ranks(backend, n, (70, 50), THCConfig(), op=op, infer=infer)
        assert own.lay["L"] == plain.lay["L"] == 15 and own.lay["words"] <= plain.lay["words"]
        if n <= 3:
            assert own.lay["words"] < plain.lay["words"]
        gen = np.random.default_rng([n, infer])
        for t in range(4):
            xs = [gen.standard_normal((70, 50)) * gen.uniform(0.5, 2.0) for _ in range(n)]
            contribute = [r != n - 1 for r in range(n)] if t == 3 and not infer else None  # last: states lag
            a, b, ref = _step_own_and_plain(own, plain, xs, contribute)
            if t:
                assert np.abs(ref).max() > 0.1
            for sa, sb in zip(a["after"], b["after"]):
                for f in sa._fields:
                    np.testing.assert_array_equal(_np(getattr(sa, f)), _np(getattr(sb, f)), err_msg=f)
        if infer:  # (after a join the joined rank lags: realigned, tested apart)
            xs = [gen.standard_normal((70, 50)) for _ in range(n)]
            xs[1][3, 4] = np.nan
            fails_cleanly_on_rank_1(own, xs, gen)


@pytest.mark.parametrize("options", [dict(range="current", saturation=False, rotation="full"), dict(bits=8),
                                     dict(lane_bits=16), dict(rotation_stages=4, flush=None, error_feedback=False)],
                         ids=["current", "bits8", "lanes16", "k4_no_ef"])
def test_subtract_own_with_other_options(options):
    """``subtract_own`` beside THC's other options (the blocking range, fixed 8-bit levels,
    16-bit lanes, small blocks without error feedback): the summing layout's outputs bit for
    bit, at 2 and 3 ranks under both ops, in no more words."""
    for n in (2, 3):
        for op in ("sum", "average"):
            own = Ranks("torch", n, (40, 50), THCConfig(subtract_own=True, **options), op=op)
            plain = Ranks("torch", n, (40, 50), THCConfig(**options), op=op)
            assert own.lay["L"] == plain.lay["L"] and own.lay["words"] <= plain.lay["words"]
            gen = np.random.default_rng([n, len(options)])
            for t in range(3):
                xs = [gen.standard_normal((40, 50)) for _ in range(n)]
                _step_own_and_plain(own, plain, xs)


@pytest.mark.parametrize("scale", [1e-9, 1e8, 1e12, 1e16])
def test_loss_scaled_magnitudes_keep_their_error(scale):
    """Gradients as Horovod sees them under loss scaling (or tiny ones): the same relative
    error as at scale 1, since the 10-bit range codes cover float32's whole range (an 8-bit
    code stopped at 2**23.75: at 1e8 every coordinate saturated, at 1e12 nothing was sent)."""
    def errors(factor):
        sim = Ranks("torch", 3, (4096,), THCConfig(), op="average")
        gen = np.random.default_rng(6)
        out = []
        for _ in range(6):
            xs = [gen.standard_normal(4096) * factor for _ in range(3)]
            log = sim.step(xs)
            sim.check_reference(log)
            true = np.mean(xs, 0)
            out.append(np.linalg.norm(log["outs"][0] - true) / np.linalg.norm(true))
        return np.array(out[2:]), int(log["after"][0].saturated)
    base, _ = errors(1.0)
    got, saturated = errors(scale)
    assert (got < 1.5 * base.max()).all() and saturated < 0.03 * 4096, (scale, got, base, saturated)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_tensors_go_fp16(backend):
    """The size threshold is the routing's: a plain thc compressor sends tensors below
    min_numel (default 1024) as pre-scaled fp16 (no state); the scheme itself compresses
    whatever it is given, down to one coordinate (int32 words, its state)."""
    routing = Routing.from_spec("thc")
    small, big = routing.decide(None, 1023), routing.decide(None, 1024)
    assert (small.text, small.why, big.text) == ("fp16", "numel < min_numel=1024", "thc")
    assert Routing.from_spec("thc:min_numel=1").decide(None, 1).text == "thc"
    ops = one_rank_ops(backend)
    x = _tensor(backend, np.linspace(-1, 1, 1023).astype(np.float32))
    info = TensorInfo("b", (1023,), "float32", 4, 0, "sum")
    state = small.scheme.init(ops, info, x)
    payload, ctx = compress_tensor(small.scheme, ops, x, state, info)
    assert ops.dtype(payload) == "float16" and len(state) == 0
    np.testing.assert_array_equal(_np(payload), (np.linspace(-1, 1, 1023).astype(np.float32) * 0.25).astype(np.float16))
    wire = small.scheme.wire(info)
    assert wire.payload == 2 * 1023 == _np(payload).nbytes and wire.side_collectives == 0
    out, after = finish_tensor(small.scheme, ops, payload, ctx, state, info)
    np.testing.assert_allclose(_np(out), np.linspace(-1, 1, 1023), atol=1e-3)
    assert len(after) == 0
    scheme = big.scheme
    for d in (1023, 1):
        info = TensorInfo("w", (d,), "float32", 4, 0, "sum")
        x = _tensor(backend, np.linspace(-1, 1, d).astype(np.float32))
        state = scheme.init(ops, info, x)
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        lay = layout_of(scheme, info)  # from the docstring's formulas
        assert lay["block"] == (1024 if d == 1023 else 1)
        assert ops.dtype(payload) == "int32" and _np(payload).size == lay["total"], d
        assert scheme.wire(info).payload == 4 * lay["total"]
        _, after = finish_tensor(scheme, ops, payload, ctx, state, info)
        assert int(after.step) == 1 and set(scheme.metrics(after)) == {"saturated", "realigned"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_and_realigned_metrics(backend):
    """metrics(): "saturated" = this rank's rotated coordinates with |y| > R > 0 at the last
    step (a block without a range yet, R = 0, waits in error feedback by design and is not
    counted: at the first step, nothing); "realigned" = mismatched steps."""
    sim = Ranks(backend, 2, (6000,), THCConfig(), op="sum")
    gen = np.random.default_rng(9)
    for t in range(4):
        xs = [student_t(gen, 6000) for _ in range(2)]
        log = sim.step(xs)
        for r in range(2):
            y = _np(log["ctxs"][r].corrected)
            top = np.repeat(_np(log["ctxs"][r].ranges), sim.lay["block"])
            m = sim.scheme.metrics(log["after"][r])
            assert set(m) == {"saturated", "realigned"} and int(m["realigned"]) == 0
            assert int(m["saturated"]) == int(((np.abs(y) > top) & (top > 0)).sum())
            if t == 0:
                assert int(m["saturated"]) == 0 and (y != 0).sum() > 0
            elif t == 3:  # steady state: about 1/1024 of 6144 (stale ranges, heavy tails: more)
                assert int(m["saturated"]) < 0.03 * y.size


# ---------------------------------------------------------------- frameworks
# (THC's payload bit for bit in PyTorch and TensorFlow: tests/parity/test_parity.py)

@pytest.mark.parametrize("backend", BACKENDS)
def test_compression_namespace(backend):
    if backend == "torch":
        from torch_backend import Compression
    else:
        from tf_backend import Compression
    assert "thc" in Compression.names()
    compressor = Compression.from_spec("thc:bits=2,rotation_stages=8,range=current")
    assert compressor.scheme.config == THCConfig(bits=2, rotation_stages=8, range="current")


@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("n", [2, 3])
def test_explicit_bits_are_honoured(n, op):
    """``thc:bits=8`` keeps 255 levels at every world size: the default lane_bits=8 (whose
    lanes hold 63 at 2 ranks) widens, so the run is the one of ``lane_bits=None``, bit for bit,
    and its error after 4 steps is ``lane_bits=None``'s, well below the shrunk levels' (the
    default, bits unset, keeps its trade). Emulated ranks, the same gradients for each."""
    from torch_backend import Compression
    shape, gen = (4096,), np.random.default_rng(3)
    grads = [[gen.standard_normal(shape) for _ in range(n)] for _ in range(4)]
    sims = {label: Ranks("torch", n, shape, Compression.from_spec(spec).scheme.config, op=op)
            for label, spec in (("bits", "thc:bits=8"), ("wide", "thc:bits=8,lane_bits=none"),
                                ("shrunk", "thc:bits=6"))}
    assert sims["bits"].scheme.layout(sims["bits"].infos[0]).levels.top == 255
    assert sims["bits"].lay == sims["wide"].lay
    errors = {}
    for label, sim in sims.items():
        for step in grads:
            log = sim.step(step)
            sim.check_reference(log)
        target = np.mean(grads[-1], axis=0) * (n if op == "sum" else 1)
        errors[label] = np.linalg.norm(log["outs"][0].reshape(-1) - target.reshape(-1)) / np.linalg.norm(target)
        if label != "shrunk":
            sims[label].last = log["outs"][0]
    np.testing.assert_array_equal(sims["bits"].last, sims["wide"].last)
    assert errors["bits"] == errors["wide"] < errors["shrunk"], errors


@pytest.mark.parametrize("spec,n,op,levels", [("thc:bits=8,lane_bits=16", 128, "average", 31),
                                              ("thc:bits=8,lane_bits=4", 2, "sum", 7)])
def test_explicit_bits_and_lane_bits_that_do_not_fit_are_refused(spec, n, op, levels):
    from hvd_gradcomp.registry import make_scheme as make
    name, options = parse_spec(spec)
    scheme = make(name, **options)
    bits, lane_bits = options["bits"], options["lane_bits"]
    with pytest.raises(ValueError) as err:
        scheme.layout(TensorInfo("w", (4096,), "float32", n, 0, op))
    assert str(err.value).startswith(
        f"thc: bits={bits} ({2 ** bits - 1} levels a rank) and lane_bits={lane_bits} ({32 // lane_bits} lanes a "
        f"word) do not fit together at {n} ranks under {op}: those lanes hold at most {levels} levels here; set "
        f"lane_bits=none or leave it unset (lanes widen for bits: "), str(err.value)
    if lane_bits == 16:  # where they fit, both are kept: 16-bit lanes hold 255 levels at 2 ranks
        assert scheme.layout(TensorInfo("w", (4096,), "float32", 2, 0, op)).levels.top == 255


def test_one_level_a_rank_with_error_feedback_warns_once(caplog):
    # default lanes at 32 ranks hold 1 level a rank: error feedback there ran away (docs/scale.md)
    def layout(spec, n):
        thc._WARNED.clear() if spec == "first" else None
        name, options = parse_spec("thc" if spec == "first" else spec)
        scheme = make_scheme(name, **options)
        return scheme.layout(TensorInfo("embed.weight", (4096,), "float32", n, 0, "average"))

    with caplog.at_level("WARNING", logger="hvd_gradcomp.thc"):
        assert layout("first", 32).levels.top == 1
        layout("thc", 32)  # the same layout again: no second warning
        assert layout("thc:error_feedback=false", 32).levels.top == 1  # nothing to run away
        assert layout("thc", 8).levels.top > 1 and layout("thc:bits=2", 32).levels.top > 1
    warned = [r.getMessage() for r in caplog.records if r.name == "hvd_gradcomp.thc"]
    assert len(warned) == 1 and "at 32 ranks" in warned[0] and "embed.weight" in warned[0]
    assert "error_feedback=false" in warned[0]
