"""PowerSGD's alternating variant across several ranks simulated in one process
(tests/core/powersgd_emulation.py: the payloads summed in float32 as Horovod does), against a
float64 reference written by hand: ranks agree, a joined rank, disagreements realigned,
non-finite values on one rank. The scheme on one rank: tests/core/test_powersgd.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.powersgd import PowerSGDConfig, PowerSGDScheme, PowerSGDState
from tests.backends import BACKENDS, as_float64
from tests.core.powersgd_emulation import rank_grads, simulate
from tests.reference import gram_schmidt64

_np = as_float64  # the shared helper of tests/backends.py
_orth64 = gram_schmidt64  # tests/reference.py


def _reference(grads, q0_t, fill, average, error_feedback=True):
    """The alternating variant in float64 by hand: grads[step][rank] -> outputs per step."""
    world, r = len(grads[0]), q0_t.shape[0]
    n, m = grads[0][0].shape
    residual = [np.zeros((n, m))] * world
    q, p = q0_t.T.astype(np.float64), None
    outs = []
    for t, xs in enumerate(grads):
        ms = [x + e if error_feedback else x for x, e in zip(xs, residual)]
        if t % 2 == 0:
            local = [mi @ q for mi in ms]
            agg = sum(local) / (world if average else 1)
            outs.append(agg @ q.T)
            residual = [mi - li @ q.T for mi, li in zip(ms, local)]
            p = _fill_basis64(agg, fill[:, :n].T)
        else:
            local = [mi.T @ p for mi in ms]
            agg = sum(local) / (world if average else 1)
            outs.append(p @ agg.T)
            residual = [mi - p @ li.T for mi, li in zip(ms, local)]
            q = _fill_basis64(agg, fill[:, :m].T)
    return outs


def _fill_basis64(a, fill):
    a = a.copy()
    zero = ~(np.abs(a).max(0) > 0)
    a[:, zero] = fill[:, zero]
    return _orth64(a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_ranks_agree_and_match_float64_reference(backend, op):
    world, shape = 3, (24, 20)
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    grads = rank_grads(30, world, 6, shape)
    log = simulate(backend, scheme, grads, op=op)
    q0 = _np(log[0]["before"][0].q)
    fill = _np(log[0]["before"][0].fill)
    want = _reference(grads, q0, fill, op == "average")
    for step, ref in zip(log, want):
        outs = [_np(o) for o in step["outs"]]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])  # bit-identical on every rank
        np.testing.assert_allclose(outs[0], ref, rtol=0, atol=1e-4 * np.abs(ref).max())
        for field in ("p", "q", "step", "realigned"):  # the shared state too
            for s in step["after"][1:]:
                np.testing.assert_array_equal(_np(getattr(s, field)), _np(getattr(step["after"][0], field)))
        assert int(_np(step["after"][0].realigned)) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_joined_rank_is_no_disagreement(backend):
    """A rank sitting a step out (hvd.join) adds zeros: the others still agree; the output is
    the sum of the contributors' decodes. The joined rank, stale afterwards, is caught next."""
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    grads = rank_grads(31, 3, 3, (24, 20))
    live = [[True] * 3, [True, True, False], [True] * 3]
    log = simulate(backend, scheme, grads, contribute=live)
    # The output is the sum of ranks 0 and 1's own decodes, M_r - E_r' (error feedback identity).
    decoded = sum(grads[1][r] + _np(log[1]["before"][r].residual) - _np(log[1]["after"][r].residual)
                  for r in (0, 1))
    for r in (0, 1):
        np.testing.assert_allclose(_np(log[1]["outs"][r]), decoded, rtol=0, atol=1e-5 * np.abs(decoded).max())
    assert log[1]["after"][2] is log[1]["before"][2]  # the joined rank's state stays
    assert int(_np(log[1]["after"][0].realigned)) == 0 and int(_np(log[1]["after"][0].step)) == 2
    # Step 2: rank 2 is at step 1, the others at step 2: disagreement, zero output, realigned.
    for r in range(3):
        assert (_np(log[2]["outs"][r]) == 0).all()
        assert int(_np(log[2]["after"][r].realigned)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("case", ["parity", "basis"])
def test_disagreement_realigns_every_rank(backend, op, case):
    """Rank 0 resumes from a checkpoint alone (its state is 3 steps, or 2 steps, ahead): the
    ranks disagree on the parity (3) or, with the same parity, on the basis (2). The step's
    output is 0 on every rank, each keeps its whole corrected gradient in the residual, and
    every rank leaves with the same basis and step 0; from then on they agree."""
    world, shape = 2, (24, 20)
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    ahead = 3 if case == "parity" else 2
    warm = simulate(backend, scheme, rank_grads(40, world, ahead, shape), op=op)
    fresh = simulate(backend, scheme, rank_grads(41, world, 1, shape), op=op)[0]["before"]
    states = [warm[-1]["after"][0], fresh[1]]
    grads = rank_grads(42, world, 4, shape)
    log = simulate(backend, scheme, grads, states=states, op=op)
    first = log[0]
    for r in range(world):
        assert (_np(first["outs"][r]) == 0).all()
        corrected = grads[0][r] + _np(states[r].residual)
        np.testing.assert_allclose(_np(first["after"][r].residual), corrected, rtol=1e-6, atol=1e-6)
        assert int(_np(first["after"][r].step)) == 0 and int(_np(first["after"][r].realigned)) == 1
        assert (_np(first["after"][r].p) == 0).all()
        q = _np(first["after"][r].q)
        np.testing.assert_allclose(q @ q.T, np.eye(2), atol=1e-5)
    for field in ("p", "q", "step", "realigned"):
        np.testing.assert_array_equal(_np(getattr(first["after"][0], field)),
                                      _np(getattr(first["after"][1], field)))
    # Afterwards: agreement, identical outputs, and error feedback delivers what step 0 held back.
    total_out, total_in = 0.0, sum(grads[0][r] + _np(states[r].residual) for r in range(world))
    for t, step in enumerate(log[1:], 1):
        outs = [_np(o) for o in step["outs"]]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert int(_np(step["after"][0].realigned)) == 1
        total_out = total_out + outs[0] * (world if op == "average" else 1)
        total_in = total_in + sum(grads[t])
    left = sum(_np(s.residual) for s in log[-1]["after"])
    np.testing.assert_allclose(total_out + left, total_in, rtol=0, atol=1e-4 * np.abs(total_in).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_agreeing_ranks_never_flagged(backend):
    """Identical bases never read as a disagreement, whatever the op, scale or world size."""
    scheme = PowerSGDScheme(PowerSGDConfig(rank=3))
    for world, op, scale in ((2, "sum", 1e-20), (5, "average", 1.0), (3, "sum", 1e20), (2, "average", 1e3)):
        grads = [[g * scale for g in gs] for gs in rank_grads(50 + world, world, 4, (20, 30))]
        log = simulate(backend, scheme, grads, op=op)
        assert int(_np(log[-1]["after"][0].realigned)) == 0, (world, op, scale)
        assert int(_np(log[-1]["after"][0].step)) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_on_one_rank_keeps_every_state(backend):
    scheme = PowerSGDScheme(PowerSGDConfig(rank=2))
    grads = rank_grads(60, 2, 3, (24, 20))
    grads[1][0][3, 5] = np.nan
    log = simulate(backend, scheme, grads)
    for r in range(2):
        assert np.isnan(_np(log[1]["outs"][r])).all()
        for field in PowerSGDState._fields:
            np.testing.assert_array_equal(_np(getattr(log[1]["after"][r], field)),
                                          _np(getattr(log[1]["before"][r], field)))
        assert np.isfinite(_np(log[2]["outs"][r])).all()
