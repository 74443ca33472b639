"""TopKC at the scheme level, one process, in each backend under test.

Several ranks of one tensor are simulated in this process: each rank compresses with its own
state, and the all-reduce is the sum of the payloads in the payload's dtype (fp16 sums rounded
once per addition, as Horovod sums them; Average then scales by 1/n), so the single-collective
protocol ("previous" selection: the scores ride at the end of the payload and become the
agreed scores of the next step) is checked rank by rank against the float64 reference
tests/reference.py:RefTopKC (the simulated ranks: tests/core/topkc_emulation.py). The real
multi-rank runs are in tests/parallel/; ``max_age``: tests/core/test_topkc_max_age.py.
"""
import dataclasses

import numpy as np
import pytest

from hvd_gradcomp.base import FP16_MAX, EmptyState, TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.cast import Fp16Scheme
from hvd_gradcomp.registry import make_scheme
from hvd_gradcomp.routing import Routing
from tests.backends import BACKENDS, one_rank_ops, backend_tensor, as_float64
from tests.core.topkc_emulation import Ranks
from tests.reference import RefTopKC


_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


VARIANTS = {
    "previous": dict(ratio=0.25, chunk=8),
    "previous_fp32": dict(ratio=0.3, chunk=7, payload_dtype="float32"),
    "previous_no_ef": dict(ratio=0.25, chunk=8, error_feedback=False),
    "current": dict(ratio=0.25, chunk=8, selection="current"),
    "current_no_ef": dict(ratio=0.25, chunk=8, selection="current", error_feedback=False),
    "previous_decay": dict(ratio=0.25, chunk=8, residual_decay=0.9),
    "current_decay": dict(ratio=0.25, chunk=8, selection="current", residual_decay=0.5),
    "previous_age": dict(ratio=0.25, chunk=8, max_age=2),
    "previous_age_decay": dict(ratio=0.25, chunk=8, max_age=3, residual_decay=0.9),
}


