"""Review of the bucketed DDP codec (issue 33): many buckets, DDP's bucket rebuild, checkpoints
across bucket sizes, loss scaling, fp16 warm-up, mixed precision, unused parameters, Join.

One 2-rank Gloo launch (tests/ddprun.py, killed at its timeout). The probe model's loss is
``sum(p * G_r[p])`` over its parameters in a forward order that differs from their
registration order (as in most real models), so DDP's rebuilt buckets after the first step
order the parameters otherwise than its first buckets. Checks: error feedback's balance
(delivered + the ranks' mean pending error feedback = the sum of the mean gradients), the
bytes all-reduced against ``bytes_per_step()``/``wire_bytes()``, resumed totals.
"""
import numpy as np
import pytest

from tests.ddprun import run
from tests.parallel.ddp_probe import grads_of
from tests.parallel.ddp_review_worker import BALANCE_SPECS, FOUR, FROZEN, HALF, JOIN_BATCHES, MANY, SKIPPED, STEPS, _grads, review_worker


@pytest.fixture(scope="module")
def review(tmp_path_factory):
    return run(review_worker, np=2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=900)


def _rec(review, key):
    for r in review:
        assert key not in r["errors"], r["errors"][key]
    return [r[key] for r in review]


def _truth(shapes, steps, half=(), skip_odd=(), batches=None, first=0):
    out = {}
    for n in shapes:
        total = 0.0
        for t in range(first, first + steps):
            if t % 2 and n in skip_odd:
                continue
            ranks = [r for r in (0, 1) if batches is None or t < batches[r]]
            total = total + sum(_grads(r, t, shapes, half)[n].double().numpy() for r in ranks) / 2
        out[n] = total
    return out


def _check_balance(recs, shapes, truth, frozen=(), steps=STEPS):
    for n, shape in shapes.items():
        if n in frozen:
            continue
        delivered = sum(o[n] for o in recs[-1]["outs"])
        pending = [r["owed"].get(n) for r in recs]
        if pending[0] is not None:
            delivered = delivered + (pending[0] + pending[1]).reshape(shape) / 2
        bound = steps * 2.0 ** -10 * np.abs(truth[n]).max() + 1e-5
        err = np.abs(delivered - truth[n]).max()
        assert err <= bound, (n, err, bound)


def _check_ranks_equal(recs, shapes):
    for a, b in zip(recs[0]["outs"], recs[1]["outs"]):
        for n in shapes:
            np.testing.assert_array_equal(a[n], b[n], err_msg=n)


def _check_bytes(recs, users=0):
    """The bytes all-reduced in the last step are bytes_per_step()'s plus the hook's users
    count (``users`` parameters, 8 bytes each, under find_unused_parameters / static_graph:
    documented in torch_backend/ddp.py), and wire_bytes() sums to bytes_per_step() with one
    entry per parameter."""
    for r in recs:
        last = r["reports"][-1]
        sent = sum(b for _, b in r["calls"][-1])
        assert sent == last["bytes"] + 8 * users, (r["calls"][-1], last["bytes"])
        assert last["wire_sum"] == last["bytes"]


@pytest.mark.parametrize("per_tensor", [False, True], ids=["bucketed", "per-tensor"])
def test_rebuild_swaps_middle(review, per_tensor):
    """DDP's rebuilt bucket keeps its first and last parameter and count but swaps two in the
    middle: the hook must not reuse the first layout's plan."""
    recs = _rec(review, ("four", per_tensor))
    layouts = recs[0]["layouts"]
    assert layouts[0] != layouts[1] and layouts[0][0] == layouts[1][0] and layouts[0][-1] == layouts[1][-1]
    _check_ranks_equal(recs, FOUR)
    # p1 (64 values) goes as fp16 at every step: the plain mean up to fp16 rounding
    for t, o in enumerate(recs[0]["outs"]):
        mean = (grads_of(0, t, FOUR)["p1"] + grads_of(1, t, FOUR)["p1"]).double().numpy() / 2
        np.testing.assert_allclose(o["p1"], mean, rtol=2e-3, atol=1e-3, err_msg=f"step {t}")
    _check_balance(recs, FOUR, _truth(FOUR, STEPS))


@pytest.mark.parametrize("spec", BALANCE_SPECS)
def test_many_buckets_balance(review, spec):
    recs = _rec(review, ("many", spec))
    assert recs[0]["layouts"][:10] != recs[0]["layouts"][-10:]  # the rebuild regrouped
    _check_ranks_equal(recs, MANY)
    _check_balance(recs, MANY, _truth(MANY, STEPS))


