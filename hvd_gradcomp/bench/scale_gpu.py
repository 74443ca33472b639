"""The scale study's step parts scaled to a named GPU class (simulated, not measured on one).

The sweep (:mod:`.scale`) measures one rank's compute and codec on this machine's CPU. What a
GPU user wants is the same steps to target with a GPU's step; this module gives that step's two
measured-elsewhere parts, each from a stated source, kept apart from the CPU columns:

- **Compute** (one rank's forward + backward + optimizer step): the model's FLOPs per step at
  a stated model-FLOPs utilisation (MFU) of the class's dense BF16 peak, and never below a
  stated floor (a small transformer's step is kernel-launch bound on any GPU: the floor is an
  assumption, said so in the table). FLOPs per step (Kaplan et al. 2020, eq. 2.2, forward x 3
  for forward + backward): ``6 x params x tokens + 6 x layers x context x width x tokens``,
  ``tokens`` = per-rank batch x context; the embeddings are counted as matmul parameters (a
  small overcount: 8% of ``lm-comm``'s parameters).
- **Codec** (one rank's encode + decode): docs/gpu.md's measured milliseconds per million
  parameters on one H200 ("Codec per step on CUDA", model A: 9.61M parameters in 3 DDP
  buckets, our bucketed hook), times the model's parameters, times the ratio of the H200's
  memory bandwidth to the class's (the codecs are memory-bound at that size). The bucketed
  figures are the layout a GPU user runs (DDP buckets, Horovod groups); docs/gpu.md's
  per-tensor figures are 2-8x higher (launch-bound), so the per-tensor layout of the
  simulation would cost more on a GPU than this says.
"""
import inspect
from typing import NamedTuple

__all__ = ["GPUClass", "GPU_CLASSES", "CODEC_MS_PER_MPARAM_H200", "H200_HBM_TBS", "CODEC_SOURCE",
           "step_flops", "codec_ms_per_mparam", "gpu_parts", "model_shape"]


class GPUClass(NamedTuple):
    """A GPU class: ``name`` (as printed), ``bf16_tflops`` (dense BF16 tensor-core peak,
    TFLOP/s, the vendor's datasheet), ``hbm_tbs`` (memory bandwidth, TB/s, datasheet)."""

    name: str
    bf16_tflops: float
    hbm_tbs: float


GPU_CLASSES = {
    "h100-sxm": GPUClass("NVIDIA H100 SXM", 989.4, 3.35),
    "h200": GPUClass("NVIDIA H200", 989.4, 4.8),
}
H200_HBM_TBS = 4.8
# docs/gpu.md, "Codec per step on CUDA" (one H200, model A, our bucketed hook, "ms per M
# params"; bf16's own figure, -0.61 ms, is inside the +-1 ms noise: fp16's cast is used; our
# PowerSGD rank 4 bucketed: 235 ms per step / 9.61M parameters, from the text below the table)
CODEC_MS_PER_MPARAM_H200 = {"fp16": 0.07, "bf16": 0.07, "none": 0.0, "thc": 0.40, "topkc": 0.75,
                            "signsgd": 0.84, "powersgd": 235 / 9.61}
CODEC_SOURCE = ("docs/gpu.md's codec per step on one H200 (model A, 9.61M parameters, bucketed), "
                "per million parameters, scaled by the H200's memory bandwidth over the class's")


def model_shape(cls):
    """``{"context", "width", "layers"}`` of a transformer workload class (``lm``, ``lm-comm``,
    ``lm-shakespeare``): ``context`` is its constructor's default."""
    context = inspect.signature(cls.__init__).parameters["context"].default
    return {"context": int(context), "width": int(cls.width), "layers": int(cls.layers)}


def step_flops(params, batch_size, context, width, layers):
    """FLOPs of one rank's forward + backward on ``batch_size`` windows of ``context`` tokens
    (module docstring): an int."""
    tokens = batch_size * context
    return 6 * params * tokens + 6 * layers * context * width * tokens


def codec_ms_per_mparam(spec):
    """The H200's codec milliseconds per million parameters of ``spec``'s scheme (its name
    before ``:``; THC's variants take THC's figure). Raises KeyError for a scheme not measured."""
    scheme = spec.split(" ")[0].split(":")[0]
    if scheme not in CODEC_MS_PER_MPARAM_H200:
        raise KeyError(f"scale_gpu: no GPU codec figure for {spec!r} (docs/gpu.md measured "
                       f"{sorted(CODEC_MS_PER_MPARAM_H200)})")
    return CODEC_MS_PER_MPARAM_H200[scheme]


def gpu_parts(results, gpu, params, flops, mfu=0.4, floor_s=1e-3):
    """``{(n, spec): {"compute_s", "codec_s"}}`` on ``gpu`` (a :class:`GPUClass`) for every run
    of ``results`` (``{n: {spec: result}}``): compute = max(``flops`` / (peak x ``mfu``),
    ``floor_s``), the same for every row and N (the per-rank batch is fixed); codec =
    :func:`codec_ms_per_mparam` x ``params`` / 1e6 x (H200 bandwidth / the class's). Rows
    whose scheme has no GPU figure are left out.

    Raises:
        ValueError: ``mfu`` not in (0, 1], a negative floor, or no parameters.
    """
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"scale_gpu: mfu must be in (0, 1], got {mfu!r}")
    if floor_s < 0 or params <= 0:
        raise ValueError(f"scale_gpu: need floor_s >= 0 and params > 0, got {floor_s!r}, {params!r}")
    compute = max(flops / (gpu.bf16_tflops * 1e12 * mfu), floor_s)
    out = {}
    for n, rows in results.items():
        for spec in rows:
            try:
                per = codec_ms_per_mparam(spec)
            except KeyError:
                continue
            out[(n, spec)] = {"compute_s": compute,
                              "codec_s": per * 1e-3 * params / 1e6 * H200_HBM_TBS / gpu.hbm_tbs}
    return out