def _reference(n, numel, options):
    return RefTopKC(numel, n, options["ratio"], options["chunk"],
                    error_feedback=options.get("error_feedback", True),
                    payload=options.get("payload_dtype", "float16"),
                    selection=options.get("selection", "previous"),
                    residual_decay=options.get("residual_decay", 1.0),
                    max_age=options.get("max_age", 0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,op", [(1, "average"), (2, "average"), (2, "sum"), (3, "sum")])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ranks_match_float64_reference(backend, variant, n, op):
    """Outputs, selections, residuals and agreed scores of every rank, step by step."""
    options = VARIANTS[variant]
    shape = (7, 13)  # 91 coordinates: the last chunk is padded
    sim = Ranks(backend, n, shape, op, **options)
    ref = _reference(n, 91, options)
    gen = np.random.default_rng([n, len(variant)])
    for step in range(6):
        # Different scales per chunk and step, so the selection moves between chunks.
        grads = [gen.standard_normal(shape) * gen.uniform(0.1, 3.0, shape).round(1) for _ in range(n)]
        grads = [g.astype(np.float32).astype(np.float64) for g in grads]
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        scale = np.abs(expected).max()
        for r in range(n):
            np.testing.assert_allclose(outs[r].reshape(-1), expected, rtol=0, atol=2e-3 * scale,
                                       err_msg=f"{variant} n={n} {op} step {step} rank {r} output")
        for r in range(n):
            np.testing.assert_array_equal(_np(sim.ctxs[r].idx), ref.last_idx,
                                          err_msg=f"{variant} step {step} rank {r} selection")
            state = sim.states[r]
            if variant == "current_no_ef":  # nothing to keep between steps
                assert isinstance(state, EmptyState)
                continue
            if options.get("error_feedback", True):
                np.testing.assert_allclose(_np(state.residual), ref.residual[r], rtol=0,
                                           atol=2e-3 * max(np.abs(ref.residual[r]).max(), 1),
                                           err_msg=f"{variant} step {step} rank {r} residual")
            else:
                assert _np(state.residual).size == 0
            if options.get("selection", "previous") == "previous":
                # The agreed scores are the all-reduced ones, identical on every rank.
                np.testing.assert_allclose(_np(state.scores), ref.prev, rtol=2e-3, atol=2e-3,
                                           err_msg=f"{variant} step {step} rank {r} scores")
                np.testing.assert_array_equal(_np(state.scores), _np(sim.states[0].scores))
                if options.get("max_age"):
                    np.testing.assert_array_equal(_np(state.age), ref.age,
                                                  err_msg=f"{variant} step {step} rank {r} ages")
                else:
                    assert "age" not in state._fields
            else:
                assert _np(state.scores).size == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_previous_payload_layout_and_scores(backend):
    """[k*chunk values / n, m scores of g + e' normalised by this rank's max]; finish keeps the
    all-reduced score part as the next step's agreed scores."""
    sim = Ranks(backend, 1, (40,), "average", ratio=0.25, chunk=4)  # m = 10, k = 3
    g0 = np.arange(40, dtype=np.float64) / 8.0
    sim.step([g0])
    payload = _np(sim.payloads[0])
    assert sim.ops.dtype(sim.payloads[0]) == "float16" and payload.shape == (3 * 4 + 10 + 16,)
    assert payload[22:].sum() == 1 and set(payload[22:]) == {0, 1}  # one vote
    # Before the first step every score is 0: the first k chunks go, in order.
    np.testing.assert_array_equal(_np(sim.ctxs[0].idx), [0, 1, 2])
    np.testing.assert_array_equal(payload[:12], g0[:12].astype(np.float16))
    residual = g0.copy()
    residual[:12] = 0.0
    np.testing.assert_array_equal(_np(sim.states[0].residual), residual)
    guess = (g0 + residual).reshape(10, 4)
    scores = (guess ** 2).sum(1)
    np.testing.assert_allclose(payload[12:22], scores / scores.max(), rtol=1e-3)
    assert payload[12:22].max() == 1.0
    np.testing.assert_array_equal(_np(sim.states[0].scores), payload[12:22])
    # Next step: the chunks of highest agreed score (the last three), highest first.
    sim.step([np.zeros(40)])
    np.testing.assert_array_equal(_np(sim.ctxs[0].idx), [9, 8, 7])


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_saturates_and_the_excess_arrives_later(backend):
    """One rank, [70000, 1, 0.5, 0.25] then gradients of 1e-3: the fp16 payload carries 65504,
    never inf; the residual keeps the finite excess, which arrives in later steps."""
    options = dict(ratio=0.5, chunk=2)
    sim = Ranks(backend, 1, (4,), "average", **options)
    ref = _reference(1, 4, options)
    grads = [np.array([70000.0, 1.0, 0.5, 0.25])] + [np.full(4, 1e-3)] * 9
    outs = []
    for step, g in enumerate(grads):
        out = sim.step([g])[0]
        expected = ref.step([g], "average")
        outs.append(out)
        payload = _np(sim.payloads[0])
        assert np.isfinite(payload).all() and np.abs(payload).max() <= FP16_MAX, (step, payload)
        residual = _np(sim.states[0].residual)
        assert np.isfinite(residual).all(), (step, residual)
        # float32 (the scheme) against float64 (the reference): 4496 + 1e-3 is rounded to
        # float32's spacing there (2**-11), which the residual then carries.
        np.testing.assert_allclose(out, expected, rtol=1e-3, atol=3e-4, err_msg=f"step {step} output")
        np.testing.assert_allclose(residual, ref.residual[0], rtol=1e-3, atol=3e-4, err_msg=f"step {step} residual")
        np.testing.assert_array_equal(_np(sim.ctxs[0].idx), ref.last_idx)
        if step == 0:
            np.testing.assert_array_equal(out, [FP16_MAX, 1.0, 0.0, 0.0])
            np.testing.assert_array_equal(residual, [70000.0 - FP16_MAX, 0.0, 0.5, 0.25])
        if step == 1:  # the chunk that saturated keeps the highest score: its excess goes now
            assert out[0] == pytest.approx(70000.0 - FP16_MAX + 1e-3, rel=1e-3)
    # Nothing is lost: everything sent plus what is still owed is what came in (float64).
    total = np.sum(grads, axis=0)
    np.testing.assert_allclose(np.sum(outs, axis=0) + _np(sim.states[0].residual), total,
                               rtol=0, atol=1e-2)
    assert np.sum(outs, axis=0)[0] == pytest.approx(70000.0 + 9e-3, rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,op", [(2, "average"), (3, "sum")])
def test_overflow_on_every_rank_does_not_skip_the_step(backend, n, op):
    """Every rank at 70000: each sends the largest float16 <= 65504 / n (32752 for n = 2,
    21824 for n = 3), so the fp16 sum stays finite, the step is not skipped, and the excess
    arrives in later steps (float64 reference)."""
    options = dict(ratio=0.5, chunk=2)
    sim = Ranks(backend, n, (4,), op, **options)
    ref = _reference(n, 4, options)
    big = np.array([70000.0, 1.0, 0.5, 0.25])
    grads = [big] + [np.full(4, 1e-3)] * 6
    outs = []
    for step, g in enumerate(grads):
        got = sim.step([g] * n)
        expected = ref.step([g] * n, op)
        assert np.isfinite(_np(sim.reduced)).all(), step
        for r in range(n):
            np.testing.assert_allclose(got[r], expected, rtol=1e-3, atol=1e-3, err_msg=f"step {step} rank {r}")
            np.testing.assert_allclose(_np(sim.states[r].residual), ref.residual[r], rtol=1e-3, atol=1e-3,
                                       err_msg=f"step {step} rank {r} residual")
        outs.append(got[0])
    limit = {2: 32752.0, 3: 21824.0}[n]
    per_rank = 1 if op == "average" else n  # the output is the mean, or the sum over ranks
    assert outs[0][0] == limit * n * per_rank
    # All of it arrives: what was sent plus what the ranks still owe is what came in, up to
    # the fp16 rounding of the all-reduced sums (no rank's residual holds that).
    owed = sum(_np(st.residual) for st in sim.states) / (n if op == "average" else 1)
    np.testing.assert_allclose(np.sum(outs, axis=0) + owed, np.sum(grads, axis=0) * per_rank, rtol=1e-4, atol=5e-2)
    assert np.abs(owed).max() < 0.1  # the excess of coordinate 0 has been delivered


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_step_keeps_residual_and_scores(backend):
    """Rank 1's gradient holds an inf: both ranks' outputs are NaN on the sent chunks and both
    ranks' residual and agreed scores stay exactly as they were after the previous step."""
    sim = Ranks(backend, 2, (4,), "sum", ratio=0.5, chunk=2)
    sim.step([(r + 1) * np.array([1.0, 2.0, 3.0, 4.0]) for r in range(2)])
    before = [[_np(v).copy() for v in s] for s in sim.states]
    bad = np.zeros(4)
    bad[1] = np.inf
    outs = sim.step([bad, np.zeros(4)])
    for r in range(2):
        assert not np.isfinite(outs[r]).all()
        for a, b in zip(sim.states[r], before[r]):
            np.testing.assert_array_equal(_np(a), b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_numel_sends_small_tensors_as_fp16(backend):
    """The size threshold is the routing's: a plain topkc compressor sends tensors below
    min_numel (default 1024) as pre-scaled fp16 (no state); the scheme itself compresses
    whatever it is given, down to one coordinate."""
    ops = one_rank_ops(backend)
    routing = Routing.from_spec("topkc")
    fp16 = Fp16Scheme()
    for numel, tiny in [(1, True), (1023, True), (1024, False)]:
        x = _tensor(backend, np.linspace(-3.0, 3.0, numel))
        info = TensorInfo("t", (numel,), "float32", 4, 0)
        route = routing.decide(None, numel)
        assert route.text == ("fp16" if tiny else "topkc"), numel
        state = route.scheme.init(ops, info, x)
        payload, ctx = compress_tensor(route.scheme, ops, x, state, info)
        out, after = finish_tensor(route.scheme, ops, payload, ctx, state, info)
        if tiny:
            assert isinstance(state, EmptyState) and after is state
            assert route.scheme.wire(info) == fp16.wire(info)
            expected, _ = compress_tensor(fp16, ops, x, EmptyState(), info)
            np.testing.assert_array_equal(_np(payload), _np(expected))
            np.testing.assert_allclose(_np(out), np.linspace(-3.0, 3.0, numel), rtol=1e-3, atol=1e-3)
        # The scheme on the same tensor: chunks of 256, k = 1, m scores and 16 votes.
        scheme = routing.default
        m = -(-numel // 256)
        state = scheme.init(ops, info, x)
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        _, after = finish_tensor(scheme, ops, payload, ctx, state, info)
        assert _np(payload).shape == (256 + m + 16,) and scheme.wire(info).payload == 2 * (256 + m + 16)
        assert _np(after.residual).shape == (numel,) and _np(after.scores).shape == (m,)
    assert Routing.from_spec("topkc:min_numel=1").decide(None, 1).text == "topkc"
    small = make_scheme("topkc", chunk=2)
    info = TensorInfo("t", (7,), "float32", 1, 0)
    assert small.wire(info).payload == 2 * (2 + 4 + 16)  # k = 1 chunk of 2 values + 4 scores + 16 votes
    with pytest.raises(ValueError, match=r"^topkc: unknown option\(s\) \['min_numel'\]"):
        make_scheme("topkc", min_numel=1024)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, x, op, name, group=None):
        self.calls.append((op, name, group))
        return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_current_selection_posts_a_side_collective(backend):
    """"previous" (default) posts nothing inside compress; "current" posts one blocking score
    sum per tensor, named after the key, in the tensor's process set."""
    ops = one_rank_ops(backend)
    x = _tensor(backend, np.arange(64.0))
    group = object()
    for selection, expected in [("previous", 0), ("current", 1)]:
        record = _Recorder()
        rec_ops = dataclasses.replace(ops, allreduce=record)
        scheme = make_scheme("topkc", ratio=0.25, chunk=8, selection=selection)
        info = TensorInfo("layer.w", (64,), "float32", 1, 0, "sum", group)
        assert scheme.blocking == (expected == 1)
        assert scheme.wire(info).side_collectives == expected
        state = scheme.init(rec_ops, info, x)
        payload, ctx = compress_tensor(scheme, rec_ops, x, state, info)
        finish_tensor(scheme, rec_ops, payload, ctx, state, info)
        assert len(record.calls) == expected, record.calls
        if expected:
            op, name, got_group = record.calls[0]
            assert op == "sum" and "layer.w" in name and got_group is group


# ---- residual_decay ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_residual_decay_forgets_geometrically(backend):
    """One rank, 4 chunks of 2, k = 1, the same gradient every step: chunk 0 (by far the
    largest) goes every step; chunk 3 is never sent, so it owes g + beta g + beta**2 g + ... =
    g (1 - beta**t) / (1 - beta) after t steps (plain error feedback: t g, without bound)."""
    g = np.array([100.0, 100.0, 1.0, 1.0, 2.0, 2.0, 0.5, 0.5])
    for beta in (1.0, 0.5, 0.9):
        sim = Ranks(backend, 1, (8,), "average", ratio=0.25, chunk=2, residual_decay=beta)
        for t in range(1, 7):
            out = sim.step([g])[0]
            owed = _np(sim.states[0].residual)
            total = t if beta == 1.0 else (1 - beta ** t) / (1 - beta)
            np.testing.assert_allclose(owed[6:], 0.5 * total, rtol=1e-6, err_msg=f"beta {beta} step {t}")
            # chunk 0 goes (first by index before any score, then by its agreed score)
            np.testing.assert_array_equal(_np(sim.ctxs[0].idx), [0])
            np.testing.assert_array_equal(out[:2], 100.0)
            np.testing.assert_array_equal(owed[:2], 0.0)
        # The agreed scores guess the next step's c = g + beta e' per chunk (normalised).
        guess = (g + beta * owed).reshape(4, 2)
        scores = (guess ** 2).sum(1)
        np.testing.assert_allclose(_np(sim.states[0].scores), scores / scores.max(), rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_residual_decay_one_is_plain_error_feedback(backend):
    """residual_decay=1.0 (the default) is bit for bit the scheme without the option: same
    payloads, outputs and states, two ranks, six steps."""
    plain = Ranks(backend, 2, (7, 13), "average", ratio=0.25, chunk=8)
    same = Ranks(backend, 2, (7, 13), "average", ratio=0.25, chunk=8, residual_decay=1.0)
    assert plain.scheme.config == same.scheme.config and plain.scheme.spec() == same.scheme.spec()
    gen = np.random.default_rng(3)
    for _ in range(6):
        grads = [gen.standard_normal((7, 13)) for _ in range(2)]
        a, b = plain.step(grads), same.step(grads)
        for r in range(2):
            np.testing.assert_array_equal(a[r], b[r])
            np.testing.assert_array_equal(_np(plain.payloads[r]), _np(same.payloads[r]))
            for x, y in zip(plain.states[r], same.states[r]):
                np.testing.assert_array_equal(_np(x), _np(y))


def test_residual_decay_option():
    """Declared like the others: a number in (0, 1], default 1.0; needs error feedback; in the
    spec and its repr when set; the payload and wire bytes do not change."""
    assert make_scheme("topkc").config.residual_decay == 1.0
    scheme = make_scheme("topkc", ratio=0.01, residual_decay=0.95)
    assert scheme.config.residual_decay == 0.95 and "residual_decay=0.95" in scheme.spec()
    assert Routing.from_spec(scheme.spec()).default.config == scheme.config
    assert Routing.from_spec("topkc:0.01,residual_decay=0.95").default.config == scheme.config
    info = TensorInfo("t", (100000,), "float32", 2, 0)
    assert scheme.wire(info) == make_scheme("topkc", ratio=0.01).wire(info)
    for bad in (0, 0.0, 1.5, -0.5, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match=r"^topkc: residual_decay must be a number in \(0, 1\], got "):
            make_scheme("topkc", residual_decay=bad)
    with pytest.raises(ValueError, match=r"^topkc: residual_decay=0.9 needs error_feedback=True"):
        make_scheme("topkc", residual_decay=0.9, error_feedback=False)
    make_scheme("topkc", residual_decay=1.0, error_feedback=False)  # 1.0 is no decay: accepted
