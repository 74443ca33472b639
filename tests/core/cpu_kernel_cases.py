"""(Helper, not a test.) The THC cases of the compiled CPU fused forms' tests
(tests/core/test_cpu_kernels.py, test_cpu_kernels_schemes.py): a tensor's scheme, layout and
plan, one rank's inputs, the fused form ops.fuse would run, the noise bits, the configurations
and sizes checked, the per-block tolerance, non-finite inputs.
"""
import os

import torch

from hvd_gradcomp import hadamard, thc_kernels as K
from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.thc import THCConfig, THCScheme
from torch_backend import kernels
from torch_backend.ops import REFERENCE_OPS

__all__ = ["R", "ROOT", "CONFIGS", "SIZES", "thc_setup", "thc_inputs", "fused_form_of", "noise_bits",
           "block_tol", "with_nonfinite"]

R = REFERENCE_OPS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def thc_setup(d, n=4, op="average", seed=0, **config):
    """(scheme, info, layout, plan) for a THC tensor of ``d`` coordinates."""
    scheme = THCScheme(THCConfig(**config))
    info = TensorInfo("t", (d,), "float32", n, 0, op)
    lay = scheme.layout(info)
    return scheme, info, lay, scheme._plan(info, lay)


def thc_inputs(scheme, info, lay, seed=0, scale=1.0):
    """x [d], residual [P], diag [P], hmat, ranges [nb] (a zero block first), for one rank."""
    gen = torch.Generator().manual_seed(seed)
    d = info.numel
    x = torch.randn(d, generator=gen) * scale
    x[: d // 7] *= 20.0  # blocks of different scales
    residual = (torch.randn(lay.padded, generator=gen) * 0.3 * scale if scheme.config.error_feedback
                else torch.zeros(0))
    state = scheme.init(R, info, x)
    hmat = hadamard.sylvester(R, max(hadamard.factor_sizes(lay.block)), x)
    ranges = torch.rand(lay.blocks, generator=gen) * 4.0 * scale
    if lay.blocks > 1:
        ranges[0] = 0.0  # a block without a range (sends level 0)
    return x, residual, state.diag, hmat, ranges


def fused_form_of(fn, plan):
    """The fused form that ops.fuse would run for ``plan``, or None (then the plan must be one
    the provider declines: a block of one coordinate)."""
    form = kernels.fused_form(fn, plan, "cpu")
    assert form is not None or plan.block < 2, plan
    return form


def noise_bits(lay, key):
    return K._noise_bits(R, key, lay.blocks, lay.block, torch.zeros(1))


CONFIGS = [
    {},  # the default: B = 1024, saturation, flush 1, error feedback
    {"flush": None},
    {"error_feedback": False},
    {"saturation": False},
    {"range": "current"},
    {"rotation_stages": 1},
    {"rotation_stages": 4, "flush": 0.5},
    {"rotation_stages": 7, "bits": 2},
    {"rotation": "full"},
    {"lane_bits": None, "bits": 8},
    {"lane_bits": 16},
]
SIZES = [1, 37, 1024, 3000]


def block_tol(y_ref, block, factor=1e-5):
    """Per-coordinate tolerance: ``factor`` times the peak of the coordinate's block."""
    peak = y_ref.abs().reshape(-1, block).amax(1, keepdim=True)
    return (peak * factor).expand(-1, block).reshape(-1)


def with_nonfinite(x, kind):
    """A copy of ``x`` (at least 2050 values) with a NaN, an inf, an inf/-inf pair, or a pair
    whose rotation overflows float32 ([3e38, -3e38])."""
    x = x.clone()
    if kind == "nan":
        x[1500] = float("nan")
    elif kind == "inf":
        x[10] = float("inf")
    elif kind == "pair":
        x[10], x[11] = float("inf"), -float("inf")
    else:
        assert kind == "overflow", kind
        x[2048], x[2049] = 3e38, -3e38
    return x
