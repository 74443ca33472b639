"""Training with compression, 2 ranks: do the compressors keep up with FP16?

Workload: a 64-32-10 MLP (2,410 parameters) on scikit-learn's digits (1,797 images), each
rank holding half of the data, full-batch gradient descent (lr 0.5) for 200 steps, identical
initial weights. The final full-data cross-entropy is compared with FP16's (one launch):
- topkc (ratio 0.05, chunk 16, error feedback, every tensor compressed: min_numel=1) within
  10% + 0.02; without error feedback it must be measurably worse (at least 0.05 higher than
  with it); with its default min_numel (only the 64x32 weight compressed, the rest fp16) and
  with the blocking "current" selection within 10% + 0.02 too;
- thc (saturation, partial rotation) and the simple adaptation within 2% + 0.005 (the
  32x64 weight is THC-compressed; the smaller tensors go fp16 below min_numel);
- powersgd at ranks 2 and 4 within 15%.
Also an 8-rank launch checks that fp16 sums of large values do not overflow.
"""
import numpy as np
import pytest

from tests.hvdrun import default_timeout, run

SPECS = {"fp16": "fp16", "topkc_ef": "topkc:ratio=0.05,chunk=16,min_numel=1",
         "topkc_no_ef": "topkc:ratio=0.05,chunk=16,error_feedback=false,min_numel=1",
         "topkc_default": "topkc:ratio=0.05,chunk=16",
         "topkc_current": "topkc:ratio=0.05,chunk=16,min_numel=1,selection=current",
         "thc": "thc", "thc_simple": "thc:rotation=full,saturation=false",
         "powersgd_2": "powersgd:rank=2", "powersgd_4": "powersgd:rank=4"}
STEPS = 200


def worker():
    import horovod.torch as hvd
    import torch
    from tests.digits import train
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    losses, wire = {}, {}
    for label, spec in SPECS.items():
        comp = Compression.from_spec(spec)
        losses[label] = train(hvd, comp, STEPS)
        wire[label] = comp.bytes_per_step().total
    return {"losses": losses, "wire": wire}


def worker_fp16_large_and_tiny():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    r = hvd.rank()
    big = torch.full((32,), 1.0e4 + 100.0 * r)
    tiny = torch.full((32,), 1.0e-6 * (r + 1))
    out = {}
    for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        out[f"big_{op_name}"] = hvd.allreduce(big, name=f"big_{op_name}", op=op, compression=Compression.fp16()).numpy()
        out[f"tiny_{op_name}"] = hvd.allreduce(tiny, name=f"tiny_{op_name}", op=op, compression=Compression.fp16()).numpy()
    # Three steps with one compressor each: from the second on, fp16's agreed power-of-two
    # scale (cast.py, step 5; 8 ranks and more) keeps the tiny values normal, the big ones in range.
    for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        comp = Compression.fp16()
        for label, x in (("tiny", tiny), ("big", big)):
            out[f"{label}_{op_name}_steps"] = [
                hvd.allreduce(x, name=f"{label}_{op_name}_steps", op=op, compression=comp).numpy()
                for _ in range(3)]
        out[f"scale_{op_name}"] = {k: float(comp.codec.store.read(k).fp16_scale) for k in comp.codec.tensors.infos}
    # Horovod's own fp16 (no pre-scale) overflows on the same sum: why the pre-scale exists.
    out["horovod_big_sum"] = hvd.allreduce(big, name="hvd_big", op=hvd.Sum, compression=hvd.Compression.fp16).numpy()
    return out


@pytest.fixture(scope="module")
def trained():
    # 9 runs of 200 steps: 2.3 minutes measured alone on 2 cores, over 3 minutes (beyond the
    # default 180 s) while other launches share them.
    return run(worker, np=2, timeout=max(600.0, default_timeout()))


@pytest.fixture(scope="module")
def losses(trained):
    return [r["losses"] for r in trained]


def test_compressors_send_fewer_bytes_than_fp16(trained):
    wire = trained[0]["wire"]
    # fp16: 2,410 coordinates x 2 bytes. Only the 64x32 weight is large enough to compress.
    assert wire["fp16"] == 2 * 2410
    for label in ("topkc_ef", "topkc_default", "topkc_current", "thc", "thc_simple", "powersgd_2", "powersgd_4"):
        assert wire[label] < wire["fp16"], (label, wire)


def test_topkc_with_error_feedback_matches_fp16(losses):
    for r in losses:
        for label in ("topkc_ef", "topkc_default", "topkc_current"):
            assert r[label] <= 1.10 * r["fp16"] + 0.02, (label, r)
    assert losses[0] == losses[1]


def test_thc_matches_fp16(losses):
    for r in losses:
        for label in ("thc", "thc_simple"):
            assert r[label] <= 1.02 * r["fp16"] + 0.005, (label, r)


def test_powersgd_matches_fp16(losses):
    for r in losses:
        for label in ("powersgd_2", "powersgd_4"):
            assert r[label] <= 1.15 * r["fp16"], (label, r)


def test_topkc_without_error_feedback_is_worse(losses):
    for r in losses:
        assert r["topkc_no_ef"] >= r["topkc_ef"] + 0.05, r


def test_fp16_eight_ranks_no_overflow_tiny_values_kept():
    n = 8
    results = run(worker_fp16_large_and_tiny, np=n)
    big_sum = sum(1.0e4 + 100.0 * r for r in range(n))
    tiny_sum = sum(1.0e-6 * (r + 1) for r in range(n))
    # Bound for tiny values: each rank's x/n lands in fp16's subnormal range (spacing 2**-24),
    # so each contributes at most half a spacing of error, the fp16 sum adds up to n-1 more half
    # spacings, and the post-scale multiplies by n.
    tiny_bound = n * (2 * n - 1) * 2.0 ** -25
    for r in results:
        np.testing.assert_allclose(r["big_sum"], big_sum, rtol=2e-3)
        np.testing.assert_allclose(r["big_average"], big_sum / n, rtol=2e-3)
        assert np.all(np.abs(r["tiny_sum"] - tiny_sum) <= tiny_bound) and np.all(r["tiny_sum"] > 0)
        assert np.all(np.abs(r["tiny_average"] - tiny_sum / n) <= tiny_bound / n * 2)
        assert not np.isfinite(r["horovod_big_sum"]).all()
        for op_name, div in (("sum", 1), ("average", n)):
            tiny_steps, big_steps = r[f"tiny_{op_name}_steps"], r[f"big_{op_name}_steps"]
            np.testing.assert_array_equal(tiny_steps[0], r[f"tiny_{op_name}"])  # step 1: 1/n, as before
            for t in (1, 2):  # the agreed scale: relative error of float16 rounding, not the bound above
                np.testing.assert_allclose(tiny_steps[t], tiny_sum / div, rtol=2e-3)
                np.testing.assert_allclose(big_steps[t], big_sum / div, rtol=2e-3)
            assert r[f"scale_{op_name}"] == results[0][f"scale_{op_name}"]  # agreed on every rank
            assert all(s > 0 and np.log2(s).is_integer() for s in r[f"scale_{op_name}"].values())
