"""``examples/ddp_digits.py`` under ``torchrun`` as a user runs it (one launch: 2 ranks, 3
epochs, TopKC): it learns, its stats line holds the wire formula's bytes, and rank 0's
checkpoint loads in a plain process. The DDP hook itself: tests/parallel/test_ddp.py.
"""
import sys

from tests.ddprun import _free_port, launch_command


def test_example(tmp_path):
    """examples/ddp_digits.py as a user runs it (torchrun, 2 ranks, 3 epochs): it learns, its
    stats line holds the wire formula's bytes, and rank 0's checkpoint loads anywhere."""
    import torch
    from tests.test_examples import ACCURACY, PARAMS, STATS, TORCH_SHAPES, expected_bytes
    from torch_backend import Compression
    path = str(tmp_path / "ckpt.pt")
    code, out = launch_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", str(_free_port()), "examples/ddp_digits.py", "--compression", "topkc:0.1",
                                "--epochs", "3", "--save", path], timeout=400)
    assert code == 0, out[-3000:]
    accuracy = float(ACCURACY.findall(out)[-1])
    assert accuracy >= 85.0, out[-3000:]
    stats = [m for m in (STATS.search(line) for line in out.splitlines()) if m]
    assert stats, out[-3000:]
    sent = int(stats[-1]["sent"].replace(",", ""))
    assert sent == expected_bytes("topkc:0.1", TORCH_SHAPES, None, bucketed=True)
    assert int(stats[-1]["fp16"].replace(",", "")) == 2 * PARAMS
    checkpoint = torch.load(path, weights_only=False)
    comp = Compression.topkc(0.1)
    comp.load_state_dict(checkpoint["compression"], rank=1)  # rank 1's part, in a plain process
    assert checkpoint["compression"]["world_size"] == 2 and comp.state_dict()["tensors"]