@pytest.mark.parametrize("spec", BALANCE_SPECS)
def test_many_buckets_bytes(review, spec):
    recs = _rec(review, ("many", spec))
    _check_bytes(recs)
    for r in recs:
        last = r["reports"][-1]
        assert last["wire_keys"] == sorted(MANY), last["wire_keys"]
        assert set(last["metrics_keys"]) <= set(last["groups"]) | set(MANY), last["metrics_keys"]


@pytest.mark.parametrize("key", [("many per-tensor", "thc"), ("view", "topkc:0.1"), ("static", "thc")])
def test_configs_balance(review, key):
    recs = _rec(review, key)
    _check_ranks_equal(recs, MANY)
    _check_balance(recs, MANY, _truth(MANY, STEPS))
    _check_bytes(recs, users=len(MANY) if key[0] == "static" else 0)


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_mixed_precision(review, spec):
    recs = _rec(review, ("mixed", spec))
    _check_ranks_equal(recs, MANY)
    _check_balance(recs, MANY, _truth(MANY, STEPS, half=HALF), frozen=FROZEN)
    _check_bytes(recs)
    for r in recs:
        assert not np.any(r["outs"][-1]["l2.bias"])
        assert "l2.bias" not in r["reports"][-1]["wire_keys"]


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc", "signsgd"])
def test_loss_scale(review, spec):
    plain, scaled = _rec(review, ("many", spec)), _rec(review, ("scaled", spec))
    for p, s in zip(plain, scaled):
        for a, b in zip(p["outs"], s["outs"]):
            for n in MANY:  # float16 outputs: the unscaled run rounds to float16 subnormals
                np.testing.assert_allclose(b[n] / 256.0, a[n], rtol=0, atol=2.0 ** -24, err_msg=n)
        for n, res in p["owed"].items():
            if res is not None:
                np.testing.assert_array_equal(s["owed"][n], res, err_msg=n)


def test_warmup_steps(review):
    """fp16_warmup=2: two fp16 steps, then THC's int32 words, bucketed as per tensor."""
    for bucketed, alone in zip(_rec(review, ("warmup", False)), _rec(review, ("warmup", True))):
        first = [next(t for t, c in enumerate(r["calls"]) if any(d == "torch.int32" for d, _ in c))
                 for r in (bucketed, alone)]
        assert first[1] == 2
        assert first[0] == first[1], f"bucketed: THC from step {first[0]}, per tensor: from step {first[1]}"
    recs = _rec(review, ("warmup", False))
    _check_balance(recs, MANY, _truth(MANY, STEPS))
    _check_bytes(recs)


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_unused_in_group(review, spec, view):
    recs = _rec(review, ("unused", spec, view))
    _check_ranks_equal(recs, MANY)
    _check_balance(recs, MANY, _truth(MANY, STEPS, skip_odd=SKIPPED))


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_unused_per_tensor(review, spec):
    recs = _rec(review, ("unused per-tensor", spec))
    _check_ranks_equal(recs, MANY)
    _check_balance(recs, MANY, _truth(MANY, STEPS, skip_odd=SKIPPED))


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_join_bucketed(review, spec):
    recs = _rec(review, ("join", spec))
    assert [len(r["outs"]) for r in recs] == [JOIN_BATCHES[0], JOIN_BATCHES[1]]
    for n in MANY:  # the joined rank's error feedback stays as it was
        if recs[0]["at_join"][n] is not None:
            np.testing.assert_array_equal(recs[0]["owed"][n], recs[0]["at_join"][n], err_msg=n)
    _check_balance(recs, MANY, _truth(MANY, max(JOIN_BATCHES.values()), batches=JOIN_BATCHES),
                   steps=max(JOIN_BATCHES.values()))


@pytest.mark.parametrize("target", ["same", "cap", "per_tensor", "fresh"])
@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_checkpoint_across_buckets(review, spec, target):
    """delivered (x2 ranks) + every rank's pending error feedback after the two resumed steps:
    the same for the continued and the resumed run."""
    recs = _rec(review, ("ckpt", spec))
    for n, shape in MANY.items():
        totals = []
        for which in ("continued", target):
            delivered = 2 * sum(o[n] for o in recs[0][which]["outs"])
            pend = [r[which]["owed"].get(n) for r in recs]
            if pend[0] is not None:
                delivered = delivered + (pend[0] + pend[1]).reshape(shape)
            totals.append(delivered)
        bound = 2.0 ** -10 * 2 * np.abs(totals[0]).max() + 1e-5
        np.testing.assert_allclose(totals[1], totals[0], rtol=0, atol=bound, err_msg=n)


