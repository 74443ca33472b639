"""(Helper, not a test.) The launches and checks of the real-Horovod hang scenarios
(tests/parallel/test_adapter_hangs.py, test_adapter_hangs_divergent.py): one launch per
scenario (:class:`Launch`, a hard timeout of :data:`LAUNCH_TIMEOUT` s) runs every spec in turn,
each rank saving each spec's value or exception at once (:func:`each_spec`); the values are
checked for agreement across ranks and against float64 references (:func:`check_values`).
"""
import os
import pickle
import tempfile
import traceback

import numpy as np
import pytest

from tests.hvdrun import run

__all__ = ["LAUNCH_TIMEOUT", "SPECS", "EXACT", "VALUE_SPECS", "BASELINE", "TOL", "SHAPE", "known", "rel_err",
           "each_spec", "Launch", "check_agree_finite", "check_params", "check_values",
           "torch_compression", "numpy_params"]

LAUNCH_TIMEOUT = 120
SPECS = ["fp16", "topkc:ratio=0.25,chunk=8", "thc", "powersgd:rank=2"]
EXACT = "topkc:ratio=1"  # top-k keeping every chunk: lossless selection, fp16 payload
VALUE_SPECS = SPECS + [EXACT]
BASELINE = "horovod"  # Horovod's own path, no compression argument
# Relative L2 error bounds of an all-reduce output against the float64 reference, by spec;
# the other specs are lossy by design: outputs must agree across ranks and be finite.
TOL = {"fp16": 0.01, "thc": 0.6, EXACT: 0.01, BASELINE: 1e-6}
SHAPE = (50, 100)  # the known all-reduced tensors: 5000 coordinates, a matrix for PowerSGD


