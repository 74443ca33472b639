"""(Helper, not a test.) What THC's real-Horovod launches (tests/parallel/test_thc.py, PyTorch;
test_thc_tf.py, TensorFlow) share: the known inputs, the runs of a sudden drop in scale, and the
checks of the recorded steps against the float64 reference of tests/core/thc_emulation.py
(hand-made steps from the ranks' own payloads; ``hvd.allreduce(..., compression=c)`` steps from
the ranks' states).
"""
import math

import numpy as np

from tests.core.thc_emulation import (effective_lane_bits, emulate_allreduce, fingerprint_ok, np_layout,
                                      reference_codes, reference_decode, reference_ranges, rotated,
                                      split_payload, unrotated)

__all__ = ["SHAPE", "D", "STEPS", "DROP_BEFORE", "DROP_AFTER", "DROP", "DROP_RUNS", "known_inputs", "drop_runs",
           "layout_of_record", "check_hand", "decoded_from_states", "check_known", "check_drop"]

SHAPE = (50, 100)  # the main test tensor: 5000 coordinates, not a power of two
D = 5000
STEPS = 3  # steps per recorded run: the first sends nothing


def known_inputs(rank, seed=0, step=0, shape=SHAPE):
    """Rank ``rank``'s float32 input of ``shape`` for run ``seed`` at ``step`` (any process rebuilds it)."""
    return np.random.default_rng([seed, rank, step]).standard_normal(shape).astype(np.float32)


DROP_BEFORE, DROP_AFTER, DROP = 6, 5, 1e-6  # steps at scale 1, steps after the gradients fall 1e6x
# (spec, op) of the drop runs: the default under Average, and 4-bit lanes under a known Sum
# (centred words that use int32's sign bit, no guard bits).
DROP_RUNS = (("thc", "average"), ("thc:lane_bits=4", "sum"))


def drop_runs(hvd, comp_from_spec, tensor, state_of):
    """Each DROP_RUNS case through ``hvd.allreduce(x, compression=c)``: the inputs, the outputs
    and the final state of every step (NumPy)."""
    out = {}
    for spec, op in DROP_RUNS:
        comp, rows = comp_from_spec(spec), []
        for t in range(DROP_BEFORE + DROP_AFTER):
            x = known_inputs(hvd.rank(), 11, t) * np.float32(1.0 if t < DROP_BEFORE else DROP)
            got = hvd.allreduce(tensor(x), name="drop", op=hvd.Sum if op == "sum" else hvd.Average,
                                compression=comp)
            rows.append({"x": x, "out": np.array(got, copy=True)})
        out[f"drop_{spec}_{op}"] = {"steps": rows, "state": state_of(comp, "drop")}
    return out


def layout_of_record(rec, bits, n, blocking=False):
    """np_layout of a recorded tensor (block from its diagonal's +-1/sqrt(B))."""
    block = int(round(1.0 / float(np.abs(rec["diag"][0])) ** 2))
    return np_layout(bits, n, rec["x"].size if "x" in rec else D, block, blocking, effective_lane_bits(bits, n))


def check_hand(records, bits, op, blocking=False, saturation=True):
    """One hand-made step of every rank: outputs against the float64 reference from the ranks'
    own payloads, identical on all ranks; Horovod's reduced words against the emulation; the
    next ranges against the ranks' statistics. Returns (reference, layout, summed levels)."""
    n = len(records)
    lay = layout_of_record(records[0], bits, n, blocking)
    for rec in records:
        assert rec["dtype"] == "int32" and rec["own"].dtype == np.int32 and rec["own"].size == lay["total"]
    for rec in records[1:]:  # the same grid and rotation everywhere; identical outputs
        np.testing.assert_array_equal(rec["ranges"], records[0]["ranges"])
        np.testing.assert_array_equal(rec["diag"], records[0]["diag"])
        np.testing.assert_array_equal(rec["out"], records[0]["out"])
    own = [rec["own"] for rec in records]
    # What Horovod handed back is what tests/core/thc_emulation.py emulates: the sum, or trunc(sum / n).
    np.testing.assert_array_equal(np.asarray(records[0]["reduced"]).astype(np.int64),
                                  emulate_allreduce(own, op, n).astype(np.int64))
    summed = np.sum([split_payload(p, lay)[0] for p in own], axis=0)
    ref = reference_decode(own, records[0]["ranges"], records[0]["diag"], lay, op)
    got = records[0]["out"].reshape(-1).astype(np.float64)
    atol = 2e-6 * max(1.0, np.abs(ref).max()) * math.log2(lay["block"])
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    after = records[0].get("after")
    if after is not None and not blocking and fingerprint_ok(own, lay):
        np.testing.assert_allclose(after["ranges"], reference_ranges(own, lay), rtol=5e-6)
    if blocking:  # the real Max side all-reduce of the ranks' wanted ranges
        wanted = [reference_codes(rec["corrected"], lay, saturation)[2] for rec in records]
        np.testing.assert_allclose(records[0]["ranges"], np.max(wanted, axis=0), rtol=1e-5)
    return ref, lay, summed


