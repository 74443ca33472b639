"""Launches per bucket of THC's and TopKC's Triton forms (issue 51, item 1), without a GPU: the checks of
tests/core/triton_fused_checks.py in Triton's interpreter (``TRITON_INTERPRET=1``,
``HVD_GRADCOMP_KERNELS=triton``: the Triton forms on CPU tensors), in a subprocess killed when
it runs over its time:

- THC's compress in two launches (``triton_thc_fused.encode``) equals the five-launch per-step
  forms bit for bit (payload, residual, rotation, held residual, saturation count; a
  non-finite step's statistics and control words) and, given the same rotation, the
  reference's quantiser; its ticket is zero after every launch;
- a bucket of 2 and of 16 THC members (one unit) encodes bit for bit as with the per-step
  forms, in the same number of Triton launches per step (encode, receive, decode, finish),
  two of them the encode's;
- TopKC's decode in two launches (``triton_topkc.scatter``) equals ``_scatter_kernel``'s
  composition bit for bit.

Counted, not timed. The ahead-of-time compile of the new kernel for sm_90 is in
tests/core/test_triton_kernels.py (every provider kernel). Skipped where Triton is missing.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.core.triton_fused_checks import check_names

TIMEOUT = 400  # seconds (about 80 s on a quiet 2-core machine)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (make setup installs it from .ci/pins.txt)")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    logs = tmp_path_factory.mktemp("launch-logs")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_INTERPRET="1", HVD_GRADCOMP_KERNELS="triton")
    out, err = logs / "out", logs / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.core.triton_fused_checks"], cwd=ROOT, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"triton_fused_checks ran over {TIMEOUT} s:\n{err.read_text()[-3000:]}")
    assert proc.returncode == 0, f"triton_fused_checks failed:\n{err.read_text()[-4000:]}"
    return json.loads(out.read_text().strip().splitlines()[-1])


@pytest.mark.parametrize("name", check_names())
def test_fused_form_matches_per_step_forms(interpreted, name):
    """Each check finds no difference, and the bucket's launches do not grow with its members."""
    assert name in interpreted, sorted(interpreted)
    assert interpreted[name] == [], "\n".join(interpreted[name])


def test_fused_forms_on_cuda():
    """The same checks on CUDA tensors (compiled kernels; the ticket's atomics between programs
    running at once): run by ``make gpu-check``; skipped without CUDA."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch_backend import kernels
    if kernels.mode() == "off":
        pytest.skip(f"{kernels.ENV}=off: no fused form runs")
    from tests.core.triton_fused_checks import run_all
    bad = {name: problems for name, problems in run_all("cuda").items() if problems}
    assert not bad, "\n".join(p for problems in bad.values() for p in problems)
