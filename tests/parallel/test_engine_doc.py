"""docs/writing-an-engine.md's worked engine, run as written, on 2 real Gloo ranks (one launch).

The doc's Python block is read from the file and executed in each rank, so the page cannot
drift from the codec's API: for every scheme the doc names, the engine's means are equal on
both ranks, `none`'s equal the exact mean, and the compressor's reports and checkpoint work
after it (``state_dict``, ``bytes_per_step``)."""
import os
import re

import pytest

from tests.ddprun import run
from tests.hvdrun import ROOT

DOC = os.path.join(ROOT, "docs", "writing-an-engine.md")
SPECS = ("none", "fp16", "thc", "topkc:0.5", "powersgd:2", "signsgd")


def _doc_engine():
    """The ``BucketMean`` class of the doc's (only) Python block."""
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 1, f"{DOC}: expected one python block, found {len(blocks)}"
    namespace = {"__name__": "writing_an_engine"}
    exec(compile(blocks[0], DOC, "exec"), namespace)  # noqa: S102 - our own doc, run as a user would
    return namespace["BucketMean"]


def worker():
    import torch
    import torch.distributed as dist
    from torch_backend import Compression
    BucketMean = _doc_engine()
    rank, out = dist.get_rank(), {}
    for spec in SPECS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        comp = Compression.from_spec(spec)
        engine = BucketMean(comp)
        steps = []
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            grads = [(n, torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
            exact = {}
            for n, g in grads:  # the exact mean, for `none`
                s = g.clone()
                dist.all_reduce(s)
                exact[n] = s / dist.get_world_size()
            means = engine(grads)
            steps.append({n: (means[n], exact[n]) for n, _ in grads})
        out[spec] = (steps, sorted(comp.state_dict()), comp.bytes_per_step())
    return out


@pytest.fixture(scope="module")
def results():
    return run(worker, np=2, timeout=600)


@pytest.mark.parametrize("spec", SPECS)
def test_doc_engine(results, spec):
    import torch
    (s0, keys0, b0), (s1, keys1, b1) = results[0][spec], results[1][spec]
    assert keys0 == keys1 and b0 == b1
    for step0, step1 in zip(s0, s1):
        assert step0.keys() == step1.keys()
        for name, (mean0, exact) in step0.items():
            assert torch.equal(mean0, step1[name][0]), (spec, name)  # the replicas agree
            if spec == "none":
                assert torch.equal(mean0, exact), name
            else:  # compressed: a mean of the right size, not the exact one
                assert torch.isfinite(mean0).all() and mean0.shape == exact.shape
