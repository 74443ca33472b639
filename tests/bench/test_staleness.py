"""The staleness study (hvd_gradcomp.bench.staleness): its rules, on a few steps of lm-comm."""
import pytest
import torch

from hvd_gradcomp.bench import staleness


def _weights(variant, workers, steps):
    """Rank 0's final weights after ``steps`` steps of ``variant``, and the run's record."""
    r, models = staleness.train(variant, workers, max_steps=steps, eval_every=steps)
    return [p.detach().clone() for p in models[0].parameters()], r


def test_eager_at_one_rank_is_blocking_bit_for_bit(one_thread):
    # one rank: mean_{t-1} - g_{t-1} + g_t is g_t exactly, so delay+eager is plain training
    a, ra = _weights("blocking", 1, 3)
    b, rb = _weights("delay+eager", 1, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert ra["evals"] == rb["evals"]


def test_delay_differs_and_keeps_ranks_equal(one_thread):
    a, _ = _weights("blocking", 2, 3)
    b, rb = _weights("delay", 2, 3)
    c, rc = _weights("delay+predict", 2, 3)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(b, c))  # the prediction moved the gradient
    assert rb["divergence"] == 0.0 and rc["divergence"] == 0.0
    _, re = _weights("delay+eager", 2, 3)
    assert re["divergence"] > 0.0  # eager ranks drift apart, and the run says by how much


def test_steps_to_and_render():
    evals = [[0, 50.0], [10, 9.0], [20, 7.0], [30, 6.0], [40, 5.0]]
    assert staleness.steps_to(evals, 7.0, window=2) == 30  # rolling (7 + 6) / 2 = 6.5
    assert staleness.steps_to(evals, 4.0, window=2) is None
    base = {"variant": "blocking", "workers": 2, "steps": 40, "evals": evals, "divergence": 0.0,
            "batch_size": 16, "seed": 0}
    late = dict(base, variant="delay", evals=[[0, 50.0], [10, 12.0], [20, 9.0], [30, 8.0], [40, 6.0]])
    text = staleness.render([late, base], target_vs_blocking=1.2, window=1)
    assert "| blocking | 40 | 5.000 | 30 | 1.00x |" in text  # target 6.0: reached at step 30
    assert "| delay | 40 | 6.000 | 40 | 1.33x |" in text
    with pytest.raises(ValueError, match="no blocking run"):
        staleness.render([late])


def test_a_variant_stops_at_the_target(one_thread):
    r = staleness.run_variant("delay", 1, max_steps=6, eval_every=2, target=1e9, window=1)
    assert r["steps"] == 2 and [e[0] for e in r["evals"]] == [0, 2]
    r = staleness.run_variant("delay", 1, max_steps=4, eval_every=2, target=1e-9, window=1)
    assert r["steps"] == 4  # never reached: the steps run out


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown variant 'delay2'"):
        staleness.run_variant("delay2", 2)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        staleness.run_variant("delay", 0)
    with pytest.raises(ValueError, match="overrun >= 1"):
        staleness.run_variant("delay", 2, overrun=0.5)
    with pytest.raises(SystemExit):
        staleness.main(["--variants", "delay"])  # no blocking run to set the target