def _check_same_totals(a, b, steps=2):
    """a, b: [rank 0's record, rank 1's] of two runs over the same steps."""
    for n, shape in MANY.items():
        totals = []
        for recs in (a, b):
            total = 2 * sum(o[n] for o in recs[0]["outs"])
            pend = [r["owed"].get(n) for r in recs]
            if pend[0] is not None:
                total = total + (pend[0] + pend[1]).reshape(shape)
            totals.append(total)
        bound = 2.0 ** -10 * steps * np.abs(totals[0]).max() + 1e-5
        np.testing.assert_allclose(totals[1], totals[0], rtol=0, atol=bound, err_msg=n)


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_reload_into_running(review, spec):
    """load_state_dict into the running bucketed compressor (same layout): an exact replay."""
    recs = _rec(review, ("ckpt", spec))
    for r in recs:
        for a, b in zip(r["continued"]["outs"], r["reload"]["outs"]):
            for n in MANY:
                np.testing.assert_array_equal(b[n], a[n], err_msg=n)


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_per_tensor_checkpoint_into_running(review, spec):
    recs = _rec(review, ("ckpt", spec))
    _check_same_totals([r["from_per_tensor"][0] for r in recs], [r["from_per_tensor"][1] for r in recs])


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc"])
def test_checkpoint_of_first_layout(review, spec):
    recs = _rec(review, ("early", spec))
    _check_same_totals([r["continued"] for r in recs], [r["same"] for r in recs])


def test_mixed_precision_scaled(review):
    plain, scaled = _rec(review, ("mixed", "thc")), _rec(review, ("mixed scaled", "thc"))
    for p, s in zip(plain, scaled):
        for a, b in zip(p["outs"], s["outs"]):
            for n in MANY:  # float16 outputs: the unscaled run rounds to float16 subnormals
                np.testing.assert_allclose(b[n] / 256.0, a[n], rtol=0, atol=2.0 ** -24, err_msg=n)


@pytest.mark.parametrize("first", [0, 1])
def test_join_before_rebuild(review, first):
    recs = _rec(review, ("join early", first))
    batches = {first: 1, 1 - first: 4}
    assert [len(r["outs"]) for r in recs] == [batches[0], batches[1]]
    other = recs[1 - first]
    _check_balance([recs[first], other], MANY, _truth(MANY, 4, batches=batches), steps=4)


def test_no_sync_many_buckets(review):
    recs = _rec(review, ("no_sync", "topkc:0.1"))
    _check_ranks_equal(recs, MANY)
    truth = {n: sum(grads_of(r, 10 * t + k, MANY)[n].double().numpy() for r in (0, 1) for t in range(3)
                    for k in range(3)) / 2 for n in MANY}
    _check_balance(recs, MANY, truth, steps=3)


def test_unused_on_one_rank(review):
    recs = _rec(review, ("unused rank 1", "thc"))
    _check_ranks_equal(recs, MANY)
    truth = {}
    for n in MANY:
        truth[n] = sum((grads_of(0, t, MANY)[n] + (0 if (t % 2 and n in SKIPPED) else grads_of(1, t, MANY)[n]))
                       .double().numpy() / 2 for t in range(STEPS))
    _check_balance(recs, MANY, truth)


@pytest.mark.parametrize("spec", ["topkc:0.1", "thc", "fp16"])
def test_bfloat16_model(review, spec):
    import torch
    recs = _rec(review, ("bf16", spec))
    _check_ranks_equal(recs, MANY)
    truth = {n: sum(sum(grads_of(r, t, MANY)[n].to(torch.bfloat16).double().numpy() for r in (0, 1)) / 2
                    for t in range(STEPS)) for n in MANY}
    for n, shape in MANY.items():  # bfloat16 outputs: 2**-8 relative rounding per step
        total = sum(o[n] for o in recs[0]["outs"])
        pending = [r["owed"].get(n) for r in recs]
        if pending[0] is not None:
            total = total + (pending[0] + pending[1]).reshape(shape) / 2
        assert np.abs(total - truth[n]).max() <= STEPS * 2.0 ** -7 * np.abs(truth[n]).max(), n


def test_changing_loss_scale_with_unused(review):
    plain, scaled = _rec(review, ("unused plain", "topkc:0.1")), _rec(review, ("rescaled", "topkc:0.1"))
    for p, s in zip(plain, scaled):
        for a, b in zip(p["outs"], s["outs"]):
            for n in MANY:
                np.testing.assert_array_equal(b[n], a[n], err_msg=n)
        for n, res in p["owed"].items():
            if res is not None:
                np.testing.assert_array_equal(s["owed"][n], res, err_msg=n)


@pytest.mark.parametrize("what", ["thc", "thc per-tensor", "fp16", "plain DDP"])
def test_join_with_unused(review, what):
    recs = _rec(review, ("join unused", what))
    for n in MANY:
        if recs[0]["at_join"][n] is not None:
            np.testing.assert_array_equal(recs[0]["owed"][n], recs[0]["at_join"][n], err_msg=n)
    _check_balance(recs, MANY, _truth(MANY, 4, skip_odd=SKIPPED, batches=JOIN_BATCHES), steps=4)
