"""``hvd.elastic`` with the ``auto`` compressor survives a worker joining (issue 28, item 1).

One real elastic launch, PyTorch over Gloo on localhost: ``horovodrun --gloo -np 2 --min-np 2
--max-np 3 --host-discovery-script <script>``. The discovery script offers ``localhost:2``
until a marker file exists, then ``localhost:3``; the training script creates the marker at
step 5 and waits at step 8 (up to a bound) for the third worker, so ``auto``'s probes and
decisions (warmup=3, every=4) happen both before and after the join. The link is given as
slow (no calibration) and the step gate off, so the first layer's weight goes to TopKC
before the join: its payload is not fp16's, and a worker out of step would mismatch shapes. The new worker builds
a fresh ``auto`` compressor (no saved state) while the others keep theirs: ``auto``'s count
lane and sync step must realign them, never a shape mismatch or a reset loop.

Asserts: exit 0 within the timeout, the world size reached 3, every final rank's parameters
are equal, no step's reduced gradient was non-finite, ``auto`` decided on 2 and on 3 ranks,
the new worker realigned every tensor to rank 0's schedule, and after it every rank took the
same decisions.
"""
import json
import sys
import textwrap

import numpy as np
import pytest

from tests.hvdrun import run_command

pytest.importorskip("horovod.torch")

TIMEOUT = 120.0
STEPS = 20

DISCOVERY = """#!/bin/sh
if [ -e "{marker}" ]; then echo localhost:3; else echo localhost:2; fi
"""

TRAIN = textwrap.dedent('''
    import json, logging, os, sys, time
    import torch
    import horovod.torch as hvd
    from torch_backend import Compression

    OUT, MARKER, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    comp = Compression.auto(candidates="fp16|topkc:0.1", bandwidth_gbit=0.0001, latency_ms=0.1,
                            warmup=3, every=4, step_penalty=0, min_numel=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    log = {"sizes": [], "nonfinite": [], "resets": 0, "realigned": []}

    class Realigned(logging.Handler):
        def emit(self, record):
            if "realigned" in record.getMessage():
                log["realigned"].append(record.getMessage())

    logging.getLogger("hvd_gradcomp").setLevel(logging.INFO)
    logging.getLogger("hvd_gradcomp").addHandler(Realigned())

    def on_reset():
        log["resets"] += 1

    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            step, rank, size = state.step, hvd.rank(), hvd.size()
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            bad = not all(torch.isfinite(p.grad).all().item() for p in model.parameters())
            log["sizes"].append([step, size, len(comp.decisions())])
            if bad:
                log["nonfinite"].append([step, size])
            if step == 5 and rank == 0:
                open(MARKER, "w").close()
            if step == 8:
                deadline = time.monotonic() + 40
                while hvd.size() < 3 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    state.check_host_updates()
            state.step = step + 1
            state.commit()

    train(state)
    params = [p.detach().double().flatten().tolist() for p in model.parameters()]
    with open(os.path.join(OUT, f"rank-{hvd.rank()}.json"), "w") as f:
        json.dump({"rank": hvd.rank(), "size": hvd.size(), "params": params,
                   "decided": [[d["key"], d["step"], d["scheme"]] for d in comp.decisions()], **log}, f)
''')


def test_elastic_auto_survives_a_worker_joining(tmp_path):
    marker = tmp_path / "grow"
    discovery = tmp_path / "discover.sh"
    discovery.write_text(DISCOVERY.format(marker=marker))
    discovery.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # run_command: horovodrun -np 2 --gloo <these>, every process of it killed at the timeout.
    argv = ["--min-np", "2", "--max-np", "3",
            "--host-discovery-script", str(discovery), "--network-interface", "lo",
            "--start-timeout", "60", "--elastic-timeout", "60",
            sys.executable, str(script), str(out_dir), str(marker), str(STEPS)]
    proc = run_command(argv, np=2, timeout=TIMEOUT)
    rc, output = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, f"horovodrun exited with {rc}\n{output[-6000:]}"
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2], output[-6000:]
    assert all(r["size"] == 3 for r in results)
    for r in results:
        assert r["nonfinite"] == [], (r["rank"], r["nonfinite"])
    # The original workers ran steps on 2 ranks, then all on 3, and auto decided in both.
    for r in results:
        sizes = r["sizes"]  # [step, world size, auto decisions taken so far] per step run
        three = [d for _, size, d in sizes if size == 3]
        assert three and three[-1] > three[0], (r["rank"], sizes)
        if r["rank"] in (0, 1):
            two = [d for _, size, d in sizes if size == 2]
            assert two and two[-1] > 0, (r["rank"], sizes)
    # A lossy choice (TopKC, whose payload is not fp16's shape) was in use before the join, so
    # the new worker, starting fresh, had to take rank 0's schedule: it says so for every
    # tensor, and from then on every rank takes the same decisions at the same steps.
    by_rank = {r["rank"]: r for r in results}
    assert any(step < 8 and scheme != "fp16" for _, step, scheme in by_rank[0]["decided"]), by_rank[0]["decided"]
    assert len(by_rank[2]["realigned"]) == 4, by_rank[2]["realigned"]
    first = min(step for _, step, _ in by_rank[2]["decided"])
    after = [[d for d in r["decided"] if d[1] >= first] for r in results]
    assert after[0] and after[1] == after[0] and after[2] == after[0], after
    ref = [np.asarray(p) for p in results[0]["params"]]
    for r in results[1:]:
        for a, b in zip(ref, r["params"]):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"rank {r['rank']} differs from rank 0")