def known(rank, step, salt=0, shape=SHAPE):
    """The float32 tensor rank ``rank`` all-reduces at ``step``."""
    return np.random.default_rng([salt, rank, step]).standard_normal(shape).astype(np.float32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _rank():
    return int(os.environ["HOROVOD_RANK"])


def each_spec(specs, outdir, body):
    """Worker side: ``body(spec)`` for each spec; its value (or exception) saved at once."""
    rank = _rank()
    for i, spec in enumerate(specs):
        print(f"[test_adapter_hangs] rank {rank}: {spec} started", flush=True)
        open(os.path.join(outdir, f"start-{rank}-{i}"), "w").close()
        try:
            rec = {"ok": True, "value": body(spec)}
        except Exception as e:  # noqa: BLE001 - reported per spec, the next spec still runs
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        with open(os.path.join(outdir, f"done-{rank}-{i}.part"), "wb") as f:
            pickle.dump(rec, f)
        os.replace(os.path.join(outdir, f"done-{rank}-{i}.part"), os.path.join(outdir, f"done-{rank}-{i}"))
        print(f"[test_adapter_hangs] rank {rank}: {spec} {'done' if rec['ok'] else 'raised ' + rec['error']}",
              flush=True)


class Launch:
    """One launch of ``worker(specs, outdir)`` on ``np`` ranks; per-spec results by rank."""

    def __init__(self, worker, np, specs):
        self.np, self.specs, self.error = np, list(specs), None
        self.done, self.started = {}, set()
        with tempfile.TemporaryDirectory(prefix="test-hangs-") as outdir:
            try:
                run(worker, np=np, args=(self.specs, outdir), timeout=LAUNCH_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - each spec's test reports it
                self.error = e
            for name in os.listdir(outdir):
                kind, rank, i = name.split("-")[0], *name.split(".")[0].split("-")[1:]
                if kind == "start":
                    self.started.add((int(rank), int(i)))
                elif kind == "done" and not name.endswith(".part"):
                    with open(os.path.join(outdir, name), "rb") as f:
                        self.done[(int(rank), int(i))] = pickle.load(f)

    def values(self, spec):
        """Every rank's value for ``spec``; fails the test with the reason when there is none."""
        i = self.specs.index(spec)
        recs = [self.done.get((r, i)) for r in range(self.np)]
        raised = [f"rank {r} raised {rec['error']}\n{rec['traceback']}"
                  for r, rec in enumerate(recs) if rec is not None and not rec["ok"]]
        earlier = sorted({f"{self.specs[j]} (rank {r})" for (r, j), rec in self.done.items()
                          if j < i and not rec["ok"]})
        if earlier:  # an exception on some ranks only can leave Horovod shut down or out of step
            raised.append(f"(earlier specs raised too, which may be the cause: {', '.join(earlier)})")
        if raised and any(rec is not None and not rec["ok"] for rec in recs):
            pytest.fail(f"{spec}:\n" + "\n".join(raised), pytrace=False)
        missing = [r for r, rec in enumerate(recs) if rec is None]
        if missing:
            running = [r for r in missing if (r, i) in self.started]
            err = self.error
            cause = f"\n{err.__cause__}" if err is not None and err.__cause__ is not None else ""
            why = f"{type(err).__name__}: {err}{cause}" if err is not None else "no error reported"
            pytest.fail(f"{spec}: no result from ranks {missing} (running it at the end: {running}); "
                        f"the launch ended with {why}" + "".join("\n" + e for e in raised), pytrace=False)
        return [rec["value"] for rec in recs]


def check_agree_finite(outs, label):
    """All-reduce outputs of one group of ranks: finite and bit-identical."""
    for r, o in enumerate(outs):
        assert np.isfinite(o).all(), f"{label}: rank {r} output not finite"
    for r, o in enumerate(outs[1:], 1):
        assert np.array_equal(outs[0], o), f"{label}: ranks 0 and {r} differ (max |diff| " \
                                          f"{np.abs(outs[0] - o).max():.3g})"


def check_params(per_rank, label):
    """Parameter dicts of all ranks: finite and bit-identical."""
    for k in per_rank[0]:
        check_agree_finite([p[k] for p in per_rank], f"{label} param {k}")


def check_values(spec, outs, refs, label, may_defer=1, realigns=False):
    """Per-step all-reduce outputs ``outs`` against float64 references ``refs`` (one group).

    fp16, topkc:ratio=1 and the baseline: every step within ``TOL``. THC quantises with ranges
    learnt from the previous step, so its first step sends nothing (all of it waits in error
    feedback; also after a realignment, see thc.py) and the next carries it: a THC step passes
    when the *cumulative* output is within ``TOL`` of the cumulative reference, or when it is
    exactly 0 (deferred) and comes before step ``may_defer``. With ``realigns`` (ranks whose
    states differ), TopKC follows the same rule: a split selection vote gives 0 for the step
    and the next step carries it. Other specs: no bound (lossy).
    Returns the errors, for the report.
    """
    per_step = [rel_err(o, r) for o, r in zip(outs, refs)]
    cumulative = [rel_err(sum(outs[:s + 1]), sum(refs[:s + 1])) for s in range(len(outs))]
    errors = {"per_step": [round(e, 4) for e in per_step], "cumulative": [round(e, 4) for e in cumulative]}
    if spec == "thc" or (realigns and spec in TOL):
        bad = [s for s, e in enumerate(cumulative)
               if e > TOL[spec] and not (s < may_defer and not np.any(outs[s]))]
    elif spec in TOL:
        bad = [s for s, e in enumerate(per_step) if e > TOL[spec]]
    else:
        bad = []
    assert not bad, f"{label}: relative error above {TOL[spec]} at steps {bad}: {errors}"
    return errors


def torch_compression(hvd, spec):
    """kwargs for Horovod: a fresh compressor of ``spec``, or nothing for the baseline."""
    if spec == BASELINE:
        return {}
    from torch_backend import Compression
    return {"compression": Compression.from_spec(spec)}


def numpy_params(module):
    return {k: v.detach().numpy().astype(np.float64) for k, v in module.named_parameters()}
