"""``examples/fsdp_digits.py`` under ``torchrun`` as a user runs it (one launch: 4 ranks, 2
replicas x 2 shards, THC across replicas and on the reduce-scatter): it learns, sends less than
half FP16's bytes on each (both reported), and its per-rank checkpoints hold each rank's shard
keys and load in a plain process. The FSDP hook itself: tests/parallel/test_fsdp.py.
"""
import sys

from tests.ddprun import _free_port, launch_command


def test_example(tmp_path):
    """examples/fsdp_digits.py as a user runs it (torchrun, 4 ranks as 2 replicas x 2 shards)."""
    import torch
    from tests.test_examples import ACCURACY, STATS
    from torch_backend import Compression
    path = str(tmp_path / "ckpt")
    code, out = launch_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                                "--master_port", str(_free_port()), "examples/fsdp_digits.py", "--shards", "2",
                                "--compression", "thc", "--reduce-scatter", "thc", "--epochs", "3", "--save", path],
                               timeout=400)
    assert code == 0, out[-3000:]
    assert float(ACCURACY.findall(out)[-1]) >= 85.0, out[-3000:]
    for where in ("all-reduce across replicas", "reduce-scatter within the replica"):
        stats = [m for m in (STATS.search(line) for line in out.splitlines() if line.startswith(where)) if m]
        assert stats and int(stats[-1]["sent"].replace(",", "")) < int(stats[-1]["fp16"].replace(",", "")) / 2, \
            (where, out[-3000:])
    for rank in range(4):  # each rank's compressor state: its shards, its replica rank
        state = torch.load(f"{path}.rank{rank}", weights_only=False)["compression"]
        assert state["world_size"] == 2 and state["rank"] == rank // 2
        assert {k.partition("[")[2] for k in state["routes"]} == {f"shard {rank % 2}/2]"}
        Compression.thc().load_state_dict(state, rank=rank // 2)  # in a plain process
