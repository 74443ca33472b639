"""The small training workload the multi-rank tests share (PyTorch, inside a Horovod worker):
scikit-learn's bundled digits (no download), each rank a strided shard, and a 64-32-10 tanh MLP
with the same initial weights on every rank."""


def digits(rank: int, size: int):
    """``(x, y, shard)``: all 1,797 images as float32 [1797, 64] in [0, 1], their labels
    int64 [1797], and the slice of them that is rank ``rank``'s of ``size``."""
    import torch
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    return x, torch.tensor(data.target), slice(rank, None, size)


def mlp(seed: int = 0):
    """The 64-32-10 tanh MLP, initialised from ``torch.manual_seed(seed)``."""
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def train(hvd, compression, steps: int, lr: float = 0.5) -> float:
    """``steps`` full-shard SGD steps of :func:`mlp` under ``hvd.DistributedOptimizer`` with
    ``compression``; returns the cross-entropy on all the data after them."""
    import torch
    x, y, shard = digits(hvd.rank(), hvd.size())
    net = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr),
                                   named_parameters=net.named_parameters(), compression=compression)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(net(x), y))
