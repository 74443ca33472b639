"""TopKC's ``residual_decay`` under real Horovod (2 ranks, Gloo): the training that motivated it.

The workload is ``examples/pytorch_digits.py`` without mixed precision: an MLP 64-256-256-10
on scikit-learn's digits, each rank a shard, batch 32 per rank, SGD with momentum 0.9 and
learning rate 0.05, 10 epochs (220 steps), seed 0. At ratio 0.01 each weight sends 1-3 of
its 10-256 chunks a step, so a chunk goes about every 60-100 steps, and plain error feedback
delivers those steps' gradient in one burst that momentum carries on: the test accuracy
swings (63-93 % between epochs) and ends below FP16's. With ``residual_decay=0.95`` the
bursts are bounded and training keeps up. Measured in this setting (simulated ranks, seeds
0-7): final accuracy 92.6 % on average (84.2 % at worst) without, 96.9 % (96.4 % at worst)
with; seed 0 here, compared on the mean of the last 3 epochs (94.3 % against 97.1 % in the
simulation), with a margin for the order of float sums.
"""
import pytest

from tests.hvdrun import default_timeout, run

SPECS = {"plain": "topkc:ratio=0.01", "decay": "topkc:ratio=0.01,residual_decay=0.95"}
EPOCHS = 10


def worker():
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    pixels = StandardScaler().fit(x_train)
    x_train, x_test = pixels.transform(x_train), pixels.transform(x_test)
    per_worker = len(x_train) // hvd.size()
    x_train = torch.tensor(x_train[hvd.rank()::hvd.size()][:per_worker], dtype=torch.float32)
    y_train = torch.tensor(y_train[hvd.rank()::hvd.size()][:per_worker])
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)
    out = {}
    for label, spec in SPECS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        compression = Compression.from_spec(spec)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.025 * hvd.size(), momentum=0.9),
                                       named_parameters=[(f"{label}.{n}", p) for n, p in model.named_parameters()],
                                       compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        accuracy = []
        for _ in range(EPOCHS):
            order = torch.randperm(per_worker)
            for i in range(0, per_worker - 32 + 1, 32):
                batch = order[i:i + 32]
                opt.zero_grad()
                F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
                opt.step()
            with torch.no_grad():
                accuracy.append(float((model(x_test).argmax(1) == y_test).float().mean()))
        out[label] = {"accuracy": accuracy, "params": [p.detach().numpy().copy() for p in model.parameters()],
                      "realigned": int(sum(int(m.get("realigned", 0)) for m in compression.metrics().values())),
                      "bytes": compression.bytes_per_step().total}
    return out


@pytest.fixture(scope="module")
def trained():
    # 2 x 220 steps: about 30 s on 2 shared cores; the launch is killed at the timeout.
    return run(worker, np=2, timeout=max(300.0, default_timeout()))


def test_decay_keeps_up_where_plain_error_feedback_swings(trained):
    plain, decay = trained[0]["plain"]["accuracy"], trained[0]["decay"]["accuracy"]
    last = lambda acc: sum(acc[-3:]) / 3  # noqa: E731
    assert last(decay) >= 0.96, decay
    assert last(decay) >= last(plain) + 0.01, (plain, decay)
    # Plain error feedback swings between epochs; the decayed one moves less after epoch 5.
    swing = lambda acc: max(abs(b - a) for a, b in zip(acc[4:], acc[5:]))  # noqa: E731
    assert swing(decay) < swing(plain), (plain, decay)


def test_ranks_agree_and_bytes_do_not_change(trained):
    import numpy as np
    for label in SPECS:
        assert trained[0][label]["accuracy"] == trained[1][label]["accuracy"]
        for a, b in zip(trained[0][label]["params"], trained[1][label]["params"]):
            assert np.array_equal(a, b), label
        assert trained[0][label]["realigned"] == 0
    assert trained[0]["decay"]["bytes"] == trained[0]["plain"]["bytes"]
