"""The one ring all-reduce cost function, and its two users: the link check and the scale model."""
import pytest

from hvd_gradcomp.bench import linkcheck, model, netem
from hvd_gradcomp.ring import ring_allreduce_seconds, ring_rounds, ring_wire_bytes


def test_ring_wire_bytes_and_rounds():
    assert ring_wire_bytes(100e6, 2) == pytest.approx(100e6)  # 2 ranks: the whole buffer once
    assert ring_wire_bytes(100e6, 4) == pytest.approx(150e6)  # 2 * 3/4
    assert ring_wire_bytes(100e6, 1) == 0.0 and ring_wire_bytes(100e6, 0) == 0.0
    assert ring_rounds(2) == 2 and ring_rounds(8) == 14 and ring_rounds(1) == 0


def test_ring_allreduce_seconds_values():
    # 100 MB over 1 Gbit/s (125e6 B/s) between 2 ranks: 0.8 s.
    assert ring_allreduce_seconds(100e6, 2, 125e6) == pytest.approx(0.8)
    # 4 ranks, 1 ms per collective, 3 collectives: 3 ms + 1.5 * 100e6 / 125e6 = 1.203 s.
    assert ring_allreduce_seconds(100e6, 4, 125e6, latency_s=1e-3, collectives=3) == pytest.approx(1.203)
    assert ring_allreduce_seconds(100e6, 1, 125e6, latency_s=1.0) == 0.0
    with pytest.raises(ValueError, match="bytes_per_second must be > 0, got 0"):
        ring_allreduce_seconds(1.0, 2, 0)


def test_link_check_model_is_the_ring_with_one_latency_per_round():
    # 2 ranks: each sends the whole buffer once; 100 MB over 1 Gbit/s = 0.8 s.
    assert linkcheck.link_model_seconds(100e6, 2, netem.LinkConfig(1000)) == pytest.approx(0.8)
    # 4 ranks, 1 ms one-way: 1.2 s of bandwidth + 2 (4-1) rounds of 1 ms.
    assert linkcheck.link_model_seconds(100e6, 4, netem.LinkConfig(1000, 1)) == pytest.approx(1.2 + 0.006)
    assert linkcheck.link_model_seconds(100e6, 1, netem.LinkConfig(1000)) == 0.0
    # The link check's 500 Mbit/s, 30 MiB check of the committed demo run: 0.503 s.
    assert linkcheck.link_model_seconds(31457280, 2, netem.LinkConfig(500)) == pytest.approx(0.50331648)


def test_scale_model_and_link_check_agree_on_the_same_ring():
    # The scale model with ring hops, no fixed cost and the link's latency per hop is the
    # link check's model, exactly (one function computes both).
    net = model.Network(alpha_s=0.0, hop_s=2e-3, hops="ring")
    for workers in (2, 4, 16):
        ours = model.allreduce_time(64e6, workers, 0.5, net)  # 0.5 Gbit/s = 500 Mbit/s
        theirs = linkcheck.link_model_seconds(64e6, workers, netem.LinkConfig(500, 2))
        assert ours == theirs
    assert model.allreduce_time(64e6, 2, 0.5, net) == pytest.approx(1.024 + 0.004)
