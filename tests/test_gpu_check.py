"""The GPU check's dry run (tests/gpu/gpu_check.py, ``make gpu-check-dry``) on this machine,
as a GPU machine without TensorFlow sees it: TensorFlow blocked (tests/gpu/without_tensorflow
first on PYTHONPATH), a Horovod sdist and a wheel folder given. Every step that needs no CUDA
runs (the pytest selection collected, the overhead bench on the CPU at 2^10, the Horovod test,
which skips without a GPU); the Horovod build prints its plan and stops; the report folder
holds at most 8 files. One launch, about 45 s on a 2-core machine.
"""
import csv
import os
import subprocess
import sys

import pytest

from tests.hvdrun import ROOT

BLOCK_TF = os.path.join(ROOT, "tests", "gpu", "without_tensorflow")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    links = tmp / "wheels"
    links.mkdir()
    sdist = tmp / "horovod-0.28.1.tar.gz"
    sdist.write_bytes(b"")  # only its presence is checked in a dry run
    out = tmp / "report"
    env = dict(os.environ, HVD_GRADCOMP_GPU_CHECK_DRY_RUN="1", HVD_GRADCOMP_GPU_CHECK_OUT=str(out),
               HVD_GRADCOMP_HOROVOD_SDIST=str(sdist), PIP_FIND_LINKS=str(links),
               PYTHONPATH=os.pathsep.join([BLOCK_TF, ROOT]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "gpu_check.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return {"code": proc.returncode, "stdout": proc.stdout + proc.stderr, "summary": summary, "out": out}


def test_dry_run_passes_and_reports_every_step(dry_run):
    assert dry_run["code"] == 0, dry_run["stdout"][-4000:]
    summary = dry_run["summary"]
    for line in ("1. environment: ok (no CUDA: dry run)",
                 "2. horovod build: skipped (dry run: plan printed, nothing built",
                 "3. pytest: ok (dry run: collected, not run;",
                 "4. overhead: ok (dry run: CPU at 2^10",
                 "5. codec bench (optional): ", "6. horovod test: "):
        assert line in summary, (line, summary)
    assert "FAILED" not in summary, summary


def test_dry_run_sees_no_tensorflow_and_plans_a_torch_only_nccl_build(dry_run):
    summary = dry_run["summary"]
    assert "TensorFlow cannot be imported" in summary
    for item in ("HOROVOD_WITHOUT_TENSORFLOW=1", "HOROVOD_WITHOUT_MPI=1", "HOROVOD_WITH_PYTORCH=1",
                 "HOROVOD_GPU_OPERATIONS=NCCL", "HOROVOD_BUILD_CUDA_CC_LIST=90",
                 "CMAKE_POLICY_VERSION_MINIMUM=3.5", "PIP_NO_INDEX=1", "--no-index", "--no-build-isolation"):
        assert item in summary, item


def test_report_folder_holds_at_most_eight_files(dry_run):
    files = sorted(os.listdir(dry_run["out"]))
    assert len(files) <= 8 and {"summary.txt", "env.txt", "pytest.txt", "overhead.csv"} <= set(files), files
    with open(dry_run["out"] / "overhead.csv", newline="") as f:
        specs = {row["spec"] for row in csv.DictReader(f)}
    assert {"fp16", "topkc", "thc", "powersgd:rank=4", "signsgd"} <= specs, specs
    collected = (dry_run["out"] / "pytest.txt").read_text()
    assert "test_cuda_graph_replay_equals_eager" in collected and "test_one_rank_nccl_equals_gloo" in collected


def test_without_cuda_the_real_check_stops_with_the_reason(tmp_path):
    env = dict(os.environ, HVD_GRADCOMP_GPU_CHECK_OUT=str(tmp_path / "report"),
               PYTHONPATH=os.pathsep.join([BLOCK_TF, ROOT]))
    env.pop("HVD_GRADCOMP_GPU_CHECK_DRY_RUN", None)
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real check would run")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "gpu_check.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2
    assert "PyTorch sees no CUDA device" in (tmp_path / "report" / "summary.txt").read_text()
