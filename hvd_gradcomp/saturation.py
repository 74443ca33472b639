"""THC's saturation threshold: the range ``T sigma`` a block's coordinates are clipped to.

``saturation_rate`` is the two-sided tail of a standard normal clipped; :func:`saturation_threshold`
turns it into ``T``. Its default (:func:`grid_saturation_rate`) follows the grid and the world
size: THC's 1/1024 (``T = 3.297``) for its 4-bit grid and finer, and for coarser grids the
threshold of least error in the ranks' mean. Host-side arithmetic, computed once per layout.
Measurements: ``docs/thc.md``, section 3 ("Saturation for coarse levels").
"""
import functools
import math

__all__ = ["THC_SATURATION_RATE", "saturation_threshold", "grid_saturation_rate"]

# THC's saturation rate (T = 3.297), kept from 2**4 - 1 = 15 levels above 0 up (THC's 4 bits).
THC_SATURATION_RATE = 1.0 / 1024


@functools.lru_cache(maxsize=None)
def saturation_threshold(rate: float) -> float:
    """``T`` with ``P(|Z| > T) = rate`` for a standard normal ``Z`` (host-side bisection, once
    per rate).

    ``saturation_threshold(1 / 1024) == 3.2971933456919635`` to within 1e-15 (THC's constant).
    """
    lo, hi = 0.0, 40.0
    for _ in range(200):  # halves the bracket each time; stops moving after ~60
        mid = 0.5 * (lo + hi)
        if math.erfc(mid / math.sqrt(2.0)) > rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=None)
def grid_saturation_rate(top: int, ranks: int = 1) -> float:
    """The default ``saturation_rate`` for levels ``0..top`` (``top`` >= 1 grid steps) summed
    over ``ranks`` ranks.

    From ``top = 15`` (THC's 4 bits) up: THC's 1/1024. Below: the rate whose threshold ``T``
    minimises, for a standard normal ``Z``, the error of the ranks' mean: the clipping error,
    which need not shrink in the mean (the ranks' gradients share their large coordinates),
    plus the mean variance of stochastic rounding on ``top`` steps of ``2 T / top`` over
    ``[-T, T]``, which does (each rank rounds independently):
    ``E[(|Z| - T)^2; |Z| > T] + (2 T / top)^2 / 6 * P(|Z| < T) / ranks`` (a point at fraction
    ``p`` of its cell has variance ``delta^2 p (1 - p)``, whose mean over ``p`` is
    ``delta^2 / 6``), by a scan of ``T`` in steps of 0.001. For ``top = 3``: 0.20 at 1 rank,
    0.134 at 2, 0.0097 at 64.
    """
    if top >= 15:
        return THC_SATURATION_RATE
    root2 = math.sqrt(2.0)
    density = 1.0 / math.sqrt(2.0 * math.pi)

    def error(t):
        tail = 0.5 * math.erfc(t / root2)  # P(Z > t)
        clip = 2.0 * ((1.0 + t * t) * tail - t * density * math.exp(-0.5 * t * t))
        return clip + (2.0 * t / top) ** 2 / 6.0 * (1.0 - 2.0 * tail) / ranks

    best = min((error(0.001 * i), i) for i in range(1, 8001))[1] * 0.001
    return math.erfc(best / root2)