def decoded_from_states(steps, op, block):
    """Per rank: its own decoded contribution, rht(x) + e_before - e_after (float64), from its
    states; the output every rank must hold is their sum (Sum) or mean (Average), rotated back."""
    n = len(steps)
    diag = steps[0]["after"]["diag"]
    total = 0.0
    for st in steps:
        e_before = st["before"]["residual"] if st["before"] is not None else 0.0
        total = total + rotated(st["x"], diag, block) + e_before - st["after"]["residual"]
    if op == "average":
        total = total / n
    return unrotated(total, diag, block, steps[0]["x"].size)


def check_known(runs, op, block=1024):
    """hvd.allreduce(..., compression=c) steps of every rank against the states' reference."""
    n = len(runs)
    for t in range(len(runs[0])):
        steps = [run_[t] for run_ in runs]
        for st in steps[1:]:
            np.testing.assert_array_equal(st["out"], steps[0]["out"])
        got = steps[0]["out"].reshape(-1).astype(np.float64)
        if t == 0:
            assert (got == 0).all()  # the first step sends nothing
            continue
        ref = decoded_from_states(steps, op, block)
        assert np.abs(ref).max() > 0.1
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        assert all(int(st["after"]["step"]) == t + 1 for st in steps)
    # Error feedback across the ranks: everything sent so far plus what the ranks still carry
    # is everything they were given (Sum; their mean under Average).
    scale = n if op == "average" else 1
    delivered = sum(steps["out"].reshape(-1).astype(np.float64) for steps in runs[0])
    last = [run_[-1]["after"] for run_ in runs]
    pending = sum(unrotated(st["residual"], st["diag"], block, runs[0][0]["x"].size) for st in last) / scale
    given = sum(st["x"].reshape(-1).astype(np.float64) for run_ in runs for st in run_) / scale
    np.testing.assert_allclose(delivered + pending, given, rtol=0, atol=1e-5 * len(runs[0]) * np.abs(given).max())


def check_drop(results, spec, op):
    """One :data:`DROP_RUNS` case of a launch (``results``: every rank's :func:`drop_runs`
    records). After the gradients fall 1e6x, error feedback flushes at most the new gradient's
    own range a step: from the third step on the output's RMS is within 8x the true sum's (or
    mean's), where without the bound it rang at ~1e3-1e5x for 8 steps. Nothing is lost: all
    outputs plus what the ranks still hold equal the float64 sum (mean) of every input, on every
    rank."""
    runs = [res[f"drop_{spec}_{op}"] for res in results]
    n = len(runs)
    scale = 1.0 / n if op == "average" else 1.0
    for t in range(DROP_BEFORE + DROP_AFTER):
        outs = [run_["steps"][t]["out"] for run_ in runs]
        assert all(np.array_equal(o, outs[0]) for o in outs)
        true = sum(run_["steps"][t]["x"].astype(np.float64) for run_ in runs) * scale
        if t >= DROP_BEFORE + 2:
            ratio = np.sqrt(np.mean(outs[0].astype(np.float64) ** 2) / np.mean(true ** 2))
            assert ratio < 8.0, (t, ratio)
    given = sum(st["x"].astype(np.float64) for run_ in runs for st in run_["steps"]).reshape(-1) * scale
    delivered = sum(st["out"].astype(np.float64) for st in runs[0]["steps"]).reshape(-1)
    block = int(round(1.0 / float(np.abs(runs[0]["state"]["diag"][0])) ** 2))
    pending = sum(unrotated(run_["state"]["residual"], run_["state"]["diag"], block, D) for run_ in runs) * scale
    np.testing.assert_allclose(delivered + pending, given, rtol=0, atol=1e-5 * np.abs(given).max())
    # The ranks still hold back most of what the last steps before the drop left them.
    assert np.abs(pending).max() > 1e3 * DROP
