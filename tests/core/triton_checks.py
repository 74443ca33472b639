"""(Helper, not a test.) The Triton fused forms of :mod:`torch_backend.kernels.triton_thc`,
:mod:`torch_backend.kernels.triton_topkc`, ``triton_powersgd`` and ``triton_signsgd`` against
the core's reference compositions, on one device: the checks of
``tests/core/test_triton_kernels.py`` (CPU tensors in Triton's interpreter, run in a
subprocess: ``python -m tests.core.triton_checks`` with ``TRITON_INTERPRET=1``, printing one
JSON line) and of ``tests/core/test_devices.py`` (CUDA).

Each check returns a list of problems (strings; empty when the fused form agrees). What
"agrees" means (the contract of :mod:`torch_backend.kernels`, tolerances of the providers'
docstrings):

- structure, shapes, dtypes and devices of the outputs are the reference's;
- integer outputs (THC's payload, statistics and saturation count) and the quantiser's residual
  are equal bit for bit given equal inputs; TopKC's ``c`` too; every signSGD output (``p``, the
  sign and control words, the receive, the decoded values, the residual) but a scale's log code,
  which may move by one where ``4 log2 s`` sits at a rounding boundary;
- float outputs behind a Walsh-Hadamard product or a norm (THC's ``y``, held residual, ranges,
  decoded output; TopKC's scores) are within ``TOL = 2**-20`` of the reference, relative to the
  Euclidean norm of the reference's block (1024 coordinates; a chunk's score, relative to
  itself), THC's block ranges within ``TOL_RANGE = 2**-17`` of themselves, with NaN and inf
  where the reference has them;
- a non-finite gradient: the same finite flag, statistics and control words; THC's rotation
  agrees within the tolerance in every block that the reference computes finite, and is
  non-finite (NaN or inf: which one, and where within the block, follows the order in which
  the CPU's vector units or the GPU add up an overflowing block) in every block where the
  reference is not. That is all a non-finite step reads: its blocks' ranges enter the range
  all-reduce only where finite, the level words are undefined in both and unread, and every
  rank decodes NaN from the control word. The same checks pass whatever the dot products'
  kernel (``python -m tests.core.triton_checks nonfinite`` under several ``OPENBLAS_CORETYPE``
  values: test_triton_kernels.py).

``ops.fuse`` must pick the Triton forms (``HVD_GRADCOMP_KERNELS=triton`` on CPU tensors, the
default on CUDA): :func:`check_schemes` runs whole schemes through ``one_rank(OPS)`` against
``one_rank(REFERENCE_OPS)`` with any fallback warning raised as an error.

The comparisons are in :mod:`tests.core.triton_compare`, PowerSGD's checks in
:mod:`tests.core.triton_powersgd_checks`, the whole-scheme checks in
:mod:`tests.core.triton_scheme_checks`, the ahead-of-time compile for sm_90 in
:mod:`tests.core.triton_aot`; this module holds the kernels' checks, runs them all
(:func:`run_all`, the names ``tests/core/test_devices.py`` calls included) and is the
subprocess's entry point.
"""
import json
import os
import sys
import warnings

import torch

from hvd_gradcomp import hadamard, thc_kernels, topkc
from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.thc import THCConfig, THCScheme
from tests.core.triton_aot import aot_all
from tests.core.triton_compare import (BLOCK, TOL_RANGE, close_in_groups, close_nonfinite,
                                       equal_values, randn_on, same_structure, seeded)
from tests.core.triton_powersgd_checks import (POWERSGD_BATCHED_CASES, POWERSGD_CASES, check_powersgd,
                                               check_powersgd_agree, check_powersgd_batched,
                                               check_powersgd_batched_scheme)
from tests.core.triton_scheme_checks import check_refusals, check_schemes
from torch_backend import kernels
from torch_backend.ops import REFERENCE_OPS

R = REFERENCE_OPS


# ---- THC ----
def _thc(n, op, ef, flush, saturation, d, own=False):
    cfg = THCConfig(error_feedback=ef, flush=flush, saturation=saturation, subtract_own=own)
    scheme = THCScheme(cfg)
    info = TensorInfo("triton.thc", (d,), "float32", n, 0, op)
    lay = scheme.layout(info)
    return scheme, info, lay, scheme._plan(info, lay)


