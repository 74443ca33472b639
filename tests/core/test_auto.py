"""``auto`` without Horovod: options, the decision function, the schedule, and two ranks
simulated in one process (each rank its own scheme object; payloads summed by hand, as Sum
would) in both backends. Real multi-rank runs: tests/parallel/test_auto.py."""
import math
from unittest import mock

import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.auto import UNUSABLE, AutoConfig, AutoScheme, Link, decide, start_choice
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from tests.backends import BACKENDS, backend_tensor, one_rank_ops, scheme_of

SHAPE = (64, 48)
# THC sums exactly (integers), so a flush leaves no error at all; TopKC's float16 sum rounds.
SLOW = dict(candidates="fp16|thc:4|thc:8", bandwidth_gbit=0.0001, latency_ms=0.1, warmup=3, every=4)


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("options, message", [
    (dict(warmup=1), "auto: warmup must be an integer >= 2, got 1"),
    (dict(every=3, warmup=4), "auto: every must be an integer >= warmup (4), got 3"),
    (dict(hysteresis=1.0), "auto: hysteresis must be a number in [0, 1), got 1.0"),
    (dict(error_budget=0), "auto: error_budget must be a number > 0, got 0"),
    (dict(bandwidth_gbit=-1.0), "auto: bandwidth_gbit must be a number >= 0, got -1.0"),
    (dict(candidates="fp16,topkc:0.1"), "auto: candidates must be a non-empty string without commas"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        make_scheme("auto", **options)


@pytest.mark.parametrize("candidates, message", [
    ("topkc:0.1|thc:4", "must include fp16"),
    ("fp16|auto", "must not include auto"),
    ("fp16|topkc:selection=current", "blocking variant"),
    ("fp16|thc:4|thc:bits=4", "must differ"),
    ("fp16|nope", "unknown compressor 'nope'"),
])
def test_bad_candidates_are_refused(candidates, message):
    with pytest.raises(ValueError, match=message):
        make_scheme("auto", candidates=candidates)


def test_spec_round_trip_and_tuple_candidates():
    scheme = make_scheme("auto", candidates=("fp16", "topkc:0.1", "thc:4"), every=100)
    spec = to_spec(scheme)
    assert spec == "auto:candidates=fp16|topkc:0.1|thc:4,every=100"
    name, options = parse_spec(spec)
    assert make_scheme(name, **options).config == scheme.config
    assert scheme.specs == ("fp16", "topkc:ratio=0.1", "thc")
    assert scheme.fallback == 0
    assert not scheme.scalable  # THC's integer payload is among the candidates
    # fp16's agreed scale (a_fp16_scale) is reset with them on a load at another world size
    assert set(scheme.rank_local_fields) == {"a_residual", "a_fp16_scale", "carry"}


def test_equal_candidate_lists_are_one_configuration():
    """Case, blanks, ``ratio=0.1`` against ``0.1`` and a default main option written or not:
    one canonical list, so equal specs and checkpoints that load into each other."""
    written = ["fp16|topkc:0.1|thc", "fp16|topkc:ratio=0.1|thc:4", "FP16|TopKC:0.1|THC:bits=4",
               "fp16 | topkc:0.1 | thc"]
    schemes = [make_scheme("auto", candidates=c) for c in written]
    assert {s.config.candidates for s in schemes} == {"fp16|topkc:0.1|thc:4"}
    assert {s.spec() for s in schemes} == {"auto:candidates=fp16|topkc:0.1|thc:4"}
    assert make_scheme("auto", candidates="fp16|topkc:chunk=64").config.candidates == "fp16|topkc:chunk=64"


# ---------------------------------------------------------------- decide()
LINK = Link(125e6, 1e-4)  # 1 Gbit/s


def test_decide_takes_least_predicted_time_within_budget():
    # fp16: 1 ms codec, 2 MB; A: 3 ms, 0.2 MB, error 0.5; B: 0.5 ms, 0.1 MB, error 0.95.
    choice, predicted, reason = decide([1.0, 3.0, 0.5], [0.0, 0.5, 0.95], [2e6, 2e5, 1e5], 2, LINK,
                                       current=0, fallback=0, budget=0.9, hysteresis=0.1)
    assert predicted == pytest.approx([1.0 + 16.0 + 0.1, 3.0 + 1.6 + 0.1, 0.5 + 0.8 + 0.1])
    assert (choice, reason) == (1, "least predicted time")  # B is faster but over the budget


def test_decide_hysteresis_keeps_current_choice():
    # A saves 5 % against fp16: below a 10 % hysteresis.
    args = ([1.0, 0.95], [0.0, 0.1], [0, 0], 2, LINK)
    assert decide(*args, current=0, fallback=0, budget=0.9, hysteresis=0.1)[0] == 0
    assert decide(*args, current=0, fallback=0, budget=0.9, hysteresis=0.01)[0] == 1
    # Leaving a choice that went over the budget needs no hysteresis.
    choice, _, reason = decide([1.0, 0.95], [0.0, 2.0], [0, 0], 2, LINK, current=1, fallback=0,
                               budget=0.9, hysteresis=0.5)
    assert (choice, reason) == (0, "current choice over the error budget")


def test_decide_breaks_near_ties_by_error():
    # digits' fc2 (measured): fp16 106.3 ms; TopKC 51.4 ms, error 0.87; PowerSGD 50.8 ms, 0.79.
    codec, errors, wire = [106.3, 51.4, 50.8], [0.0, 0.87, 0.79], [0, 0, 0]
    assert decide(codec, errors, wire, 2, LINK, 0, 0, 0.95, 0.1)[0] == 2
    # The more accurate one wins within the band even when it is the slower of the two ...
    assert decide([106.3, 50.8, 51.4], [0.0, 0.87, 0.79], wire, 2, LINK, 0, 0, 0.95, 0.1)[0] == 2
    # ... and not beyond it (TopKC 20 % faster), nor with no band at all.
    assert decide([106.3, 42.0, 51.4], [0.0, 0.87, 0.79], wire, 2, LINK, 0, 0, 0.95, 0.1)[0] == 1
    assert decide([106.3, 50.8, 51.4], [0.0, 0.87, 0.79], wire, 2, LINK, 0, 0, 0.95, 0.0)[0] == 1


def test_float16_payloads_are_priced_at_their_own_rate():
    link = Link(100e6, 1e-3, 40e6)  # float16 sums 2.5x slower per byte (Gloo on a CPU)
    assert link.seconds(1e6, 2) == pytest.approx(1e-3 + 1e6 / 100e6)
    assert link.seconds(1e6, 2, "float16") == pytest.approx(1e-3 + 1e6 / 40e6)
    assert Link(100e6, 1e-3).seconds(1e6, 2, "float16") == link.seconds(1e6, 2)  # rate unknown
    # fp16's 2 MB against A's float32 1.8 MB: A wins at the float16 rate, not without it.
    args = ([0.1, 0.5], [0.0, 0.5], [2e6, 1.8e6], 2)
    assert decide(*args, link, 0, 0, 0.9, 0.1, ["float16", "float32"])[0] == 1
    assert decide(*args, link, 0, 0, 0.9, 0.1)[0] == 0


def test_decide_falls_back_to_fp16_on_fast_links_and_unknown_errors():
    fast = Link(math.inf, 0.0)
    assert decide([0.1, 2.0], [0.0, 0.1], [2e6, 1e5], 2, fast, 0, 0, 0.9, 0.1)[0] == 0
    assert decide([0.1, 0.0], [0.0, math.nan], [2e6, 0], 2, LINK, 0, 0, 0.9, 0.0)[0] == 0
    # One rank: nothing crosses a link, so only codec time counts.
    assert decide([0.1, 0.05], [0.0, 0.1], [2e6, 1e5], 1, LINK, 0, 0, 0.9, 0.0)[0] == 1


def test_schedule_windows_and_probes():
    scheme = make_scheme("auto", warmup=3, every=5)
    phases = [scheme._phase(t) for t in range(14)]
    assert [t for t, (_, probe) in enumerate(phases) if probe] == [2, 7, 12]
    assert [t for t, (window, _) in enumerate(phases) if window] == [0, 1, 2, 5, 6, 7, 10, 11, 12]


def test_start_is_one_candidate_for_every_tensor_it_pays_on():
    # Reference bytes: fp16 2 MB, A 0.2 MB, B 0.03 MB: B, the hardest compressor on a large
    # matrix, is the start of every tensor where it saves bytes, even if A saves more there.
    ref = [2e6, 2e5, 3e4]
    assert start_choice([8e6, 8e5, 4e4], ref, 2, LINK, 0, 0.1) == 2
    assert start_choice([4e4, 4e3, 3.3e4], ref, 2, LINK, 0, 0.1) == 2  # the 2048 x 10 layer
    # A vector that B sends as it is: fp16.
    assert start_choice([4096, 600, 4096], ref, 2, LINK, 0, 0.1) == 0
    # A fast link: saving far below a millisecond on the reference pays for no codec.
    assert start_choice([8e6, 8e5, 4e4], ref, 2, Link(125e9, 0.0), 0, 0.1) == 0
    # Measured codec ms on the reference (calibrate()): the least predicted time starts, if
    # it passes the step gate's test. 1 Gbit/s: B (30 ms of codec) loses to A (3 ms).
    assert start_choice([8e6, 8e5, 4e4], ref, 2, LINK, 0, 0.1, [0.5, 3.0, 30.0], 0.5) == 1
    # A loopback-like link (1 GB/s): fp16 2.5 ms; A 1.6 ms is faster, but not START_FACTOR
    # (3x) faster; at 0.7 ms it is.
    fast = Link(1e9, 1e-4)
    assert start_choice([8e6, 8e5, 4e4], ref, 2, fast, 0, 0.1, [0.5, 1.4, 30.0], 0.0) == 0
    assert start_choice([8e6, 8e5, 4e4], ref, 2, fast, 0, 0.1, [0.5, 0.5, 30.0], 0.0) == 1
    # fp16 anywhere in the list; no lossy candidate at all.
    assert start_choice([4e4, 8e6], [3e4, 2e6], 2, LINK, 1, 0.1) == 0
    assert start_choice([8e6], [2e6], 2, LINK, 0, 0.1) == 0


# ---------------------------------------------------------------- two simulated ranks
def _grad(rank, step):
    common = np.random.default_rng([3, step]).standard_normal(SHAPE)
    return common + 0.3 * np.random.default_rng([rank, step]).standard_normal(SHAPE)


def _simulate(backend, steps, poison_step=None, **options):
    """Two ranks' auto schemes driven step by step, payloads summed (op Sum). Returns the
    schemes, states, the summed output of every step, the choice after every step, the
    state's fields after every step, and the ranks' pending error feedback summed (float64,
    gradient coordinates) after every step."""
    with mock.patch("time.perf_counter", _TickClock()):
        return _simulate_steps(backend, steps, poison_step, options)


class _TickClock:
    """A host clock that advances 0.1 ms a reading: auto's codec and step timings become
    the same on every run, whatever the machine's load, so the simulated decisions depend on
    bytes and the link only."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1e-4
        return self.now


def _simulate_steps(backend, steps, poison_step, options):
    ops = one_rank_ops(backend)
    schemes = [make_scheme("auto", **{**SLOW, **options}).bind(ops) for _ in range(2)]
    infos = [TensorInfo("w", SHAPE, "float32", 2, r, "sum") for r in range(2)]
    states = [s.init(ops, i, backend_tensor(backend, [0.0])) for s, i in zip(schemes, infos)]
    outs, choices, fields, pending = [], [], [], []
    for t in range(steps):
        pcs = []
        for r in range(2):
            g = _grad(r, t)
            if t == poison_step and r == 1:
                g = g.copy()
                g[0, 0] = np.nan
            pcs.append(compress_tensor(schemes[r], ops, backend_tensor(backend, g), states[r], infos[r]))
        summed = pcs[0][0] + pcs[1][0]
        step_outs = []
        for r in range(2):
            out, states[r] = finish_tensor(schemes[r], ops, summed, pcs[r][1], states[r], infos[r])
            step_outs.append(np.asarray(ops.to_host(out), dtype=np.float64))
        np.testing.assert_array_equal(step_outs[0], step_outs[1])
        assert schemes[0]._counters == schemes[1]._counters
        outs.append(step_outs[0])
        choices.append(schemes[0].specs[schemes[0]._counters["w"][1]])
        fields.append(states[0]._fields)
        owed = np.zeros(SHAPE)
        for r in range(2):
            res = composite.residual_of(schemes[r], ops, states[r], infos[r])
            if res is not None:
                owed += np.asarray(ops.to_host(res), dtype=np.float64).reshape(SHAPE)
        pending.append(owed)
    return schemes, states, outs, choices, fields, pending


def _owed_error(outs, pending, t):
    """|| sum of outputs + pending error feedback - sum of gradients || / || sum of
    gradients || after step ``t``: 0 when nothing of the gradient is lost or sent twice."""
    total_in = sum(_grad(0, s) + _grad(1, s) for s in range(t + 1))
    total_out = sum(outs[:t + 1])
    return np.linalg.norm(total_out + pending[t] - total_in) / np.linalg.norm(total_in)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_prunes_a_hopeless_candidate_the_same_way_on_every_rank(backend, monkeypatch):
    """On a fast link fp16's predicted step is a fraction of a millisecond; a candidate whose
    first window step takes more than PRUNE_FACTOR times that is not run again in the window,
    and its lanes make it unusable for every rank's decision."""
    import hvd_gradcomp.auto as auto
    calls = {"thc": 0}

    def slow_thc(real):
        def run(*args, **kwargs):
            calls["thc"] += 1
            if calls["thc"] <= 2:  # the two ranks' first window step: far slower than fp16
                import time
                time.sleep(0.2)
            return real(*args, **kwargs)
        return run

    fast = dict(candidates="fp16|thc:4", bandwidth_gbit=1000.0, latency_ms=0.0, warmup=3, every=4)
    ops = one_rank_ops(backend)
    schemes = [make_scheme("auto", **fast).bind(ops) for _ in range(2)]
    for s in schemes:
        monkeypatch.setattr(s.candidates[1], "compress", slow_thc(s.candidates[1].compress))
    infos = [TensorInfo("w", SHAPE, "float32", 2, r, "sum") for r in range(2)]
    states = [s.init(ops, i, backend_tensor(backend, [0.0])) for s, i in zip(schemes, infos)]
    for t in range(3):  # one window: steps 0-2, the probe at 2
        pcs = [compress_tensor(schemes[r], ops, backend_tensor(backend, _grad(r, t)), states[r], infos[r])
               for r in range(2)]
        for r in range(2):
            _, states[r] = finish_tensor(schemes[r], ops, pcs[0][0] + pcs[1][0], pcs[r][1], states[r], infos[r])
    assert calls["thc"] == 2  # run once per rank, in the window's first step only
    d0, d1 = (s.history_records()[-1] for s in schemes)
    assert d0 == d1 and d0["scheme"] == "fp16"
    assert d0["errors"]["thc"] == auto.UNUSABLE and d0["predicted_ms"]["thc"] >= auto.UNUSABLE
    assert d0["predicted_ms"]["fp16"] < 20.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_costs_keep_a_hopeless_candidate_out_of_the_window(backend, monkeypatch):
    """With calibrate()'s start costs, a candidate whose reference codec ms, scaled to the
    tensor, is far above the current choice's figure is never run in the window."""
    calls = {"thc": 0}
    link = dict(candidates="fp16|powersgd:4|thc:4", bandwidth_gbit=100.0, latency_ms=0.0, warmup=3, every=4)
    ops = one_rank_ops(backend)
    schemes = [make_scheme("auto", **link).bind(ops) for _ in range(2)]
    for s in schemes:
        s.start_costs = (0.5, 1.0, 1e4)  # ms on the 1024 x 1024 reference: THC hopeless
        real = s.candidates[2].compress

        def counted(*args, real=real, **kwargs):
            calls["thc"] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(s.candidates[2], "compress", counted)
    infos = [TensorInfo("w", SHAPE, "float32", 2, r, "sum") for r in range(2)]
    states = [s.init(ops, i, backend_tensor(backend, [0.0])) for s, i in zip(schemes, infos)]
    for t in range(3):
        pcs = [compress_tensor(schemes[r], ops, backend_tensor(backend, _grad(r, t)), states[r], infos[r])
               for r in range(2)]
        for r in range(2):
            _, states[r] = finish_tensor(schemes[r], ops, pcs[0][0] + pcs[1][0], pcs[r][1], states[r], infos[r])
    assert calls["thc"] == 0
    d0, d1 = (s.history_records()[-1] for s in schemes)
    assert d0 == d1 and d0["errors"]["thc"] == UNUSABLE and d0["scheme"] == "fp16"


@pytest.mark.parametrize("backend", BACKENDS)
def test_simulated_thc_probes_flush_error_feedback_exactly(backend):
    """THC (integer payload) starts on the slow link (after the sync step 0, a float32 flush
    too), and its probes send the float32 flush: right after each one nothing is owed; in between, outputs plus the owed error feedback
    are the summed gradients."""
    schemes, states, outs, choices, fields, pending = _simulate(backend, 11)
    assert choices[0] == "thc"  # the start: the fewest bytes
    for t in range(11):
        assert _owed_error(outs, pending, t) < 1e-5, t
        owed = np.linalg.norm(pending[t])
        assert (owed == 0) if t in (0, 2, 6, 10) else (owed > 1e-2), (t, owed)  # 0: the sync step
    d = schemes[0].decisions["w"]
    assert d.spec == choices[-1] and d.step == 10 and len(d.predicted_ms) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_simulated_switch_carries_error_feedback(backend):
    """PowerSGD starts (fewest bytes); its probe's lanes ride on its own float32 payload.
    The step gate (a huge step_penalty) sends the tensor to fp16 at the probe: PowerSGD's
    residual becomes the carry, added to the next fp16 step and then dropped. Nothing is
    lost at any step (fp16's own rounding aside)."""
    schemes, states, outs, choices, fields, pending = _simulate(
        backend, 8, candidates="fp16|powersgd:4", step_penalty=1e6, error_budget=2.0)
    assert choices[:2] == ["powersgd:rank=4"] * 2 and choices[2:] == ["fp16"] * 6
    d = schemes[0].history[0]
    assert d.step == 2 and d.reason.startswith("step gate") and d.speedup > 1.0
    assert "carry" in fields[2] and "carry" not in fields[3]
    assert np.linalg.norm(pending[1]) > 1.0 and np.linalg.norm(pending[2]) > 1.0
    for t in range(8):
        assert _owed_error(outs, pending, t) < 2e-3, t  # fp16 payloads round
    assert np.linalg.norm(pending[3]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_simulated_riding_probe_keeps_a_paying_choice(backend):
    """Without the gate, PowerSGD stays: the lanes decoded from its payload predict it far
    below fp16 on the slow link, with its measured error; no flush (the residual stays)."""
    schemes, states, outs, choices, fields, pending = _simulate(
        backend, 7, candidates="fp16|powersgd:4", step_penalty=0.0, error_budget=2.0)
    assert choices == ["powersgd:rank=4"] * 7
    d = schemes[0].decisions["w"]
    assert d.predicted_ms[1] < 0.2 * d.predicted_ms[0] and 0.1 < d.errors[1] < 1.0
    assert np.linalg.norm(pending[2]) > 1.0  # not flushed
    for t in range(7):
        assert _owed_error(outs, pending, t) < 1e-5, t


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_probe_decides_nothing_and_keeps_the_residual(backend):
    # A NaN on rank 1 at the first probe: no decision, state kept, the schedule goes on.
    schemes, states, outs, choices, fields, pending = _simulate(backend, 7, poison_step=2,
                                                                candidates="fp16|powersgd:4",
                                                                step_penalty=1e6, error_budget=2.0)
    assert np.isnan(outs[2]).all()
    assert choices[:6] == ["powersgd:rank=4"] * 6 and not [d for d in schemes[0].history if d.step == 2]
    np.testing.assert_array_equal(pending[2], pending[1])  # the failed step changed nothing
    assert choices[6] == "fp16"  # the next window decides


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_window_step_gives_no_figures_and_no_wrong_decision(backend):
    """A NaN on rank 1 at step 1 (a window step, not the probe): that step fails as usual,
    its shadows give rank 1 no figures, and the probe still decides on the finite ones."""
    options = dict(candidates="fp16|powersgd:4", step_penalty=0.0, error_budget=2.0)
    schemes, states, outs, choices, fields, pending = _simulate(backend, 4, poison_step=1, **options)
    assert np.isnan(outs[1]).all() and np.isfinite(outs[2]).all()
    d = schemes[0].history[0]
    assert d.step == 2 and d.spec == "powersgd:rank=4"
    assert choices == ["powersgd:rank=4"] * 4
    # The error lane is the finite figures' mean: close to a clean run's, not pulled down by
    # a 0 (or up to "unusable") for the NaN step.
    clean = _simulate(backend, 3, **options)[0][0].history[0]
    assert d.errors[1] == pytest.approx(clean.errors[1], rel=0.1) and 0.5 < d.errors[1] < 1.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_wire_follows_the_choice(backend):
    schemes, states, _, choices, _, _ = _simulate(backend, 3, candidates="fp16|powersgd:4", step_penalty=1e6)
    info = TensorInfo("w", SHAPE, "float32", 2, 0, "sum")
    assert choices == ["powersgd:rank=4", "powersgd:rank=4", "fp16"]
    fp16, psgd = (c.wire(info) for c in schemes[0].candidates)
    assert fp16 != psgd
    assert schemes[0].wire(info) == fp16._replace(payload=fp16.payload + 2)  # and the count lane


@pytest.mark.parametrize("spec", ["topkc:0.1", "powersgd:4", "thc:4"])
def test_add_residual_adds_in_gradient_coordinates(spec):
    """What auto carries over a switch: add_residual(r) then residual_of gives the old
    residual plus r, in the gradient's coordinates (THC rotates it into its basis)."""
    backend = BACKENDS[0]
    ops = one_rank_ops(backend)
    scheme = scheme_of(spec).bind(ops)
    info = TensorInfo("t", SHAPE, "float32", 1, 0, "sum")
    state = scheme.init(ops, info, backend_tensor(backend, [0.0]))
    x = np.random.default_rng(1).standard_normal(SHAPE)
    payload, ctx = compress_tensor(scheme, ops, backend_tensor(backend, x), state, info)
    _, state = finish_tensor(scheme, ops, payload, ctx, state, info)
    before = np.asarray(ops.to_host(composite.residual_of(scheme, ops, state, info)), dtype=np.float64)
    extra = np.random.default_rng(2).standard_normal(SHAPE[0] * SHAPE[1])
    state = composite.add_residual(scheme, ops, state, info, backend_tensor(backend, extra))
    after = np.asarray(ops.to_host(composite.residual_of(scheme, ops, state, info)), dtype=np.float64)
    assert np.abs(before).max() > 1e-2
    np.testing.assert_allclose(after, before + extra, atol=1e-5)
    assert composite.add_residual(make_scheme("fp16"), ops, None, info, extra) is None


def test_thc_residual_in_gradient_coordinates():
    """THC keeps its residual rotated and padded; residual_of rotates it back: the step's
    output plus the residual is the corrected gradient."""
    backend = BACKENDS[0]
    ops = one_rank_ops(backend)
    thc = make_scheme("thc", bits=2).bind(ops)
    info = TensorInfo("t", (1000,), "float32", 1, 0, "sum")
    state = thc.init(ops, info, backend_tensor(backend, [0.0]))
    x = np.random.default_rng(0).standard_normal(1000)
    for _ in range(3):  # ranges agreed after the first step
        before = composite.residual_of(thc, ops, state, info)
        payload, ctx = compress_tensor(thc, ops, backend_tensor(backend, x), state, info)
        out, state = finish_tensor(thc, ops, payload, ctx, state, info)
    after = np.asarray(ops.to_host(composite.residual_of(thc, ops, state, info)))
    corrected = x + np.asarray(ops.to_host(before))
    np.testing.assert_allclose(np.asarray(ops.to_host(out)) + after, corrected, atol=1e-4)
    assert np.abs(after).max() > 1e-2  # 2 bits leave a real residual


def test_decision_module_imports_no_framework():
    """hvd_gradcomp.auto.decisions (start, decide, the link model) is pure: importing it loads
    neither PyTorch nor TensorFlow nor NumPy."""
    import subprocess
    import sys
    code = ("import sys, hvd_gradcomp.auto.decisions as d; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'numpy') if m in sys.modules)); "
            "print(d.decide.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "hvd_gradcomp.auto.decisions", out


# ---------------------------------------------------------------- issue 34's codecs as candidates
NEW_ROWS = "fp16|topkc:ratio=0.1&max_age=20|topkc:ratio=0.1&residual_decay=0.95|powersgd:8|powersgd:16"


def test_new_rows_codecs_are_candidates_where_listed():
    """TopKC with max_age or residual_decay and PowerSGD at rank 8-16 (issue 34's rows) are
    candidates where the list names them: one candidate's options joined by '&' (the comma
    separates auto's own options), built as written, listed canonically (the options in
    declaration order), in a spec that round-trips; a tuple may use commas; bad options are
    refused with the candidate scheme's own message; the default list does not change."""
    from hvd_gradcomp.auto import DEFAULT_CANDIDATES
    from hvd_gradcomp.routing import Routing
    scheme = make_scheme("auto", candidates="FP16 | topkc:max_age=20&ratio=0.1|TopKC:0.1&residual_decay=0.95|"
                                            "powersgd:rank=8|powersgd:16", every=100)
    assert scheme.config.candidates == NEW_ROWS
    assert scheme.specs == ("fp16", "topkc:ratio=0.1,max_age=20", "topkc:ratio=0.1,residual_decay=0.95",
                            "powersgd:rank=8", "powersgd:rank=16")
    topkc_age, topkc_decay, rank8, rank16 = scheme.candidates[1:]
    assert (topkc_age.config.max_age, topkc_age.config.residual_decay) == (20, 1.0)
    assert (topkc_decay.config.max_age, topkc_decay.config.residual_decay) == (0, 0.95)
    assert (rank8.config.rank, rank16.config.rank) == (8, 16)
    spec = to_spec(scheme)
    assert spec == f"auto:candidates={NEW_ROWS},every=100"
    name, options = parse_spec(spec)
    assert make_scheme(name, **options).config == scheme.config
    assert Routing.from_spec(spec).default.config == scheme.config
    listed = make_scheme("auto", candidates=("fp16", "topkc:ratio=0.1,max_age=20", "topkc:0.1,residual_decay=0.95",
                                             "powersgd:8", "powersgd:rank=16"), every=100)
    assert listed.config == scheme.config and listed.spec() == spec
    with pytest.raises(ValueError, match=r"^topkc: max_age must be an integer >= 0, got -1$"):
        make_scheme("auto", candidates="fp16|topkc:0.1&max_age=-1")
    with pytest.raises(ValueError, match="blocking variant"):
        make_scheme("auto", candidates="fp16|topkc:0.1&selection=current")
    assert make_scheme("auto").config.candidates == DEFAULT_CANDIDATES


@pytest.mark.parametrize("backend", BACKENDS)
def test_simulated_new_rows_candidates_are_measured_and_decided(backend):
    """Two simulated ranks with the four new candidates on a 64 x 48 matrix: the first window
    measures the ones that take it (finite error and predicted time, the same on both ranks)
    and the probe decides among them. PowerSGD at rank 16 does not take it (16 x (64 + 48) x
    min_compression_rate 2 > 64 x 48: it would not compress), so it is never run nor chosen
    there; on a 1024 x 1024 matrix it is, at about twice rank 8's bytes."""
    schemes, states, outs, choices, fields, pending = _simulate(
        backend, 3, candidates=NEW_ROWS, step_penalty=0.0, error_budget=2.0)
    d = schemes[0].history[0]
    assert d.step == 2 and d.spec in schemes[0].specs[:4] and len(d.errors) == 5
    assert all(0.0 <= e < 1.0 for e in d.errors[:4]) and all(math.isfinite(p) for p in d.predicted_ms[:4])
    assert d.errors[4] == UNUSABLE and d.predicted_ms[4] == math.inf
    assert d.predicted_ms[1] < d.predicted_ms[0]  # the slow link: TopKC's bytes pay
    assert schemes[0].history_records() == schemes[1].history_records()
    big = TensorInfo("big", (1024, 1024), "float32", 2, 0, "sum")
    assert schemes[0]._fits(big) == [True] * 5
    wires = schemes[0]._wires(big)
    assert 1.99 * wires[3] < wires[4] < 2 * wires[3]  # P or Q of rank 16 against rank 8, and a few fixed bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_simulated_aged_topkc_candidate_keeps_agreed_ages(backend):
    """auto on TopKC with max_age: it starts (the one lossy candidate, on the slow link) and
    stays; its state carries the ages as ``a_age``, the same on both ranks and within the
    bound (A + ceil(m / k) - 1 = 3 + 6 - 1 for 12 chunks, k = 2); outputs plus what is owed
    are the gradients (fp16's rounding of the sums aside)."""
    schemes, states, outs, choices, fields, pending = _simulate(
        backend, 9, candidates="fp16|topkc:ratio=0.1&max_age=3", step_penalty=0.0, error_budget=2.0)
    assert choices == ["topkc:ratio=0.1,max_age=3"] * 9
    assert "a_age" in fields[-1] and "a_residual" in fields[-1]
    ops = one_rank_ops(backend)
    ages = [np.asarray(ops.to_host(s.a_age)) for s in states]
    np.testing.assert_array_equal(ages[0], ages[1])
    assert ages[0].shape == (12,) and 0 < ages[0].max() <= 3 + 6 - 1
    for t in range(9):
        assert _owed_error(outs, pending, t) < 2e-3, t
