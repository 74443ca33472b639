"""TopKC's ``max_age`` (every chunk sent within the bound, realignment after a split vote, its
state's round trip and type, after an FP16 warm-up, 0 as the plain scheme) across ranks
simulated in one process (tests/core/topkc_emulation.py), in each backend under test.
"""
import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.registry import make_scheme
from hvd_gradcomp.routing import Routing
from tests.backends import BACKENDS, as_float64, backend_tensor, one_rank_ops
from tests.core.topkc_emulation import Ranks

_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


def _waits(selections, m):
    """The age (steps unsent before) of every chunk at each of its sends, and the ages after
    the last step, from a list of selections (int64 [k] per step), ages counted from 0."""
    age, waits = np.zeros(m, np.int64), []
    for idx in selections:
        waits += [int(age[i]) for i in idx]
        age += 1
        age[np.asarray(idx)] = 0
    return waits, age


def _skewed_grads(gen, n, m, chunk, hot=3):
    """n ranks' gradients of m chunks: the first ``hot`` chunks 100x the others, so the scores
    alone keep choosing them."""
    scale = np.where(np.arange(m * chunk) < hot * chunk, 100.0, 1.0)
    return [gen.standard_normal(m * chunk) * scale for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_sends_every_chunk_within_the_bound(backend):
    """2 ranks, 24 chunks of 4, k = 3 (ratio 1/8), three chunks far larger than the rest:
    without max_age the scores keep them and most chunks wait the whole run; with max_age = 16
    (2 / ratio) every chunk is sent at an age of at most A + ceil(m / k) - 1 = 23 (16 once the
    start's sweep is over), every rank selects the same chunks and keeps the same ages (those
    of the selections), and the scores still choose: more than half the slots go to the hot
    chunks (the 21 others need at most 21 / 17 of the 3 a step)."""
    m, k, chunk, steps, age_bound = 24, 3, 4, 80, 16
    for max_age in (0, age_bound):
        sim = Ranks(backend, 2, (m * chunk,), "average", ratio=0.125, chunk=chunk, max_age=max_age)
        gen = np.random.default_rng(5)
        selections = []
        for _ in range(steps):
            sim.step(_skewed_grads(gen, 2, m, chunk))
            idx = [_np(c.idx).astype(np.int64) for c in sim.ctxs]
            np.testing.assert_array_equal(idx[0], idx[1])
            selections.append(idx[0])
            if max_age:
                expected = _waits(selections, m)[1]
                for state in sim.states:
                    np.testing.assert_array_equal(_np(state.age), expected)
                    assert _np(state.realigned) == 0
        waits, age = _waits(selections, m)
        if not max_age:
            assert age.max() >= steps - 2  # chunks never sent: what the option is for
            continue
        assert max(waits) <= age_bound + -(-m // k) - 1 and age.max() <= age_bound + -(-m // k) - 1
        late = _waits(selections[40:], m)[0]
        assert max(late) <= age_bound, late
        hot = sum(int(i) < 3 for idx in selections[40:] for i in idx)
        assert hot > 1.5 * len(selections[40:]), hot


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_realigns_after_a_split_vote(backend):
    """Rank 1's ages differ (a state of its own: loaded alone, back from a join), so it selects
    other chunks: the vote splits, the output is 0, every rank gets back what it sent, and
    every rank restarts its ages at 0, so from the next step on the ranks agree again."""
    m, chunk = 16, 4
    sim = Ranks(backend, 2, (m * chunk,), "sum", ratio=0.125, chunk=chunk, max_age=6)
    gen = np.random.default_rng(1)
    for _ in range(3):
        sim.step(_skewed_grads(gen, 2, m, chunk, hot=2))
    residuals = [_np(s.residual) for s in sim.states]
    ages = _np(sim.states[1].age).copy()
    ages[[9, 12]] = 7  # due on rank 1 only
    sim.states[1] = sim.states[1]._replace(age=_cast_like(backend, ages, sim.states[1].age))
    grads = _skewed_grads(gen, 2, m, chunk, hot=2)
    outs = sim.step(grads)
    assert not np.array_equal(_np(sim.ctxs[0].idx), _np(sim.ctxs[1].idx))
    for r in range(2):
        np.testing.assert_array_equal(outs[r], 0.0)
        assert _np(sim.states[r].realigned) == 1
        np.testing.assert_array_equal(_np(sim.states[r].age), np.zeros(m))
        np.testing.assert_allclose(_np(sim.states[r].residual), residuals[r] + grads[r], rtol=1e-6, atol=1e-5)
    for _ in range(4):
        sim.step(_skewed_grads(gen, 2, m, chunk, hot=2))
        np.testing.assert_array_equal(_np(sim.ctxs[0].idx), _np(sim.ctxs[1].idx))
        np.testing.assert_array_equal(_np(sim.states[0].age), _np(sim.states[1].age))
        assert _np(sim.states[0].realigned) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_state_round_trip_resumes_exactly(backend):
    """The ages are a state field: 5 steps, the states as saved (host values) loaded into
    fresh ranks, 5 more steps == 10 uninterrupted, bit for bit (payloads, outputs, states);
    with residual_decay too."""
    options = dict(ratio=0.125, chunk=4, max_age=5, residual_decay=0.9)
    gen = np.random.default_rng(7)
    grads = [_skewed_grads(gen, 2, 16, 4) for _ in range(10)]
    full = Ranks(backend, 2, (64,), "average", **options)
    for g in grads:
        full_out = full.step(g)
    half = Ranks(backend, 2, (64,), "average", **options)
    for g in grads[:5]:
        half.step(g)
    saved = [{f: np.asarray(_np(v)) for f, v in zip(s._fields, s)} for s in half.states]
    resumed = Ranks(backend, 2, (64,), "average", **options)
    for r, fields in enumerate(saved):
        fresh = resumed.states[r]
        assert set(fields) == set(fresh._fields) == {"residual", "scores", "realigned", "age"}
        resumed.states[r] = type(fresh)(*[_cast_like(backend, fields[f], v) for f, v in zip(fresh._fields, fresh)])
    for g in grads[5:]:
        out = resumed.step(g)
    for r in range(2):
        np.testing.assert_array_equal(out[r], full_out[r])
        for a, b in zip(resumed.states[r], full.states[r]):
            np.testing.assert_array_equal(_np(a), _np(b))
    assert _np(full.states[0].age).max() > 0


def _cast_like(backend, value, like):
    """A host array as a tensor of ``like``'s backend and dtype."""
    if backend == "torch":
        import torch
        return torch.as_tensor(value).to(like.dtype)
    import tensorflow as tf
    return tf.constant(value, like.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_after_an_fp16_warmup(backend):
    """With fp16_warmup=3 the ages stay 0 through the warm-up (dense steps, no selection) and
    count from the hand-over: each compressed step's ages are those of its selections, and
    every chunk goes within A + ceil(m / k) - 1 steps of the hand-over's."""
    m, chunk, max_age = 16, 4, 4
    sim = Ranks(backend, 2, (m * chunk,), "average", ratio=0.125, chunk=chunk, max_age=max_age, fp16_warmup=3)
    gen = np.random.default_rng(2)
    selections = []
    for step in range(20):
        sim.step(_skewed_grads(gen, 2, m, chunk, hot=2))
        ctx = sim.ctxs[0]
        state = sim.states[0]
        if ctx.warm:
            np.testing.assert_array_equal(_np(state.age), 0)
            continue
        selections.append(_np(ctx.inner.idx).astype(np.int64))
        np.testing.assert_array_equal(_np(sim.ctxs[1].inner.idx), selections[-1])
        for s in sim.states:
            np.testing.assert_array_equal(_np(s.age), _waits(selections, m)[1])
    # (The simulated ranks share the scheme object, whose host count of warm-up steps is per
    # tensor key, so the hand-over comes after fewer steps than fp16_warmup here.)
    assert 0 < len(selections) < 20
    assert set(selections[0]) == {0, 1}  # the hand-over's scores (the aggregate's norms) pick the hot chunks
    assert max(_waits(selections, m)[0]) <= max_age + -(-m // 2) - 1


def test_max_age_option():
    """Declared like the others: an integer >= 0, default 0 (off: the plain state, no age
    field); in the spec when set; the payload and wire bytes do not change; refused with EF21
    and the blocking selection."""
    assert make_scheme("topkc").config.max_age == 0
    scheme = make_scheme("topkc", ratio=0.1, max_age=20)
    assert scheme.config.max_age == 20 and scheme.spec() == "topkc:ratio=0.1,max_age=20"
    assert Routing.from_spec("topkc:0.1,max_age=20").default.config == scheme.config
    info = TensorInfo("t", (100000,), "float32", 2, 0)
    assert scheme.wire(info) == make_scheme("topkc", ratio=0.1).wire(info)
    for bad in (-1, 2.5, "20", True, None):
        with pytest.raises(ValueError, match=r"^topkc: max_age must be an integer >= 0, got "):
            make_scheme("topkc", max_age=bad)
    for other in (dict(error_feedback="ef21"), dict(selection="current")):
        with pytest.raises(ValueError, match=r"^topkc: max_age=20 needs selection='previous' and classic error"):
            make_scheme("topkc", max_age=20, **other)
    make_scheme("topkc", max_age=0, error_feedback="ef21")  # 0 is off: accepted
    make_scheme("topkc", max_age=20, error_feedback=False)  # the selection is still agreed


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_state_type(backend):
    """Without max_age the plain TopKCState (checkpoints of earlier runs keep their fields);
    with it TopKCAgedState, whose ages are int64 [m], 0 at first."""
    from hvd_gradcomp.topkc import TopKCAgedState, TopKCState
    ops = one_rank_ops(backend)
    like = _tensor(backend, np.zeros(3))
    small = TensorInfo("t", (40,), "float32", 1, 0)
    assert type(make_scheme("topkc", chunk=4).init(ops, small, like)) is TopKCState
    aged = make_scheme("topkc", chunk=4, max_age=3).init(ops, small, like)
    assert type(aged) is TopKCAgedState and ops.dtype(aged.age) == "int64"
    np.testing.assert_array_equal(_np(aged.age), np.zeros(10))


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_age_zero_is_the_plain_scheme(backend):
    """max_age=0 (the default) is bit for bit the scheme without the option."""
    plain = Ranks(backend, 2, (7, 13), "average", ratio=0.25, chunk=8)
    same = Ranks(backend, 2, (7, 13), "average", ratio=0.25, chunk=8, max_age=0)
    assert plain.scheme.config == same.scheme.config and plain.scheme.spec() == same.scheme.spec()
    gen = np.random.default_rng(4)
    for _ in range(5):
        grads = [gen.standard_normal((7, 13)) for _ in range(2)]
        a, b = plain.step(grads), same.step(grads)
        for r in range(2):
            np.testing.assert_array_equal(a[r], b[r])
            np.testing.assert_array_equal(_np(plain.payloads[r]), _np(same.payloads[r]))
