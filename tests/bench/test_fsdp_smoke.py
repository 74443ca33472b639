"""One tiny FSDP sweep end to end (issue 37 item 6): ``tta --workloads lm-comm --compressors
off --fsdp-hooks "fp16;thc"`` on 4 workers as 2 replicas x 2 shards, a few steps, on the
emulated network with one host per replica (loopback without root).

Checks that both FSDP rows ran under FSDP (system, spec, mesh, the worker module), that the
THC row's target and time cap came from FP16-FSDP (1.02 x its final rolling perplexity; 1.5 x
its TTA), the bytes per step across replicas (FP16-FSDP: 2 bytes a coordinate of each rank's
shard; THC: a fraction of it) and within a replica (the float16 reduce-scatter, the same for
both), and, emulated, that the network put each replica's 2 ranks on one host.
"""
import csv
import json
import sys

import pytest

from hvd_gradcomp.bench import netem
from tests.hvdrun import run_process

STEPS = 6
PARAMS = 470528  # lm-comm's transformer; every dim 0 is even, so the 2 shards are unpadded


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    (out / "doc.md").write_text("intro\n<!-- tta-fsdp:start -->\n<!-- tta-fsdp:end -->\n")
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--workloads", "lm-comm", "--compressors", "off",
           "--fsdp-hooks", "fp16;thc;thc with overlap;thc with delay(1)", "--workers", "4", "--fsdp-mesh", "2x2", "--bandwidth", "200",
           "--out", str(out), "--no-progress", "--skip-link-check",
           "--update-doc", str(out / "doc.md"), "--doc-block", "tta-fsdp",
           "--worker-args", f"--max-steps {STEPS} --eval-every 2 --batch-size 4"]
    return out, run_process(cmd, timeout=300)


def _runs(out):
    with open(out / "runs.csv") as f:
        return {r["label"]: r for r in csv.DictReader(f)}


def test_fsdp_rows_ran(sweep):
    out, res = sweep
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = _runs(out)
    assert list(runs) == ["FP16-FSDP", "thc on FSDP", "thc on FSDP, overlap", "thc on FSDP, delay(1)"]
    fp16, thc, over = runs["FP16-FSDP"], runs["thc on FSDP"], runs["thc on FSDP, overlap"]
    late = runs["thc on FSDP, delay(1)"]
    assert [r["system"] for r in runs.values()] == ["fsdp"] * 4
    assert fp16["spec"] == "fsdp:fp16" and thc["spec"] == "fsdp:thc" and over["spec"] == "fsdp:thc with overlap"
    assert late["spec"] == "fsdp:thc with delay(1)"
    for r in runs.values():
        assert r["status"] == "ok" and r["mesh"] == "2x2" and r["world_size"] == "4"
        assert int(r["params"]) == PARAMS and 0 < int(r["steps"]) <= STEPS
        assert float(r["compute_share"]) + float(r["codec_share"]) + float(r["comm_share"]) == pytest.approx(1.0)
    assert int(fp16["steps"]) == STEPS and float(fp16["codec_share"]) == 0  # FSDP's own collectives
    assert float(thc["codec_share"]) > 0 and float(over["codec_share"]) > 0  # our codec inside FSDP's hook
    assert float(late["codec_share"]) > 0
    # overlap=True delivers the blocking hook's gradients: the same losses step for step (where
    # the time cap stopped neither early)
    if over["steps"] == thc["steps"]:
        assert over["final_metric"] == thc["final_metric"]
    for run_id, flags in (("lm-comm-fsdp-fp16", "--compression fp16 --mesh 2x2"),
                          ("lm-comm-fsdp-thc", "--compression thc --mesh 2x2"),
                          ("lm-comm-fsdp-thc-with-overlap", "--compression thc --mesh 2x2 --overlap"),
                          ("lm-comm-fsdp-thc-with-delay-1", "--compression thc --mesh 2x2 --delay 1")):
        command = (out / "logs" / run_id / "command.txt").read_text()
        assert "-m hvd_gradcomp.bench.workers.fsdp_torch --workload lm-comm " + flags in command
    assert "FP16-FSDP" in res.stdout and "FSDP rows: HSDP" in res.stdout


