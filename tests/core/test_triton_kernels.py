"""The Triton fused forms (torch_backend/kernels/triton_thc.py with triton_thc_words.py,
triton_topkc.py; issue 33) without a GPU, in two subprocesses with hard timeouts (killed when
they run over):

1. Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) runs every
   kernel on CPU tensors against the core's reference composition, at small sizes: THC's
   rotate, quantise-and-pack and decode (a few blocks, odd sizes, 1-8 ranks, Sum, Average and
   an unknown op, flush bound on and off, error feedback on and off, saturation on and off, a
   NaN gradient, a finite gradient whose rotation overflows, a non-finite rank, ranks whose
   fingerprints disagree), TopKC's correct kernel (chunk sizes, residual decay, no error
   feedback, the blocking form with non-finite values), PowerSGD's basis, batched basis and
   check on receipt (tests/core/triton_powersgd_checks.py), and whole schemes through
   ``one_rank(OPS)`` with ``HVD_GRADCOMP_KERNELS=triton`` against ``one_rank(REFERENCE_OPS)``.
   What "agrees" means: tests/core/triton_checks.py.
2. An ahead-of-time compile of every kernel for sm_90 (``triton.compile`` with
   ``GPUTarget("cuda", 90, 32)``): PTX for sm_90 without TF32 or approximate division and
   square roots, no contracted FMA in the kernels without matrix products, and a cubin from
   Triton's bundled ptxas where it runs; every jit function of the providers is compiled by
   some entry. The PTX-only path (for machines where ptxas cannot run) is compiled too.

The CUDA runs of the same checks are in tests/core/test_devices.py. Skipped, with the reason,
where Triton is not installed (``make setup`` installs it: .ci/pins.txt).
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.core.triton_checks import check_names

# Both runs together, seconds (about 15 s on a quiet 2-core machine, 50 s on a loaded one).
TIMEOUT = 300


def _dot_kernels():
    """OpenBLAS kernels (``OPENBLAS_CORETYPE``) under which the non-finite cases run again: the
    interpreter's ``tl.dot`` is NumPy's, whose summation order (and so where an overflowing
    block turns NaN rather than inf) follows the kernel's vector width. Prescott (SSE3) runs on
    any x86-64; Haswell (AVX2) and SkylakeX (AVX-512) where the CPU has them. The checks must
    pass under each (tests/core/triton_checks.py: the non-finite contract)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        flags = set()
    if "sse3" not in flags and "pni" not in flags:  # not x86, or unknown: the default kernel only
        return ()
    return ("Prescott",) + (("Haswell",) if "avx2" in flags else ()) + (("SkylakeX",) if "avx512f" in flags else ())


DOT_KERNELS = _dot_kernels()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (make setup installs it from .ci/pins.txt)")


def _start(args, env, logs):
    """``python -m tests.core.triton_checks ARGS`` started in ``env`` (None values: unset),
    its stdout and stderr into files under ``logs`` (no pipe to fill while the other runs)."""
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    name = "-".join(args) or "interpreted"
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.core.triton_checks", *args], cwd=ROOT, env=full,
                                stdout=stdout, stderr=stderr)
    return proc, out, err


