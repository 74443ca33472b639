"""Link calibration for adaptive schemes: the link's rate and latency, measured by the engine's
all-reduces, and the candidates' codec costs averaged over the ranks.

:func:`calibrate` is a function over a :class:`~hvd_gradcomp.codec.Codec` (the compressor's
``calibrate`` method calls it): it reads the codec's routing and primitives, and its
collectives go through ``codec.allreduce_host`` and ``codec.world`` (Horovod's, or a bound
engine's, e.g. DDP's).
"""
import logging

__all__ = ["calibrate"]

log = logging.getLogger("hvd_gradcomp")


def calibrate(codec, process_set=None, sizes=(1 << 10, 1 << 21), repeats: int = 3, like=None,
              cached: bool = False):
    """Measure the link for this compressor's ``auto`` schemes (:mod:`hvd_gradcomp.auto`).

    A collective outside compress: every rank of ``process_set`` calls it at the same
    point (the compressor's constructor does when ``auto`` has no ``bandwidth_gbit`` and
    Horovod is initialised; call it again to refresh the figures).

    Each size (float32 coordinates) is all-reduced ``repeats + 1`` times (the first is not
    timed); from the median seconds ``t1, t2`` of the two sizes and the ring's bytes per
    rank ``w1, w2`` (:func:`hvd_gradcomp.ring.ring_wire_bytes`): rate ``(w2 - w1) / (t2 -
    t1)`` bytes/s and latency ``t1 - w1 / rate`` s (>= 0); the large size once more as
    float16 gives the float16 rate (Gloo sums float16 in scalar code on CPUs), at most the
    float32 rate. All three are
    averaged over the ranks by one more all-reduce, so every rank holds the same
    :class:`~hvd_gradcomp.auto.Link`.
    Then each ``auto`` scheme times its candidates' codecs on a reference matrix
    (:meth:`~hvd_gradcomp.auto.AutoScheme.reference_costs`), averaged over the ranks by one
    all-reduce each: the start of its tensors (:func:`~hvd_gradcomp.auto.start_choice`).

    Args:
        codec: the compressor.
        process_set: the framework's process set of the gradients' all-reduces (None: global).
        sizes: two sizes, coordinates, small then large (default 4 KiB and 8 MiB).
        repeats: timed all-reduces per size (>= 1).
        like: a tensor on the device the gradients live on (default: the framework's
            default device; a CUDA tensor measures NCCL's path and times the ``auto``
            candidates' codecs on the GPU: on a GPU job built before its tensors exist,
            call ``calibrate(like=...)`` again with one).
        cached: reuse the figures an earlier ``calibrate()`` of this process measured for
            the same process set size, device and candidates
            (:data:`hvd_gradcomp.auto.CALIBRATIONS`), if every rank holds them (one
            1-value all-reduce asks); else measure, as without it. The constructor passes
            True, so building many compressors measures once; call ``calibrate()`` to
            refresh the figures.

    Returns:
        The :class:`~hvd_gradcomp.auto.Link`, also given to every ``auto`` scheme.
    """
    import math
    import time
    from .auto import CALIBRATIONS, Link
    from .ring import ring_wire_bytes
    size, _ = codec.world(process_set)
    autos = [s for s in codec.routing.schemes() if s.adaptive]
    where = (codec.ops.name, size, getattr(process_set, "process_set_id", 0), str(getattr(like, "device", None)))
    if cached and size > 1:
        known = CALIBRATIONS.get(where)
        have = known is not None and all(c in known[1] for s in autos for c in s.specs)
        missing = codec.allreduce_host(codec.ops.constant([0.0 if have else 1.0], "float32", like), False,
                                       "hvd_gradcomp.calibrate.cached", process_set)
        if codec.ops.to_host(missing)[0] == 0:
            for scheme in autos:
                scheme.set_link(known[0], [known[1][c] for c in scheme.specs])
            return known[0]
    if size <= 1:
        link = Link(math.inf, 0.0)  # one rank: nothing crosses a link
    else:
        seconds = []
        for n, dtype in ((sizes[0], "float32"), (sizes[1], "float32"), (sizes[1], "float16")):
            x = codec.ops.zeros((n,), dtype, like)
            runs = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                y = codec.allreduce_host(x, False, f"hvd_gradcomp.calibrate.{n}.{dtype}", process_set)
                codec.ops.to_host(codec.ops.sum(codec.ops.cast(y[:1], "float32"), None))
                if i:
                    runs.append(time.perf_counter() - start)
            seconds.append(sorted(runs)[len(runs) // 2])
        w1, w2, w16 = ring_wire_bytes(4 * sizes[0], size), ring_wire_bytes(4 * sizes[1], size), \
            ring_wire_bytes(2 * sizes[1], size)
        rate = (w2 - w1) / max(seconds[1] - seconds[0], 1e-9)
        latency = max(seconds[0] - w1 / rate, 0.0)
        # At most the float32 rate: the same bytes through the same ring, summed no faster.
        # (A latency estimate above the float16 run's median, from a slow small all-reduce on
        # a busy host, would otherwise read as an infinite float16 rate.)
        rate16 = w16 / max(seconds[2] - latency, w16 / rate)
        agreed = codec.allreduce_host(codec.ops.constant([rate, latency, rate16], "float64", like),
                                      True, "hvd_gradcomp.calibrate.link", process_set)
        link = Link(*codec.ops.to_host(agreed))
        if codec.world(None)[1] == 0:
            log.info("hvd_gradcomp auto: link measured over %d ranks: %.1f MB/s (float16 "
                     "payloads %.1f MB/s), %.3f ms per all-reduce", size,
                     link.bytes_per_second / 1e6, link.fp16_bytes_per_second / 1e6,
                     link.latency_s * 1e3)
    costs_by_spec = CALIBRATIONS.get(where, (None, {}))[1]
    for i, scheme in enumerate(codec.routing.schemes()):
        if not scheme.adaptive:
            continue
        costs = None
        if size > 1:  # each candidate's codec on the reference matrix, the ranks' mean
            costs = codec.ops.to_host(codec.allreduce_host(
                codec.ops.constant(scheme.reference_costs(codec.ops, like), "float64", like),
                True, f"hvd_gradcomp.calibrate.codecs.{i}", process_set))
        scheme.set_link(link, costs)
        if costs is not None:
            costs_by_spec.update(zip(scheme.specs, costs))
    if size > 1:
        CALIBRATIONS[where] = (link, costs_by_spec)
    return link
