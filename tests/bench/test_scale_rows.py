"""The scale study's rows beyond FP16, THC and TopKC (issue 50): bf16, THC without error
feedback and with 4 levels a rank, simulated at small N; and ``lm-shakespeare`` in the real
harness (``python -m hvd_gradcomp.bench tta``), two Horovod workers, a few steps."""
import json
import sys

import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp.bench import data, scale, tta  # noqa: E402
from tests.hvdrun import run_process  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_rows_listed_with_their_options():
    assert {"bf16", "thc:error_feedback=false", scale.THC_4_LEVELS} <= set(scale.ROWS)
    assert scale.ROWS[0] == "fp16"
    assert scale.THC_4_LEVELS in tta.ADAM_ROWS  # the 4-level row the real harness runs


def test_thc_rows_at_three_ranks():
    """At 3 ranks: every row decodes the same mean on every rank; without error feedback THC
    sends THC's bytes; with 4 levels a rank (lanes for the other ranks) fewer."""
    res = {spec: scale.simulate("lm-comm", spec, 3, max_steps=2, eval_every=2, batch_size=1)
           for spec in ("thc", "thc:error_feedback=false", scale.THC_4_LEVELS)}
    for spec, r in res.items():
        assert r["ranks_agree"] and r["steps_run"] == 2 and r["stop_reason"] == "budget", spec
        assert all(map(lambda m: m == m and m < 1e4, r["evals"]["metric"])), spec
    assert res["thc:error_feedback=false"]["bytes"] == res["thc"]["bytes"]
    assert res[scale.THC_4_LEVELS]["bytes"]["payload"] < res["thc"]["bytes"]["payload"]
    # error feedback changes the second step's update: the evaluations after it differ
    assert res["thc:error_feedback=false"]["evals"]["metric"][-1] != res["thc"]["evals"]["metric"][-1]


def test_shakespeare_in_the_real_harness(tmp_path):
    """``--workloads lm-shakespeare`` runs the Shakespeare worker under Horovod (2 ranks) and
    records its corpus and FP16-relative target; skipped where the archive is not cached."""
    try:
        data.shakespeare_archive()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert tta.WORKLOADS["lm-shakespeare"][1] == "hvd_gradcomp.bench.workers.lm_shakespeare_torch"
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--workloads", "lm-shakespeare",
           "--compressors", "fp16", "--ddp-hooks", "off", "--no-comm-reference", "off", "--workers", "2",
           "--loopback", "--skip-link-check", "--out", str(tmp_path), "--no-progress",
           "--worker-args", "--max-steps 4 --batch-size 2 --eval-every 2"]
    res = run_process(cmd, timeout=600, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        saved = json.load(f)
    (run,) = [r for r in saved["results"].values() if r.get("meta")]
    meta = run["meta"]
    assert meta["workload"] == "lm-shakespeare" and meta["compression"] == "fp16"
    assert meta["world_size"] == 2 and meta["target_vs_fp16"] == 1.02
    assert run["evals"]["step"][-1] == 4 and all(1.0 < m < 1000.0 for m in run["evals"]["metric"]), run["evals"]
    assert "hamlet_gut" in json.dumps(run)  # the corpus described: Shakespeare's validation plays


# ---- update-sync rows (hvd_gradcomp/bench/scale_local.py) ----
def test_update_sync_one_sync_is_diloco_by_hand():
    """``none with update-sync(every=2)`` at 2 ranks: each rank steps AdamW on its own shard
    twice, then the outer Nesterov SGD (0.7, 0.9) steps the synced parameters with minus the
    mean change (float32, exact at 2 ranks); the evaluation sums each rank's shard."""
    import copy
    from hvd_gradcomp.bench.workers import torch_workloads
    res = scale.simulate("lm-comm", "none with update-sync(every=2)", 2, max_steps=2, eval_every=2,
                         seed=3, batch_size=2)
    assert res["steps_run"] == 2 and res["ranks_agree"] and res["every"] == 2
    torch.manual_seed(3)
    cls = torch_workloads.LMCommWorkload
    wls = [cls(r, 2, 3, 2) for r in range(2)]
    models = [wls[0].model()]
    models.append(copy.deepcopy(models[0]))
    theta = [p.detach().clone() for p in models[0].parameters()]
    opts = [torch_workloads.build_optimizer(wls[0], m.parameters(), cls.defaults["lr"], "") for m in models]
    scheds = [wls[0].schedule(o, res["budget_steps"]) for o in opts]
    iters = [w.batches(0) for w in wls]
    for step in (1, 2):
        for r in range(2):
            models[r].zero_grad(set_to_none=True)
            x, y = next(iters[r])
            wls[r].loss(models[r], x, y).backward()
            scheds[r].set(step)
            opts[r].step()
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        for th, a, b in zip(theta, models[0].parameters(), models[1].parameters()):
            th.grad = -(((a - th) + (b - th)) * 0.5)
        outer.step()
        for p, th in zip(models[0].parameters(), theta):
            p.copy_(th)
    judge = cls(0, 1, 3, 2)
    models[0].eval()
    assert res["evals"]["step"] == [0, 2]
    assert res["evals"]["metric"][1] == pytest.approx(judge.metric(*judge.evaluate(models[0])), rel=1e-6)


def test_update_sync_bytes_and_refusals():
    fp16 = scale.simulate("lm-comm", "fp16 with update-sync(every=8)", 2, max_steps=8, eval_every=8, batch_size=1)
    params = scale.model_params("lm-comm")
    assert fp16["bytes"]["payload"] == 2 * params / 8 and fp16["ranks_agree"]  # one sync's / H
    topkc = scale.simulate("lm-comm", "topkc:ratio=0.1 with update-sync(every=1)", 3, max_steps=2, eval_every=2,
                           batch_size=1)
    grad = scale.simulate("lm-comm", "topkc:ratio=0.1", 3, max_steps=1, eval_every=1, batch_size=1)
    assert topkc["bytes"] == grad["bytes"] and topkc["ranks_agree"]
    with pytest.raises(ValueError, match="overlapped"):
        scale.simulate("lm-comm", "fp16 with update-sync(every=2,overlap=true)", 2, max_steps=1)
    with pytest.raises(ValueError, match="tensor layout"):
        scale.simulate("lm-comm", "fp16 with update-sync(every=2)", 2, max_steps=1, layout="bucket")
    cal = scale.calibrate("lm-comm", "fp16 with update-sync(every=8)", 2, batch_size=1, reps=1)
    assert cal["codec_s"] > 0 and cal["compute_s"] > 0
