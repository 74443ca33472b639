"""``--device`` of the TTA harness and its PyTorch workers (issue 26).

Where CUDA is absent, ``--device cuda`` is refused before anything starts, with a message that
says why, by the harness (exit status 2) and by each worker run on its own (argparse's status
2); the NCCL environment that keeps a GPU run on the rate-limited links is set only where it
applies. The runs themselves on CUDA: docs/gpu.md (the GPU check).
"""
import os
import subprocess
import sys

import pytest

from hvd_gradcomp.bench import device, netem, tta, tta_hooks, tta_run, tta_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda():
    import torch
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(_cuda(), reason="checks the refusal where CUDA is absent; this machine has CUDA")


def test_harness_refuses_cuda_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "sweep"
    status = tta_sweep.main(["--device", "cuda", "--loopback", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--device cuda: PyTorch" in err and "sees no CUDA device" in err and "--device cpu" in err
    assert not out.exists()  # refused before any run or folder


def test_harness_refuses_tf_workloads_on_cuda():
    args = tta_sweep.build_parser().parse_args(["--device", "cuda", "--workloads", "digits,digits-tf"])
    with pytest.raises(device.DeviceUnavailable, match="only the PyTorch workloads run on CUDA"):
        device.check_sweep(args, ["torch", "tensorflow"])
    args = tta_sweep.build_parser().parse_args(["--workloads", "digits-tf"])
    device.check_sweep(args, ["tensorflow"])  # the CPU default takes every workload


@pytest.mark.parametrize("module", ["hvd_gradcomp.bench.workers.digits_torch",
                                    "hvd_gradcomp.bench.workers.ddp_torch",
                                    "hvd_gradcomp.bench.workers.fsdp_torch"])
def test_workers_refuse_cuda_without_a_gpu(module):
    """Each worker alone refuses before it initialises Horovod or a process group."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module, "--device", "cuda", "--max-steps", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--device cuda: PyTorch" in proc.stderr and "sees no CUDA device" in proc.stderr


def test_harness_passes_device_to_workers():
    args = tta_sweep.build_parser().parse_args(["--device", "cuda", "--loopback"])
    plan_runs = tta.plan_runs(["digits"], ["fp16"], tta_hooks.parse_ddp_hooks("fp16"), reference=False)
    cmds = [tta_run.command(run, args, "/tmp/x.json") for run in plan_runs]
    assert cmds and all(c[c.index("--device") + 1] == "cuda" for c in cmds)
    args = tta_sweep.build_parser().parse_args(["--loopback"])
    assert all("--device" not in tta_run.command(run, args, "/tmp/x.json") for run in plan_runs)


def test_nccl_env_only_on_rate_limited_gpu_runs():
    emulated = netem.EmulatedNetwork(2, netem.LinkConfig(100, 0))  # not set up: names only
    env = device.launch_env("cuda", emulated)
    assert env["NCCL_SOCKET_IFNAME"] == emulated.iface and env["NCCL_P2P_DISABLE"] == "1"
    assert env["NCCL_SHM_DISABLE"] == "1" and env["NCCL_NET"] == "Socket"
    assert device.launch_env("cpu", emulated) == {}
    assert device.launch_env("cuda", netem.LoopbackNetwork(2, "loopback")) == {}


def test_cpu_device_helpers():
    import torch
    assert device.rank_device("cpu", 3) == torch.device("cpu")
    assert device.sync_fn("cpu") is None and device.clock("cpu")() > 0
    with pytest.raises(device.DeviceUnavailable, match="must be one of cpu, cuda"):
        device.check_device("tpu")

    class Workload:
        def __init__(self):
            self.x, self.n = torch.ones(2), 3
    wl = device.place_workload(Workload(), torch.device("cpu"))
    assert wl.x.device.type == "cpu" and wl.n == 3