def _forms(plan):
    """The Triton forms that the registry gives for ``plan`` (on "cuda", the provider key):
    rotate, quantize, decode, noise, receive, finish."""
    from torch_backend.kernels import triton_thc, triton_thc_words
    got = [kernels.fused_form(fn, plan, "cuda")
           for fn in (thc_kernels._rotate_kernel, thc_kernels._quantize_kernel, thc_kernels._decode_kernel,
                      thc_kernels._noise_kernel, thc_kernels._receive_kernel, thc_kernels._finish_kernel)]
    want = [triton_thc.rotate, triton_thc.quantize, triton_thc.decode, triton_thc_words.noise,
            triton_thc_words.receive, triton_thc_words.finish]
    if got != want:
        raise AssertionError(f"the registry gives {got} for THC's default plan, not {want}")
    return got


def check_thc(device, d, n, op, ef=True, flush=1.0, saturation=True, nonfinite=None, seed=0, own=False):
    """THC's three kernels at one configuration (module docstring).

    ``nonfinite``: None; ``"nan"`` (a NaN in ``x``, ``finite`` false); ``"overflow"`` (finite
    ``x`` whose rotation overflows float32, ``finite`` true on entry); ``"rank"`` (one rank of
    the all-reduce not finite: the decoder's NaN); ``"mismatch"`` (ranks' fingerprints differ:
    the decoder's 0). ``own``: ``subtract_own`` (lanes for the other ranks; the int32 sum
    wraps; rank 0 decodes with its own words)."""
    scheme, info, lay, plan = _thc(n, op, ef, flush, saturation, d, own)
    rotate, quantize, decode, noise, receive, finish = _forms(plan)
    g, dev = seeded(seed, device)
    x = randn_on(g, d, dev, 3.0)
    x[: d // 3] *= 50.0  # blocks of different scales
    finite = torch.tensor(True, device=dev)
    if nonfinite == "nan":
        x[d // 2] = float("nan")
        finite = torch.tensor(False, device=dev)
    state = scheme.init(R, info, x)
    if nonfinite == "overflow":  # x * diag all +3e38 / 32 in block 0: its rotation overflows
        x[:BLOCK] = torch.where(state.diag[:BLOCK] > 0, 3e38, -3e38)
    residual = randn_on(g, lay.padded, dev, 2.0) if ef else state.residual
    if ef:
        residual[lay.padded - BLOCK:] *= 1e3  # a block whose residual the flush bound clips
    hmat = hadamard.sylvester(R, 32, x)
    tag = f"thc d={d} n={n} op={op} ef={ef} flush={flush} sat={saturation} {nonfinite or ''}".strip()
    problems = []

    strided = torch.stack([x, -x], 1)[:, 0]  # x as a non-contiguous view: the form copies it
    got = rotate(plan, strided, residual, state.diag, hmat, finite)
    want = thc_kernels._rotate_kernel(R, plan, x, residual, state.diag, hmat, finite)
    problems += same_structure(f"{tag}: rotate", got, want)
    if problems:
        return problems
    close = close_nonfinite if not bool(want[4]) else close_in_groups
    for name, a, b in zip(("y", "held", "wanted"), got, want):
        if name == "wanted":
            problems += close(f"{tag}: rotate {name}", a, b, 1, TOL_RANGE)
        else:
            problems += close(f"{tag}: rotate {name}", a, b)
    problems += equal_values(f"{tag}: rotate stats", got[3], want[3])
    problems += equal_values(f"{tag}: rotate finite", got[4], want[4])
    if nonfinite in ("nan", "overflow") and bool(want[4]):
        problems.append(f"{tag}: the reference found the gradient finite (the case tests nothing)")

    # Quantise and pack the reference's rotation with ranges near the blocks' own: some clipped.
    y, held, wanted, stats, finite = want
    ranges = torch.where(torch.isfinite(wanted), wanted, 1.0) * 0.8
    ranges[0] = 0.0  # a block without a range
    payloads = []
    for rank in range(max(n, 1)):
        key = torch.tensor(rng_key(seed, rank), dtype=torch.int64, device=dev)
        rows, cols = thc_kernels._noise_kernel(R, plan, key, ranges)
        got = noise(plan, key, ranges)
        problems += same_structure(f"{tag}: noise[{rank}]", got, (rows, cols))
        if not problems:
            problems += equal_values(f"{tag}: noise[{rank}] rows", got[0], rows)
            problems += equal_values(f"{tag}: noise[{rank}] cols", got[1], cols)
        fingerprint = torch.tensor(5 + (rank if nonfinite == "mismatch" else 0), dtype=torch.int64, device=dev)
        rank_finite = torch.logical_and(finite, torch.tensor(not (nonfinite == "rank" and rank == n - 1), device=dev))
        got = quantize(plan, y, held, ranges, rows, cols, fingerprint, rank_finite, stats)
        want = thc_kernels._quantize_kernel(R, plan, y, held, ranges, rows, cols, fingerprint, rank_finite, stats)
        problems += same_structure(f"{tag}: quantize[{rank}]", got, want)
        if problems:
            return problems
        if bool(finite):
            problems += equal_values(f"{tag}: quantize[{rank}] payload", got[0], want[0])
            problems += equal_values(f"{tag}: quantize[{rank}] residual", got[1], want[1])
            problems += equal_values(f"{tag}: quantize[{rank}] saturated", got[2], want[2])
            if rank == 0 and int(want[2]) == 0:
                problems.append(f"{tag}: nothing saturated (the case tests no clipping)")
        else:  # levels undefined; the statistics and control words are not
            problems += equal_values(f"{tag}: quantize[{rank}] tail", got[0][lay.words:], want[0][lay.words:])
        payloads.append(want[0])
    if not bool(finite):
        return problems

    # Decode the all-reduce of the ranks' payloads (Sum, or Horovod's truncated Average).
    actual = op or ("sum" if seed % 2 else "average")
    total = torch.stack([p.to(torch.int64) for p in payloads]).sum(0)
    if own:  # the int32 Sum wraps modulo 2**32
        total = torch.remainder(total + 2 ** 31, 2 ** 32) - 2 ** 31
    if actual == "average":
        total = torch.div(total, n, rounding_mode="trunc")
    reduced = total.to(torch.int32)
    received = thc_kernels._receive_kernel(R, plan, reduced)
    got = receive(plan, reduced)
    problems += same_structure(f"{tag}: receive", got, received)
    for name, a, b in zip(("count", "bad", "mismatch", "inferred"), got, received):
        problems += equal_values(f"{tag}: receive {name}", a, b)
    count, bad, mismatch, inferred = received
    # Step 8's small fields from the same payload, against counters that differ from zero.
    small = [torch.tensor(v, dtype=torch.int64, device=dev) for v in (7, 2, 11, 13)]
    want = thc_kernels._finish_kernel(R, plan, reduced, ranges, *small, bad, mismatch, inferred)
    got = finish(plan, reduced, ranges, *small, bad, mismatch, inferred)
    problems += same_structure(f"{tag}: finish", got, want)
    for name, a, b in zip(("ranges", "step", "realigned", "saturated", "ok"), got, want):
        problems += equal_values(f"{tag}: finish {name}", a, b)
    mine = payloads[0][:lay.words].clone() if own else None
    got = decode(plan, reduced, ranges, state.diag, hmat, count, bad, mismatch, inferred, mine)
    want = thc_kernels._decode_kernel(R, plan, reduced, ranges, state.diag, hmat, count, bad, mismatch, inferred,
                                      mine)
    problems += same_structure(f"{tag}: decode", got, want)
    if not problems:
        problems += close_in_groups(f"{tag}: decode", got, want)
        expect = {"rank": "nan", "mismatch": "zero"}.get(nonfinite, "value")
        seen = ("nan" if bool(torch.isnan(want).all()) else "zero" if not bool(want.any()) else "value")
        if seen != expect:
            problems.append(f"{tag}: the reference decoded {seen}, the case means {expect}")
    if not problems:  # an engine's mean into its bucket: 1/n folded in, only the d coordinates written
        bucket = torch.full((d + 3,), 7.0, device=dev)
        into = decode(plan._replace(factor=0.5), reduced, ranges, state.diag, hmat, count, bad, mismatch, inferred,
                      mine, bucket[1:1 + d])
        if into.data_ptr() != bucket[1:].data_ptr() or tuple(into.shape) != (d,):
            problems.append(f"{tag}: decode into a bucket slice returned another tensor")
        else:
            problems += equal_values(f"{tag}: decode into", into, got[:d] * 0.5)
            problems += equal_values(f"{tag}: decode into, the bucket around it", bucket[[0, d + 1, d + 2]],
                                     torch.full((3,), 7.0, device=dev))
    return problems


def rng_key(seed, rank):
    """A per-rank rounding key (any 32-bit value)."""
    return (0x9E3779B1 * (seed + 1) + 0x85EBCA6B * rank) & 0xFFFFFFFF


THC_CASES = [
    # (d, n, op, ef, flush, saturation, nonfinite): a few blocks, an odd d, world sizes and ops
    (3000, 2, "sum", True, 1.0, True, None),
    (2999, 8, "average", True, 1.0, True, None),
    (3073, 3, None, True, 1.0, True, None),
    (4096, 1, "average", True, 0.5, True, None),
    (3001, 4, "average", False, None, True, None),
    (2048, 5, "sum", True, None, False, None),
    (3000, 2, None, True, 1.0, False, None),
    (2500, 3, "average", True, 1.0, True, "nan"),
    (3100, 2, "sum", True, 1.0, False, "overflow"),
    (3100, 3, "average", True, 1.0, True, "rank"),
    (3100, 2, None, True, 1.0, True, "mismatch"),
    # subtract_own (the trailing seed, own): lanes for the other ranks, 2 and 3 ranks under each op
    # (the top-heavy levels' int32 sums may wrap at 2 under Sum and 3 under Average)
    (3000, 2, "average", False, None, True, None, 0, True),
    (2999, 2, "sum", True, 1.0, True, None, 1, True),
    (3073, 3, "sum", True, 1.0, True, None, 0, True),
    (3100, 3, None, True, 1.0, True, "rank", 1, True),
    (3000, 3, "average", False, None, True, None, 0, True),
]


# ---- TopKC ----
def check_topkc(device, d, plan, nonfinite=False, seed=0):
    """TopKC's ``_correct_kernel`` (module docstring); ``nonfinite``: an inf and a NaN in the
    gradient (the blocking form's scores drop them to 0)."""
    from torch_backend.kernels import triton_topkc
    form = kernels.fused_form(topkc._correct_kernel, plan, "cuda")
    if form is not triton_topkc.correct:
        return [f"topkc {plan}: the registry gives {form}, not triton_topkc.correct"]
    g, dev = seeded(seed, device)
    flat = randn_on(g, d, dev)
    flat[: d // 4] *= 30.0
    if nonfinite:
        flat[3], flat[d - 2] = float("inf"), float("nan")
    residual = randn_on(g, d, dev, 0.5) if plan[1] else flat
    tag = f"topkc d={d} plan={plan}{' nonfinite' if nonfinite else ''}"
    got = form(plan, flat, residual)
    want = topkc._correct_kernel(R, plan, flat, residual)
    problems = same_structure(tag, got, want)
    if problems:
        return problems
    problems += equal_values(f"{tag}: chunks", got[0], want[0])
    problems += close_in_groups(f"{tag}: scores", got[1], want[1], 1)
    return problems


TOPKC_CASES = [
    # (d, (chunk, error_feedback, blocking, beta), nonfinite)
    (3000, (256, True, False, 1.0), False),
    (1001, (100, True, False, 0.9), False),
    (777, (64, False, False, 1.0), False),
    (2049, (256, True, True, 1.0), True),
    (513, (7, True, False, 1.0), True),
    (5000, (4096, True, False, 1.0), False),
]


# ---- signSGD ----
def check_signsgd(device, d, n, op, ef=True, block=1024, nonfinite=None, seed=0):
    """signSGD's three kernels (:mod:`torch_backend.kernels.triton_signsgd`): ``p`` (from the
    gradient and the kept ``p'`` and ``S'``: step 6 of the last step), the sign and control
    words, the receive's outputs and the decoded values equal the reference's bit for bit; a scale's
    code may differ by one only where ``4 log2 s`` lies within 1e-4 of a half-integer (the block
    sums add up in another order). ``nonfinite``: ``"nan"`` (a NaN in ``x``), ``"flag"`` (the
    caller's finite flag false) or ``"rank"`` (the last rank not finite: the decoder's NaN)."""
    from hvd_gradcomp import signsgd_kernels as S
    from hvd_gradcomp.registry import make_scheme
    from torch_backend.kernels import triton_signsgd
    scheme = make_scheme("signsgd", error_feedback=ef, block=block)
    info = TensorInfo("triton.signsgd", (d,), "float32", n, 0, op)
    plan = scheme._plan(info, scheme.layout(info))
    forms = [kernels.fused_form(fn, plan, "cuda")
             for fn in (S._encode_kernel, S._receive_kernel, S._decode_kernel)]
    want_forms = [triton_signsgd.encode, triton_signsgd.receive, triton_signsgd.decode]
    if forms != want_forms:
        return [f"signsgd {plan}: the registry gives {forms}, not {want_forms}"]
    encode, receive, decode = forms
    tag = f"signsgd d={d} n={n} op={op} ef={ef} block={block} {nonfinite or ''}".strip()
    g, dev = seeded(seed, device)
    problems, payloads, first = [], [], None
    for rank in range(n):
        x = randn_on(g, d, dev, 2.0 + rank)
        x[: d // 4] *= 1e-3  # blocks of other scales
        x[d // 2 - 1] = 0.0  # sign(0) = +1
        kept = randn_on(g, d, dev, 0.3) if ef else x  # the last step's p and agreed S
        kept_scale = randn_on(g, -(-d // plan.block), dev, 0.1).abs() if ef else x
        if ef:
            kept[0] = -0.0  # [p' >= 0] of -0.0 is 1
        flag = None
        if nonfinite == "nan" or (nonfinite == "rank" and rank == n - 1):
            x[d // 2] = float("nan")
        if nonfinite == "flag":
            flag = torch.tensor(rank != 0, device=dev)
        strided = torch.stack([x, -x], 1)[:, 0]  # a view: the form copies it
        got = encode(plan, strided, kept, kept_scale, flag)
        want = S._encode_kernel(R, plan, x, kept, kept_scale, flag)
        problems += same_structure(f"{tag}: encode[{rank}]", got, want)
        if problems:
            return problems
        problems += equal_values(f"{tag}: encode[{rank}] corrected", got[1].view(torch.int32), want[1].view(torch.int32))
        problems += _signsgd_payload(f"{tag}: encode[{rank}]", got[0], want[0], want[1], plan, d)
        payloads.append(want[0])
        first = want[1] if first is None else first
    actual = op or ("sum" if seed % 2 else "average")
    total = torch.stack([p.to(torch.int64) for p in payloads]).sum(0)
    if actual == "average":
        total = torch.div(total, n, rounding_mode="trunc")
    reduced = total.to(torch.int32)
    got, want = receive(plan, reduced, first), S._receive_kernel(R, plan, reduced, first)
    problems += same_structure(f"{tag}: receive", got, want)
    for name, a, b in zip(("count", "bad", "scale", "inferred"), got, want):
        problems += equal_values(f"{tag}: receive {name}", a.view(torch.int32) if a.is_floating_point() else a,
                           b.view(torch.int32) if b.is_floating_point() else b)
    got, ref = decode(plan, reduced, *want), S._decode_kernel(R, plan, reduced, *want)
    problems += same_structure(f"{tag}: decode", got, ref)
    if not problems:
        problems += equal_values(f"{tag}: decode", got, ref)
        expect = "nan" if nonfinite in ("nan", "rank", "flag") else "value"
        seen = "nan" if bool(torch.isnan(ref).all()) else "value"
        if seen != expect:
            problems.append(f"{tag}: the reference decoded {seen}, the case means {expect}")
    # An engine's mean written into its bucket: 1/n folded in, only the d coordinates written.
    folded = plan._replace(factor=1.0 / n) if n > 1 else plan
    bucket = torch.full((d + 3,), 7.0, device=dev)
    got = decode(folded, reduced, *want, bucket[1:1 + d])
    if got.data_ptr() != bucket[1:].data_ptr() or tuple(got.shape) != (d,):
        problems.append(f"{tag}: decode into a bucket slice returned another tensor")
    else:
        problems += equal_values(f"{tag}: decode into", got, S._decode_kernel(R, folded, reduced, *want)[:d])
        problems += equal_values(f"{tag}: decode into, the bucket around it", bucket[[0, d + 1, d + 2]],
                                 torch.full((3,), 7.0, device=dev))
    return problems


def _signsgd_payload(name, got, want, corrected, plan, d):
    """One rank's payload: sign and control words equal; the statistics words equal but for codes
    one apart where ``4 log2 s`` (float64) lies within 1e-4 of a half-integer."""
    B = plan.block
    nb = corrected.shape[0] // B
    words, stats = -(-nb * B // plan.signs.lanes), -(-2 * nb // plan.stats.lanes)
    problems = equal_values(f"{name} sign words", got[:words], want[:words])
    problems += equal_values(f"{name} control words", got[words + stats:], want[words + stats:])
    lay = plan.stats

    def pairs(p):
        w = p[words:words + stats].cpu().to(torch.int64)
        lanes = [(w >> (lay.guard + j * lay.width)) & ((1 << lay.width) - 1) for j in range(lay.lanes)]
        return torch.cat(lanes)[:2 * nb].reshape(nb, 2)

    a, b = pairs(got), pairs(want)
    problems += equal_values(f"{name} has-data flags", a[:, 1], b[:, 1])
    moved = (a[:, 0] != b[:, 0]).nonzero().flatten()
    if moved.numel():
        size = torch.full((nb,), float(B), dtype=torch.float64)
        size[-1] = d - (nb - 1) * B
        s = corrected.detach().cpu().double().reshape(nb, B).abs().sum(1) / size
        frac = (4 * torch.log2(s[moved])).frac().abs() - 0.5
        if not (bool((frac.abs() < 1e-4).all()) and bool(((a[moved, 0] - b[moved, 0]).abs() == 1).all())):
            problems.append(f"{name}: codes of blocks {moved[:8].tolist()} differ away from a rounding boundary")
    return problems


SIGNSGD_CASES = [
    # (d, n, op, ef, block, nonfinite): odd sizes, short last blocks, world sizes and ops
    (3000, 2, "average", True, 1024, None),
    (2999, 3, None, True, 1024, None),
    (777, 2, "sum", False, 100, None),
    (5000, 8, "average", True, 7, None),
    (999, 4, "sum", True, None, None),
    (1, 1, "average", True, 1024, None),
    (2500, 3, "average", True, 1024, "nan"),
    (2500, 2, "sum", True, 1024, "flag"),
    (2049, 3, None, True, 256, "rank"),
]


def check_names():
    """The keys of :func:`run_all`'s result, in order (for the tests' parameters)."""
    return (["thc" + repr(case) for case in THC_CASES]
            + [f"topkc{case!r}" for case in TOPKC_CASES] + [f"powersgd{case!r}" for case in POWERSGD_CASES]
            + [f"powersgd_batched{case!r}" for case in POWERSGD_BATCHED_CASES]
            + [f"signsgd{case!r}" for case in SIGNSGD_CASES]
            + ["powersgd_agree", "powersgd_batched_scheme", "schemes", "refusals"])


def run_all(device, nonfinite_only=False):
    """Every check on ``device``: {check name: [problems]} (names: :func:`check_names`);
    ``nonfinite_only``: THC's and TopKC's cases of a non-finite gradient alone."""
    if nonfinite_only:
        checks = ([("thc" + repr(case), check_thc, case) for case in THC_CASES if case[6]]
                  + [(f"topkc{case!r}", check_topkc, case) for case in TOPKC_CASES if case[2]])
        return _run(device, checks)
    checks = ([("thc" + repr(case), check_thc, case) for case in THC_CASES]
              + [(f"topkc{case!r}", check_topkc, case) for case in TOPKC_CASES]
              + [(f"powersgd{case!r}", check_powersgd, case) for case in POWERSGD_CASES]
              + [(f"powersgd_batched{case!r}", check_powersgd_batched, case) for case in POWERSGD_BATCHED_CASES]
              + [(f"signsgd{case!r}", check_signsgd, case) for case in SIGNSGD_CASES]
              + [("powersgd_agree", check_powersgd_agree, ()),
                 ("powersgd_batched_scheme", check_powersgd_batched_scheme, ()), ("schemes", check_schemes, ()),
                 ("refusals", check_refusals, ())])
    return _run(device, checks)


def _run(device, checks):
    results = {}
    for name, check, args in checks:
        try:
            results[name] = check(device, *args)
        except Exception as exc:  # noqa: BLE001 - one failing check reports, the others still run
            results[name] = [f"{name}: raised {type(exc).__name__}: {exc}"]
    return results


if __name__ == "__main__":
    warnings.filterwarnings("ignore", "(invalid value|overflow) encountered", RuntimeWarning)  # numpy
    if sys.argv[1:2] == ["aot"]:
        # The ahead-of-time compile (test_triton_kernels.py): real Triton, no interpreter.
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            sys.exit("run without TRITON_INTERPRET")
        # every variant through triton.compile, then the PTX-only path on each module's first
        print(json.dumps({"full": aot_all(), "ptx_only": aot_all(ptx_only=True, limit=1)}))
        sys.exit(0)
    # The interpreter's run (test_triton_kernels.py): CPU tensors, the Triton forms everywhere.
    if os.environ.get("TRITON_INTERPRET") != "1" or kernels.mode() != "triton":
        sys.exit("run with TRITON_INTERPRET=1 HVD_GRADCOMP_KERNELS=triton")
    torch.set_num_threads(1)
    print(json.dumps(run_all("cpu", nonfinite_only=sys.argv[1:2] == ["nonfinite"])))
