"""The compressors through Horovod's NCCL all-reduce on CUDA tensors (issue 26): one launch of
one rank per GPU (at most 2), skipped with the reason where there is no GPU or Horovod has no
NCCL. Run by the GPU check (tests/gpu/gpu_check.py, step 6) on a GPU machine.

Per rank, gradients ~ N(0, 1e-4^2) (the case where a double 1/n flushed float16 payloads to
zero) go through ``hvd.allreduce(op=Average)`` with each compressor for three steps:

- the adapter marks the tensor for NCCL's Average (``TensorInfo.nccl_avg``) where Horovod has
  NCCL >= 2.10 and more than one rank takes part, and not on the CPU;
- every rank receives the same output, on its GPU, finite;
- fp16's average is within 3x the error of Horovod's own ``Compression.fp16`` on the same
  gradients (float64 mean as reference); the other schemes' outputs equal what the same
  compressor gives for the same gradients on the CPU (Gloo) to float32 rounding (THC: to its
  stochastic rounding's edge cases).
"""
import numpy as np
import pytest

from tests.hvdrun import run

SPECS = ["fp16", "topkc:ratio=0.25,chunk=64", "thc", "powersgd:rank=2"]
SHAPE = (256, 64)
STEPS = 3


def _gpus():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _grads(rank, step):
    return np.random.default_rng(1000 * rank + step).normal(0.0, 1e-4, SHAPE)


def _worker():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    out = {"nccl": int(hvd.nccl_built()), "size": hvd.size(), "rank": hvd.rank()}
    for device in ("cuda", "cpu"):
        for spec in SPECS:
            comp = Compression.from_spec(spec)
            results = []
            for step in range(STEPS):
                x = torch.tensor(_grads(hvd.rank(), step), dtype=torch.float32, device=device)
                y = hvd.allreduce(x, op=hvd.Average, name=f"gpu.{spec}", compression=comp)
                assert y.device.type == device, (spec, y.device)
                results.append(y.double().cpu().numpy())
            info = comp.codec.tensors.infos[f"gpu.{spec}"]
            out[(device, spec)] = (results, bool(info.nccl_avg))
    own = []
    for step in range(STEPS):
        x = torch.tensor(_grads(hvd.rank(), step), dtype=torch.float32, device="cuda")
        own.append(hvd.allreduce(x, op=hvd.Average, name="gpu.own", compression=hvd.Compression.fp16)
                   .double().cpu().numpy())
    out["own"] = own
    hvd.shutdown()
    return out


def test_compressors_on_nccl():
    gpus = _gpus()
    if gpus == 0:
        pytest.skip("no CUDA device (torch.cuda.is_available() is False); run on a GPU machine")
    hvd_probe = pytest.importorskip("horovod.torch", reason="Horovod cannot be imported here; the GPU "
                                    "check builds it from a local sdist (HVD_GRADCOMP_HOROVOD_SDIST)")
    if not hvd_probe.nccl_built():
        pytest.skip("Horovod built without NCCL (hvd.nccl_built() == 0); `make setup` on this "
                    "machine builds it with HOROVOD_GPU_OPERATIONS=NCCL")
    n = min(2, gpus)
    ranks = run(_worker, np=n, timeout=600)
    assert [r["rank"] for r in ranks] == list(range(n))
    for step in range(STEPS):
        ref = np.mean([_grads(r, step) for r in range(n)], 0)
        own = np.linalg.norm(ranks[0]["own"][step] - ref) / np.linalg.norm(ref)
        for spec in SPECS:
            gpu, marked = ranks[0][("cuda", spec)]
            cpu, marked_cpu = ranks[0][("cpu", spec)]
            assert marked == (n > 1 and ranks[0]["nccl"] >= 21000) and not marked_cpu, spec
            for r in ranks[1:]:
                np.testing.assert_array_equal(r[("cuda", spec)][0][step], gpu[step])
            assert np.all(np.isfinite(gpu[step])), spec
            if spec == "fp16":
                err = np.linalg.norm(gpu[step] - ref) / np.linalg.norm(ref)
                assert err <= 3 * max(own, 1e-4), (step, err, own)
            else:
                tol = 1e-2 if spec == "thc" else 1e-4
                diff = np.linalg.norm(gpu[step] - cpu[step])
                assert diff <= tol * np.linalg.norm(cpu[step]) + 1e-12, (spec, step, diff)
