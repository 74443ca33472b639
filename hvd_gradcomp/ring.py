"""Ring all-reduce cost: the one formula the link check and the scale model share.

A bandwidth-optimal ring all-reduce of ``b`` bytes over ``N`` workers (reduce-scatter, then
all-gather) has every worker send, and receive, ``2 (N-1)/N * b`` bytes over its own link in
``2 (N-1)`` rounds. On links of ``B`` bytes/s, with a fixed cost ``lat`` per collective:

    t = collectives * lat + 2 (N-1)/N * b / B

Used by the core (``auto``'s decisions) and the harness. Callers choose ``lat``: the link check (:func:`hvd_gradcomp.bench.linkcheck.link_model_seconds`) pays the
emulated one-way link latency once per round, ``2 (N-1) * latency``; the scale model
(:func:`hvd_gradcomp.bench.model.latency`) uses ``alpha + hop * hops(N)``, whose ``ring`` hops are
:func:`ring_rounds`.
"""

__all__ = ["ring_rounds", "ring_wire_bytes", "ring_allreduce_seconds"]


def ring_rounds(workers: int) -> int:
    """Message rounds of one ring all-reduce over ``workers``: ``2 (N-1)``; 0 for N <= 1."""
    return 2 * (workers - 1) if workers > 1 else 0


def ring_wire_bytes(nbytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``.

    ``2 (N-1)/N * nbytes``; 0.0 for a single worker (no collective).
    """
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes


def ring_allreduce_seconds(nbytes: float, workers: int, bytes_per_second: float,
                           latency_s: float = 0.0, collectives: int = 1) -> float:
    """Seconds for ``collectives`` ring all-reduces that move ``nbytes`` in total.

    ``collectives * latency_s + 2 (N-1)/N * nbytes / bytes_per_second``; 0.0 for one worker.

    Args:
        nbytes: bytes reduced, summed over the collectives (>= 0).
        workers: N, ranks in the ring.
        bytes_per_second: each worker's link rate, bytes/s, each direction.
        latency_s: fixed cost of one collective, seconds (what the caller's model says).
        collectives: how many collectives pay ``latency_s``.

    Raises:
        ValueError: ``bytes_per_second`` <= 0 (with more than one worker).
    """
    if workers <= 1:
        return 0.0
    if not bytes_per_second > 0:
        raise ValueError(f"ring: bytes_per_second must be > 0, got {bytes_per_second}")
    return collectives * latency_s + ring_wire_bytes(nbytes, workers) / bytes_per_second