def _result(started, args, deadline):
    """The JSON line (the last) that the started run prints; killed and failed past the
    ``deadline`` (time.monotonic())."""
    proc, out, err = started
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"triton_checks {args} ran over its time:\n{err.read_text()[-3000:]}")
    assert proc.returncode == 0, f"triton_checks {args} failed:\n{err.read_text()[-4000:]}"
    return json.loads(out.read_text().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both subprocesses, started together: the interpreter's checks, and the compile for
    sm_90 in a fresh Triton cache (every kernel compiled, no cache hit) without the
    interpreter."""
    cache, logs = str(tmp_path_factory.mktemp("triton-cache")), tmp_path_factory.mktemp("triton-logs")
    interpret = {"TRITON_INTERPRET": "1", "HVD_GRADCOMP_KERNELS": "triton"}
    procs = {"interpreted": ([], interpret),
             "compiled": (["aot"], {"TRITON_INTERPRET": None, "TRITON_CACHE_DIR": cache})}
    started = {name: _start(args, env, logs) for name, (args, env) in procs.items()}
    deadline = time.monotonic() + TIMEOUT
    try:
        results = {name: _result(run, procs[name][0], deadline) for name, run in started.items()}
        # Then the non-finite cases under each dot kernel, one at a time (a few seconds each).
        for core in DOT_KERNELS:
            args = ["nonfinite", core]
            started[core] = _start(args, dict(interpret, OPENBLAS_CORETYPE=core), logs)
            results[f"nonfinite-{core}"] = _result(started[core], args, time.monotonic() + TIMEOUT)
        return results
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def interpreted(runs):
    return runs["interpreted"]


@pytest.fixture(scope="module")
def compiled(runs):
    return runs["compiled"]["full"]


@pytest.mark.parametrize("name", check_names())
def test_kernel_matches_reference_in_interpreter(interpreted, name):
    """Each check (tests/core/triton_checks.py) finds no difference from the reference."""
    assert name in interpreted, sorted(interpreted)
    assert interpreted[name] == [], "\n".join(interpreted[name])


@pytest.mark.parametrize("core", DOT_KERNELS)
def test_nonfinite_cases_whatever_the_dot_kernel(runs, core):
    """The non-finite cases (an overflowing rotation among them) agree under each OpenBLAS
    kernel of this CPU (:func:`_dot_kernels`): the checks read only what does not depend on
    the order of a vector unit's additions."""
    results = runs[f"nonfinite-{core}"]
    assert results and any("overflow" in name for name in results), sorted(results)
    bad = {name: problems for name, problems in results.items() if problems}
    assert not bad, "\n".join(p for problems in bad.values() for p in problems)


def _kernels(results):
    return {k: v for k, v in results.items() if k not in ("ptxas_runs", "uncovered")}


def test_every_kernel_compiles_for_sm90(compiled):
    """Every provider kernel builds for sm_90: PTX with the sm_90 target and the kernel's entry,
    and a cubin wherever Triton's ptxas runs; no jit function left out of the compile."""
    assert compiled["uncovered"] == [], compiled["uncovered"]
    kernels = _kernels(compiled)
    assert {k.split("[")[0] for k in kernels} == {
        "triton_thc.rotate", "triton_thc.quantize", "triton_thc.decode", "triton_thc_fused.words", "triton_thc_words.scales",
        "triton_thc_words.tail", "triton_thc_words.noise", "triton_thc_words.receive", "triton_thc_words.finish",
        "triton_topkc.correct", "triton_topkc.scatter", "triton_powersgd.basis", "triton_powersgd.basis_batched", "triton_powersgd.agree",
        "triton_signsgd.blocks", "triton_signsgd.pack", "triton_signsgd.stats", "triton_signsgd.receive",
        "triton_signsgd.decode"}
    for name, facts in kernels.items():
        assert "error" not in facts, f"{name}: {facts.get('error')}"
        assert facts["target"] and facts["entry"] and facts["ptx"] > 0, (name, facts)
        if compiled["ptxas_runs"]:
            assert facts["cubin"], (name, facts)


def test_compiled_arithmetic_is_exact_float32(compiled):
    """The compiled kernels keep the reference's float32 arithmetic: no TF32 product, no
    approximate division or square root, and in the kernels without matrix products (all but
    the rotation and the decoder) no multiply-add contracted into an FMA (the ones in the
    rotation and decoder are tl.dot's with +-1 weights: exact)."""
    for name, facts in _kernels(compiled).items():
        assert not facts["tf32"] and not facts["approx"], (name, facts)
        if not name.startswith(("triton_thc.rotate", "triton_thc.decode")):
            assert not facts["fma"], (name, facts)


def test_ptx_only_compile(runs):
    """Where ptxas cannot run, the compiler's stages up to PTX still build each kernel
    module's first kernel for sm_90 (tests/core/triton_aot.py, compile_sm90)."""
    kernels = _kernels(runs["compiled"]["ptx_only"])
    assert len(kernels) == 6, kernels  # triton_thc, _thc_words, _thc_fused, _topkc, _powersgd, _signsgd
    for name, facts in kernels.items():
        assert "error" not in facts, f"{name}: {facts.get('error')}"
        assert facts["target"] and facts["entry"] and facts["cubin"] is None, (name, facts)
