"""The DDP hook driven by the trainers users run: PyTorch Lightning (``CompressionCallback``,
torch_backend/lightning.py) and Hugging Face Accelerate (``register_comm_hook`` after
``accelerator.prepare``), the recipes of docs/ddp.md, against the real packages on 2 Gloo ranks.

One launch (killed at its timeout): a small classifier on seeded random data,
1. Lightning 2.x, ``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(...))`` with
   the callback: the hook keys and routes the LightningModule's parameter names, both ranks end
   with identical parameters, the loss falls, and a Lightning checkpoint
   (``trainer.save_checkpoint``) restores every rank's compressor state exactly through
   ``fit(ckpt_path=...)``;
2. Accelerate: ``register_comm_hook(model, comp)`` on the prepared model: names, identical
   parameters, falling loss.
The ranks come from tests/ddprun.py (the process group is up, ``LOCAL_RANK`` set as a launcher
sets it), so Lightning and Accelerate attach to it instead of spawning processes.
"""
import numpy as np
import pytest

from tests.ddprun import run

NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
SPEC = "topkc:0.1"


def _data(rank):
    import torch
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _net():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _states(comp):
    sd = comp.state_dict()
    return {k: {f: v.numpy().copy() for f, v in fields.items()} for k, fields in sd["tensors"].items()}


def _lightning(tmp, rank):
    import torch
    import torch.nn.functional as F
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch_backend import Compression
    from torch_backend.lightning import CompressionCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.losses = _net(), []

        def training_step(self, batch, i):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    def trainer(steps, comp):
        return pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                          max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp, callbacks=[CompressionCallback(comp)])

    def loader():
        return torch.utils.data.DataLoader(_data(rank), batch_size=16, shuffle=False)

    module, comp = Module(), Compression.from_spec(SPEC)
    t = trainer(40, comp)
    t.fit(module, loader())
    path = f"{tmp}/lightning.ckpt"
    t.save_checkpoint(path)  # on every rank: the callback's state_dict gathers
    comp2 = Compression.from_spec(SPEC)
    trainer(40, comp2).fit(Module(), loader(), ckpt_path=path)  # restored, no step left to run
    return {"routes": comp.routes(), "params": {n: p.detach().numpy().copy() for n, p in module.named_parameters()},
            "losses": module.losses, "world": comp.engine.world(), "saved": _states(comp),
            "restored": _states(comp2)}


def trainers_worker(tmp):
    import os
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; ddprun sets RANK and WORLD_SIZE
    out = {}
    out["lightning"] = _lightning(tmp, rank)
    # Accelerate
    acc = Accelerator(cpu=True)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    loader = torch.utils.data.DataLoader(_data(rank), batch_size=16, shuffle=False)
    model, opt, loader = acc.prepare(net, opt, loader)
    comp = register_comm_hook(model, Compression.from_spec(SPEC))
    losses = []
    for _ in range(3):
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            losses.append(float(loss))
    out["accelerate"] = {"routes": comp.routes(), "losses": losses, "world": comp.engine.world(),
                         "params": {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()},
                         "type": type(model).__name__}
    return out


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    return run(trainers_worker, np=2, args=(str(tmp_path_factory.mktemp("trainers")),), timeout=400)


@pytest.mark.parametrize("which", ["lightning", "accelerate"])
def test_trainer(trainers, which):
    r0, r1 = trainers[0][which], trainers[1][which]
    # keyed by the module's parameter names (Accelerate's model is the bare Sequential)
    names = NAMES if which == "lightning" else [n.removeprefix("net.") for n in NAMES]
    for rank, r in enumerate((r0, r1)):
        assert r["world"] == (2, rank)
        assert sorted(r["routes"]) == sorted(names)
        assert r["routes"][names[0]] == "topkc:ratio=0.1"  # the one tensor big enough to compress
        assert np.mean(r["losses"][-5:]) < 0.8 * np.mean(r["losses"][:5]), r["losses"]
    for n in names:  # every rank applied the same gradients
        np.testing.assert_array_equal(r0["params"][n], r1["params"][n])


def test_lightning_checkpoint(trainers):
    """trainer.save_checkpoint then fit(ckpt_path=...): each rank's own compressor state
    (the ranks' error feedback differs), exactly."""
    for r in trainers:
        rec = r["lightning"]
        assert rec["saved"] and set(rec["saved"]) == set(rec["restored"])
        for key, fields in rec["saved"].items():
            for f, v in fields.items():
                np.testing.assert_array_equal(rec["restored"][key][f], v, err_msg=f"{key}.{f}")
    s0, s1 = trainers[0]["lightning"]["saved"], trainers[1]["lightning"]["saved"]
    assert any(not np.array_equal(s0[k][f], s1[k][f]) for k in s0 for f in s0[k])
