"""(Helper, not a test.) Whole schemes through the Triton forms (:mod:`tests.core.triton_checks`
runs these with the kernel checks): THC, TopKC and signSGD steps through ``one_rank(OPS)``, where
``ops.fuse`` picks the Triton forms, against ``one_rank(REFERENCE_OPS)`` (:func:`check_schemes`);
plans outside the forms' reach keep the reference (:func:`check_refusals`).
"""
import warnings

import torch

from hvd_gradcomp import thc_kernels, topkc
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import one_rank
from hvd_gradcomp.thc import THCConfig, THCScheme
from tests.core.triton_compare import TOL, close_in_groups, close_relative, equal_values, same_structure
from torch_backend import kernels
from torch_backend.ops import OPS, REFERENCE_OPS

__all__ = ["SCHEMES", "STEPS", "check_schemes", "check_refusals"]


SCHEMES = [
    # (spec, world size, op): compress / decompress / finish for STEPS steps
    ("thc", 1, "average"),
    ("thc:flush=none,saturation=false", 4, "sum"),
    ("thc:error_feedback=false", 2, None),
    ("thc:range=current", 2, "sum"),  # rotate, noise and quantise apart, around the side all-reduce
    ("topkc:ratio=0.2,chunk=128", 1, "average"),
    ("topkc:ratio=0.3,chunk=100,residual_decay=0.9", 2, "sum"),
    ("topkc:ratio=0.2,selection=current,chunk=64", 1, "average"),
    ("signsgd", 2, "average"),
    ("signsgd:block=100", 3, None),
]
STEPS = 3


def _scheme_inputs(device, d=2999, seed=3):
    """The gradients of :func:`_scheme_run`'s steps: float32 [d] each, every 7th 10x larger."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(d, generator=g) * (1.0 + 9.0 * (torch.arange(d) % 7 == 0))).to(device) for _ in range(STEPS)]


def _scheme_run(ops, spec, n, op, device, d=2999, seed=3):
    from hvd_gradcomp.registry import make_scheme, parse_spec
    name, options = parse_spec(spec)
    scheme = make_scheme(name, **options)
    info = TensorInfo(f"triton.{spec}", (d,), "float32", n, 0, op)
    xs = _scheme_inputs(device, d, seed)
    state = scheme.init(ops, info, xs[0])
    steps = []
    for x in xs:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        out, state = finish_tensor(scheme, ops, payload, ctx, state, info)
        steps.append((payload, out))
    return steps, state


def check_schemes(device):
    """Whole schemes through ``one_rank(OPS)`` (the Triton forms) against
    ``one_rank(REFERENCE_OPS)``: payloads equal (THC: level words equal except where a float32
    rounding of the rotation moves a floor, at most 1 in 1000), outputs and state within TOL
    relative to their norms (THC: 1e-4 when a level moved), and every Triton form chosen. A
    float state field (a residual) is held to TOL of the larger of its own norm and the last
    gradient's: its error is the rotation's, whose float32 sums in another order (``tl.dot``
    against the reference's product) err relative to the rotated block, of the gradient's size,
    while the residual itself may be a small fraction of it (on an H200: 1.3e-6 of the residual's
    norm, THC with flush=none, saturation=false, 4 ranks)."""
    problems = []
    kernels._CHOSEN.clear()
    for spec, n, op in SCHEMES:
        with warnings.catch_warnings():
            # a fused form that fails falls back to the reference with this warning: an error here
            warnings.filterwarnings("error", "hvd_gradcomp: the fused form", RuntimeWarning)
            got, got_state = _scheme_run(one_rank(OPS), spec, n, op, device)
        want, want_state = _scheme_run(one_rank(REFERENCE_OPS), spec, n, op, device)
        tol = TOL
        for step, ((p, out), (p_ref, out_ref)) in enumerate(zip(got, want)):
            tag = f"{spec} n={n} op={op} step {step}"
            problems += same_structure(tag, (p, out), (p_ref, out_ref))
            if p.dtype == torch.int32:
                moved = int((p != p_ref).sum())
                if moved > max(1, p.numel() // 1000):
                    problems.append(f"{tag}: {moved} of {p.numel()} payload words differ")
                tol = tol if moved == 0 else 1e-4
            else:
                problems += close_in_groups(f"{tag}: payload", p.float(), p_ref.float(), p.numel())
            problems += close_relative(f"{tag}: output", out, out_ref, tol)
        grad_norm = float(_scheme_inputs("cpu")[-1].double().norm())
        for field, a, b in zip(want_state._fields, got_state, want_state):
            if a.is_floating_point():
                problems += close_relative(f"{spec}: state {field}", a, b, tol, at_least=grad_norm)
            else:
                problems += equal_values(f"{spec}: state {field}", a, b)
    chosen = {getattr(form, "__name__", None) for form in kernels._CHOSEN.values() if form is not None}
    # (a compress with agreed ranges is one encode call; range="current" runs the three apart)
    for name in ("encode", "rotate", "noise", "quantize", "decode", "receive", "finish", "correct"):
        if name not in chosen:
            problems.append(f"ops.fuse never ran the Triton form {name} (chosen: {sorted(chosen)})")
    return problems



def check_refusals(device):
    """Plans outside the forms' reach keep the reference: THC's full rotation and other
    rotation stages (blocks other than 1024), TopKC's chunks above ``MAX_CHUNK``; and such a
    plan's scheme runs the reference through ``ops.fuse``, equal to it bit for bit."""
    from torch_backend.kernels import triton_topkc
    problems = []
    for spec_kwargs in ({"rotation": "full"}, {"rotation_stages": 9}, {"rotation_stages": 11}):
        scheme = THCScheme(THCConfig(**spec_kwargs))
        info = TensorInfo("triton.refused", (3000,), "float32", 2, 0, "sum")
        plan = scheme._plan(info, scheme.layout(info))
        for fn in (thc_kernels._rotate_kernel, thc_kernels._quantize_kernel, thc_kernels._decode_kernel):
            if kernels.fused_form(fn, plan, "cuda") is not None:
                problems.append(f"thc {spec_kwargs}: a fused form of {fn.__name__} for block {plan.block}")
    from hvd_gradcomp.signsgd_kernels import _encode_kernel as signsgd_encode
    from hvd_gradcomp.registry import make_scheme
    from torch_backend.kernels import triton_signsgd
    scheme = make_scheme("signsgd", block=None)
    info = TensorInfo("triton.refused", (triton_signsgd.MAX_BLOCK + 1,), "float32", 2, 0, "sum")
    if kernels.fused_form(signsgd_encode, scheme._plan(info, scheme.layout(info)), "cuda") is not None:
        problems.append(f"signsgd: a fused form for a block of {triton_signsgd.MAX_BLOCK + 1}")
    big = (triton_topkc.MAX_CHUNK + 1, True, False, 1.0)
    if kernels.fused_form(topkc._correct_kernel, big, "cuda") is not None:
        problems.append(f"topkc: a fused form for chunk {big[0]}")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "hvd_gradcomp: the fused form", RuntimeWarning)
        got, _ = _scheme_run(one_rank(OPS), "thc:rotation_stages=9", 2, "sum", device)
    want, _ = _scheme_run(one_rank(REFERENCE_OPS), "thc:rotation_stages=9", 2, "sum", device)
    for step, ((p, out), (p_ref, out_ref)) in enumerate(zip(got, want)):
        problems += equal_values(f"thc:rotation_stages=9 step {step}: payload", p, p_ref)
        problems += equal_values(f"thc:rotation_stages=9 step {step}: output", out, out_ref)
    return problems