def test_target_and_cap_came_from_fp16_fsdp(sweep):
    out, res = sweep
    runs = _runs(out)
    fp16, thc = runs["FP16-FSDP"], runs["thc on FSDP"]
    assert float(fp16["target"]) == pytest.approx(1.02 * float(fp16["final_metric"]))
    assert float(thc["target"]) == float(fp16["target"]) and float(fp16["target_vs_fp16"]) == 1.02
    data = json.loads((out / "results.json").read_text())
    assert data["sweep"]["fsdp_mesh"] == [2, 2] and set(data["sweep"]["stops"]) == {"lm-comm fsdp"}
    result = data["results"]["lm-comm-fsdp-thc"]
    cap = result["meta"]["stop_cap"]
    assert cap["target"] == pytest.approx(float(fp16["target"]), rel=1e-6) and cap["cap"] == 1.5
    assert cap["max_seconds"] == pytest.approx(1.5 * cap["fp16_tta_s"])
    assert result["meta"]["target"] == pytest.approx(cap["target"], rel=1e-5)  # the worker got it
    assert data["results"]["lm-comm-fsdp-fp16"]["meta"]["target"] is None  # FP16-FSDP runs its budget
    assert "every FSDP row after FP16-FSDP stopped at the target" in res.stdout
    assert "(1.02 x FP16-FSDP's final rolling metric in this sweep) for the FSDP rows" in res.stdout


def test_doc_block(sweep):
    out, _ = sweep
    block = (out / "doc.md").read_text()
    assert "| lm-comm | FP16-FSDP |" in block and "| lm-comm | thc on FSDP |" in block
    assert "FSDP rows: HSDP (FSDP2 fully_shard on a replicas x shards mesh, 2x2)" in block
    assert (out / "tta_lm-comm.png").read_bytes()[:4] == b"\x89PNG"


def test_bytes_per_step(sweep):
    out, _ = sweep
    runs = _runs(out)
    fp16, thc = runs["FP16-FSDP"], runs["thc on FSDP"]
    shard = PARAMS // 2
    assert int(fp16["bytes_per_step"]) == 2 * shard  # float16 all-reduce of this rank's shard
    assert int(fp16["bytes_reduce_scatter"]) == int(thc["bytes_reduce_scatter"]) == 2 * PARAMS
    # THC: 4-bit lanes in int32 words, the LayerNorm and bias shards below min_numel as fp16
    assert 2.5 < float(thc["fp16_bytes_ratio"]) < 4.0
    assert int(thc["bytes_per_step"]) * float(thc["fp16_bytes_ratio"]) == pytest.approx(2 * shard)


def test_network_puts_each_replica_on_one_host(sweep):
    out, res = sweep
    network = json.loads((out / "results.json").read_text())["sweep"]["network"]
    ok, _ = netem.emulation_available()
    if not ok:
        assert network["mode"] == "loopback" and "LOOPBACK" in res.stdout
        return
    assert network["mode"] == "netns" and network["ranks_per_host"] == 2 and network["hosts"] == 2
    assert "200 Mbit/s per host link, 2 hosts of 2 ranks" in network["note"] and "ranks 0-1, 2-3" in network["note"]


_PAIRS = """
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
inside = [dist.new_group([0, 1]), dist.new_group([2, 3])][r // 2]  # a replica's shard group
across = [dist.new_group([0, 2]), dist.new_group([1, 3])][r % 2]  # a shard's replicas
x = torch.ones(1 << 19)  # 2 MiB
out = {}
for name, group in (("inside", inside), ("across", across)):
    dist.all_reduce(x, group=group)  # connect
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    out[name] = time.perf_counter() - t0
    dist.barrier()
with open(sys.argv[1] + f".{r}", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not netem.emulation_available()[0], reason="needs root and network namespaces")
def test_hosts_link_is_slow_between_hosts_only(tmp_path):
    """2 hosts of 2 ranks at 50 Mbit/s: a 2 MiB all-reduce within a host (a replica's shard
    group) does not touch the rate limit; across hosts (a shard's replicas, both pairs at once
    through the same host links) it takes at least 2 MiB at 50 Mbit/s."""
    from hvd_gradcomp.bench import launch
    script = tmp_path / "pairs.py"
    script.write_text(_PAIRS)
    with netem.make_network(4, netem.LinkConfig(50), ranks_per_host=2) as net:
        run = launch.launch(net, [sys.executable, str(script), str(tmp_path / "t")], kind="ddp",
                            log_dir=str(tmp_path))
        assert run.wait(timeout=120) == 0, (tmp_path / "rank0.log").read_text()[-2000:]
    times = [json.loads((tmp_path / f"t.{r}").read_text()) for r in range(4)]
    floor = 2 * 2 ** 20 * 8 / 50e6  # 0.34 s: one pair's all-reduce alone through a 50 Mbit/s link
    for t in times:
        assert t["across"] > 0.9 * floor and t["inside"] < 0.5 * t["across"], times
