"""(Helper, not a test.) The launch-saving Triton forms against the per-step forms they replace,
bit for bit, and their launches counted: ``python -m tests.core.triton_fused_checks`` under
``TRITON_INTERPRET=1 HVD_GRADCOMP_KERNELS=triton`` prints one JSON line {check: [problems]}
(run by ``tests/core/test_triton_launches.py``; on CUDA, call :func:`run_all` with "cuda").

- ``encode``: :func:`torch_backend.kernels.triton_thc_fused.encode` (two launches) against
  :func:`torch_backend.kernels.triton_thc.encode` (the rotation, statistics, noise, quantise and
  tail forms in turn: five launches): every output equal bit for bit (a non-finite step: the
  statistics and control words, the level words being undefined in both), and its quantiser
  against the reference composition's given the same rotation (``_noise_kernel`` then
  ``_quantize_kernel`` on the forms' ``y``): payload, residual and saturation count bit for bit;
  the ticket zero again after every launch.
- ``bucket``: a bucket of several THC members through the codec (``plan_bucket``, one unit,
  ``encode_unit``) on the Triton forms equals the same unit's encode by the per-step forms bit
  for bit, and its Triton launches per step (encode, receive, decode, finish) are the same for
  2 and 16 members;
- ``scatter``: TopKC's decode in two launches (:func:`torch_backend.kernels.triton_topkc.scatter`)
  against ``_scatter_kernel``'s composition, bit for bit.
"""
import json
import os
import sys
import warnings

import torch

from hvd_gradcomp import thc_kernels
from tests.core.triton_checks import R, _thc, rng_key
from tests.core.triton_compare import equal_values, randn_on, same_structure, seeded

__all__ = ["ENCODE_CASES", "SCATTER_CASES", "check_encode", "check_bucket", "check_scatter", "run_all"]

ENCODE_CASES = [
    # (d, n, op, ef, flush, saturation, finite, nonfinite[, own])
    (3000, 2, "sum", True, 1.0, True, None, None),
    (2999, 8, "average", True, 1.0, True, None, None),
    (3073, 3, None, True, 1.0, False, None, None),
    (3001, 4, "average", False, None, True, True, None),
    (70000, 2, "average", True, 0.5, True, None, None),  # 69 blocks, 300 programs: several loop steps
    (2500, 3, "average", True, 1.0, True, True, "nan"),
    (3100, 2, "sum", True, None, True, None, "overflow"),
    # subtract_own (the trailing own): lanes for the other ranks, no offset
    (3000, 2, "average", False, None, True, None, None, True),
    (3073, 3, "sum", True, 1.0, True, None, None, True),
]


def check_encode(device, d, n, op, ef, flush, saturation, finite, nonfinite, own=False, seed=0):
    """The two-launch encode against the five-launch one and the reference's quantiser
    (module docstring); ``own``: ``subtract_own``'s lanes."""
    from hvd_gradcomp import hadamard
    from torch_backend import kernels
    from torch_backend.kernels import triton_thc, triton_thc_fused
    scheme, info, lay, plan = _thc(n, op, ef, flush, saturation, d, own)
    tag = (f"encode d={d} n={n} op={op} ef={ef} flush={flush} sat={saturation} finite={finite} own={own} "
           f"{nonfinite or ''}")
    form = kernels.fused_form(thc_kernels._encode_kernel, plan, "cuda")
    if form is not triton_thc_fused.encode:
        return [f"{tag}: the registry gives {form}, not triton_thc_fused.encode"]
    g, dev = seeded(seed, device)
    x = randn_on(g, d, dev, 3.0)
    x[: d // 3] *= 50.0
    state = scheme.init(R, info, x)
    if nonfinite == "nan":
        x[d // 2] = float("nan")
    if nonfinite == "overflow":
        x[:1024] = torch.where(state.diag[:1024] > 0, 3e38, -3e38)
    residual = randn_on(g, lay.padded, dev, 2.0) if ef else state.residual
    if ef:
        residual[lay.padded - 1024:] *= 1e3
    hmat = hadamard.sylvester(R, 32, x)
    flag = None if finite is None else torch.tensor(nonfinite is None, device=dev)
    problems = []
    for step in range(2):
        y0, _, wanted, _, _ = triton_thc.rotate(plan, x, residual, state.diag, hmat, flag)
        ranges = torch.where(torch.isfinite(wanted), wanted, 1.0) * 0.8
        ranges[0] = 0.0
        key = torch.tensor(rng_key(seed, step), dtype=torch.int64, device=dev)
        fingerprint = torch.tensor(5 + step, dtype=torch.int64, device=dev)
        got = form(plan, x, residual, state.diag, hmat, ranges, key, fingerprint, flag)
        want = triton_thc.encode(plan, x, residual, state.diag, hmat, ranges, key, fingerprint, flag)
        problems += same_structure(f"{tag}: [{step}]", got, want)
        if problems:
            return problems
        ticket = triton_thc_fused.ticket(x.device)
        if int(ticket[0]) != 0:
            problems.append(f"{tag}: [{step}] the ticket is {int(ticket[0])} after the launch, not 0")
        if nonfinite:  # levels undefined: the statistics and control words
            problems += equal_values(f"{tag}: [{step}] tail", got[0][lay.words:], want[0][lay.words:])
            if int(got[0][-3]) == 0:
                problems.append(f"{tag}: [{step}] the not-finite word is 0")
            continue
        for name, a, b in zip(("payload", "residual", "y", "held", "saturated"), got, want):
            problems += equal_values(f"{tag}: [{step}] {name}", a, b)
        # the reference's noise and quantiser on the forms' own rotation
        rows, cols = thc_kernels._noise_kernel(R, plan, key, ranges)
        _, held, _, stats, ok = triton_thc.rotate(plan, x, residual, state.diag, hmat, flag)
        ref = thc_kernels._quantize_kernel(R, plan, y0, held, ranges, rows, cols, fingerprint, ok, stats)
        for name, a, b in zip(("payload", "residual", "saturated"), (got[0], got[1], got[4]), ref):
            problems += equal_values(f"{tag}: [{step}] {name} against the reference quantiser", a, b)
        if int(ref[2]) == 0:
            problems.append(f"{tag}: nothing saturated (the case tests no clipping)")
    return problems


def _bucket_step(members, grads, forms_of):
    """One THC bucket through a codec on one rank: ``(payload, triton launches by kernel)``
    of the last of ``len(grads)`` steps (``forms_of``: "fused" or "steps", which encode form)."""
    from hvd_gradcomp.base import finish_tensor
    from torch_backend import Compression
    from torch_backend.kernels import triton_thc
    from tests.core.launch_counts import _Engine, counting
    comp = Compression.from_spec("thc")
    comp.codec.bind_engine(_Engine())
    codec = comp.codec
    plan = codec.plan_bucket(members, "float32", "sum", None, grads[0])
    unit, = plan.units
    payload, launches = None, None
    for i, g in enumerate(grads):
        last = i == len(grads) - 1
        with counting() as (launched, _):
            if forms_of == "steps":  # the per-step forms: the encode form swapped for this call
                from torch_backend.kernels import forms
                entry = forms._FORMS[(thc_kernels._encode_kernel, "cuda")]
                saved = list(entry)
                entry[:] = [(a, triton_thc.encode, "triton_thc.encode") for a, _, _ in saved]
                try:
                    payload, ctx = codec.encode_unit(unit, g)
                finally:
                    entry[:] = saved
            else:
                payload, ctx = codec.encode_unit(unit, g)
            codec.decode(payload.clone(), ctx, divide=1)
        if last:
            launches = dict(launched)
    return payload, launches


def check_bucket(device, seed=0):
    """A multi-member bucket in one unit: the fused encode equals the per-step forms' encode bit
    for bit at every step, and the launches per step do not grow with the members."""
    from hvd_gradcomp.buckets import Member
    from torch_backend.kernels import _CHOSEN
    problems, counts = [], {}
    g, dev = seeded(seed, device)
    for k in (2, 16):
        sizes = [1500 + 37 * i for i in range(k)]
        members, at = [], 0
        for i, s in enumerate(sizes):
            members.append(Member(f"w{i}", f"w{i}", (s,), at, s))
            at += s
        grads = [randn_on(g, at, dev, 1e-2) for _ in range(3)]
        _CHOSEN.clear()  # the registry's choice made afresh for each form (forms_of swaps it)
        fused, launches = _bucket_step(members, grads, "fused")
        _CHOSEN.clear()
        steps, _ = _bucket_step(members, grads, "steps")
        _CHOSEN.clear()
        problems += equal_values(f"bucket k={k}: payload", fused, steps)
        counts[k] = launches
    if counts[2] != counts[16]:
        problems.append(f"bucket: Triton launches per step {counts[2]} for 2 members, {counts[16]} for 16")
    encode = sum(v for name, v in counts[2].items() if name in ("_rotate", "_words", "_scales", "_noise",
                                                                  "_quantize", "_tail"))
    if encode != 2:
        problems.append(f"bucket: {encode} Triton launches for the encode ({counts[2]}), not 2")
    return problems


SCATTER_CASES = [
    # (d, chunk, k, payload dtype, split: None, False or True, a NaN in the payload)
    (3000, 256, 4, "float16", False, False),
    (3000, 256, 12, "bfloat16", None, True),
    (1001, 100, 3, "float32", True, True),
    (777, 64, 13, "float16", None, False),
]


def check_scatter(device, d, chunk, k, dtype, split, nan, seed=0):
    """TopKC's decode in two launches (``triton_topkc.scatter``) against ``_scatter_kernel``'s
    composition, bit for bit: chunks in a shuffled order, the last one padded, a split vote
    (times 0, NaN kept), a NaN from a failed rank."""
    from hvd_gradcomp import topkc_kernels
    from torch_backend import kernels
    from torch_backend.kernels import triton_topkc
    plan = (chunk, d, 0.125, dtype)
    form = kernels.fused_form(topkc_kernels._scatter_kernel, plan, "cuda")
    tag = f"scatter d={d} chunk={chunk} k={k} {dtype} split={split} nan={nan}"
    if form is not triton_topkc.scatter:
        return [f"{tag}: the registry gives {form}, not triton_topkc.scatter"]
    g, dev = seeded(seed, device)
    m = -(-d // chunk)
    idx = torch.randperm(m - 1, generator=g)[:k - 1].tolist()  # distinct, below the last
    idx = torch.tensor(idx + [m - 1], dtype=torch.int64, device=dev)  # the padded chunk too
    payload = randn_on(g, k * chunk + m + 16, dev, 100.0).to(getattr(torch, dtype))
    if nan:
        payload[chunk + 3] = float("nan")
    extra = () if split is None else (torch.tensor(split, device=dev),)
    got = form(plan, payload, idx, *extra)
    want = topkc_kernels._scatter_kernel(R, plan, payload, idx, *extra)
    problems = same_structure(tag, got, want)
    return problems or equal_values(tag, got, want)


def run_all(device):
    """{check name: [problems]} for every check on ``device``."""
    checks = ([(f"encode{case!r}", check_encode, case) for case in ENCODE_CASES] + [("bucket", check_bucket, ())]
              + [(f"scatter{case!r}", check_scatter, case) for case in SCATTER_CASES])
    results = {}
    for name, check, args in checks:
        try:
            results[name] = check(device, *args)
        except Exception as exc:  # noqa: BLE001 - one failing check reports, the others still run
            results[name] = [f"{name}: raised {type(exc).__name__}: {exc}"]
    return results


def check_names():
    return ([f"encode{case!r}" for case in ENCODE_CASES] + ["bucket"]
            + [f"scatter{case!r}" for case in SCATTER_CASES])


if __name__ == "__main__":
    warnings.filterwarnings("ignore", "(invalid value|overflow) encountered", RuntimeWarning)  # numpy
    from torch_backend import kernels as _kernels
    if os.environ.get("TRITON_INTERPRET") != "1" or _kernels.mode() != "triton":
        sys.exit("run with TRITON_INTERPRET=1 HVD_GRADCOMP_KERNELS=triton")
    torch.set_num_threads(1)
    print(json.dumps(run_all("cpu")))
