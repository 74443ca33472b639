"""THC's float64 reference and simulated ranks, shared by the THC tests (tests/core/test_thc.py,
test_thc_kernels.py, test_lanes.py; tests/parallel/test_thc.py and tests/parity/ use the
reference and the layout formulas).

:class:`Ranks` runs several *simulated* ranks of one tensor in one process (pure math): each
rank compresses with its own state; the one all-reduce is an int64 sum of the int32 payloads
(``op="sum"``) or Horovod's Average on int32, emulated as ``trunc(W * (1.0 / n))`` in float64
(what Horovod's int32 post-scale does in both frameworks); a rank in ``hvd.join()`` adds
zeros and neither compresses nor finishes. With ``range="current"`` the Max side all-reduce
inside compress is the elementwise maximum of what the ranks post (each rank compresses
twice: once to record, once with the agreed value; compress changes nothing).

Every decoded value is checked against a float64 reference computed in NumPy from the
ranks' *own* payloads (:func:`reference_decode`): the lanes are unpacked with NumPy shifts,
summed over the contributing ranks, mapped through ``S delta - c R`` per block and the
float64 Walsh-Hadamard transform (tests/reference.py). The layout is recomputed from its
formulas (:func:`np_layout`), independently of ``THCScheme.layout``, and so are the next
step's ranges (:func:`reference_ranges`, from the statistics of every rank's own payload).
"""
import dataclasses
import math

import numpy as np

from hvd_gradcomp import hadamard, thc
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.thc import THCConfig, THCScheme
from tests.backends import as_numpy, native_tensor, one_rank_ops
from tests.reference import fwht64

T_1024 = 3.2971933456919635  # THC's saturation threshold for rate 1/1024
CODE_SCALE, CODE_OFFSET, CODE_MAX = 4.0, 512.0, 1023  # a range's 10-bit log code: round(4 log2 r) + 512
CONTROL = 4  # control words: contributors, non-finite count, fingerprint s, s**2

_np, _tensor = as_numpy, native_tensor  # the shared helpers of tests/backends.py (own dtype)


def student_t(rng, size, df=3.0):
    return rng.standard_t(df, size=size).astype(np.float32)


def state_np(state):
    """A state as a dict of NumPy copies."""
    return {f: _np(v) for f, v in zip(state._fields, state)}


def np_lanes(bits, n, lane_bits=8, op="average", own=False):
    """(L, guard, width, lanes, offset) of the levels from thc.py's docstring, step 5, found by
    trying every candidate in order (independent of thc.lane_layout's loops). ``own``
    (``subtract_own``): lanes for the sum of the other ``max(1, n - 1)`` ranks, no offset."""
    guard = 0 if op == "sum" else n.bit_length()
    room, cap = 32 - guard, (1 << bits) - 1
    summands = max(1, n - 1) if own else n
    candidates = []
    for target in range(32 // lane_bits if lane_bits else 1, 0, -1):
        most = min(cap, (2 ** (room // target) - 1) // summands) if lane_bits else cap
        for top in ((most, most - 1) if lane_bits else (cap,)):
            if top >= 1:
                width = int(summands * top).bit_length()
                candidates += [(top, width, lanes) for lanes in range(room // width, target - 1, -1)]
    for top, width, lanes in candidates:
        if own:  # lanes * width + guard <= 32 by construction; sums may wrap modulo 2**32
            assert guard + lanes * width <= 32
            return top, guard, width, lanes, 0
        peak = top * sum(2 ** (guard + j * width) for j in range(lanes))
        for k in ((peak // 2) // 2 ** guard * 2 ** guard + i * 2 ** guard for i in (0, 1)):
            if peak < 2 ** 31 and n * k <= 2 ** 31 and n * (peak - k) < 2 ** 31:
                return top, guard, width, lanes, k
    raise ValueError("no layout")


def np_layout(bits, n, d, block, blocking=False, lane_bits=8, op="average", own=False):
    """The payload layout from the formulas of thc.py's docstring (independent of THCScheme)."""
    levels_max, guard, width, lanes, offset = np_lanes(bits, n, lane_bits, op, own)
    padded = -(-d // block) * block
    blocks = padded // block
    width_s = (CODE_MAX * n).bit_length()
    lanes_s = (31 - guard) // width_s
    words = -(-padded // lanes)  # planar over the whole rotated vector
    stats_words = 0 if blocking else -(-2 * blocks // lanes_s)
    return dict(bits=bits, L=levels_max, n=n, d=d, block=block, padded=padded, blocks=blocks,
                guard=guard, width=width, lanes=lanes, offset=offset, words=words, width_s=width_s, lanes_s=lanes_s,
                stats_words=stats_words, total=words + stats_words + CONTROL)


def layout_of(scheme, info):
    """:func:`np_layout` for a scheme and tensor (block from hadamard.block_size)."""
    cfg = scheme.config
    block = hadamard.block_size(info.numel, None if cfg.rotation == "full" else cfg.rotation_stages)
    return np_layout(cfg.bits, info.world_size, info.numel, block, cfg.range == "current",
                     effective_lane_bits(cfg.bits, info.world_size, cfg.lane_bits, info.op, cfg.subtract_own),
                     info.op, cfg.subtract_own)


def effective_lane_bits(bits, n, lane_bits=8, op="average", own=False):
    """The lane_bits the layout follows: bits other than 4 is honoured, so the default
    lane_bits=8 widens (None) where its lanes would shrink the levels (thc.py, step 5)."""
    if bits != 4 and lane_bits == 8 and np_lanes(bits, n, 8, op or "average", own)[0] < 2 ** bits - 1:
        return None
    return lane_bits


def np_unpack(words, lanes, width, guard, count):
    """Lane values [count] of int words, by NumPy shifts and masks: value ``j * len(words) + w``
    sits in lane ``j`` of word ``w`` (planar lanes)."""
    shifts = guard + width * np.arange(lanes)
    return ((np.asarray(words, np.int64)[None, :] >> shifts[:, None]) & ((1 << width) - 1)).reshape(-1)[:count]


def split_payload(payload, lay, ranks=1):
    """(levels [P], codes [nb], flags [nb], control [4]) of one rank's own (int) payload, or of
    the exact sum of ``ranks`` ranks' payloads (each took the offset K off its level words)."""
    p = np.asarray(payload).astype(np.int64)
    assert p.size == lay["total"], (p.size, lay)
    levels = np_unpack(p[:lay["words"]] + ranks * lay["offset"], lay["lanes"], lay["width"], lay["guard"], lay["padded"])
    stats = np_unpack(p[lay["words"]:lay["words"] + lay["stats_words"]], lay["lanes_s"], lay["width_s"],
                      lay["guard"], 2 * lay["blocks"]).reshape(-1, 2) if lay["stats_words"] else \
        np.zeros((lay["blocks"], 2), np.int64)
    control = p[lay["words"] + lay["stats_words"]:] >> lay["guard"]
    assert (p[lay["words"] + lay["stats_words"]:] & ((1 << lay["guard"]) - 1) == 0).all()
    return levels, stats[:, 0], stats[:, 1], control


def emulate_allreduce(payloads, op, n, wrap=False):
    """Horovod's all-reduce of int32 payloads: the int64 sum, or int32 Average's trunc(W * (1/n)).
    ``wrap``: a rank sends undefined level words (not finite): int32 sums wrap around."""
    total = np.sum([np.asarray(p).astype(np.int64) for p in payloads], axis=0)
    if wrap:
        total = (total + 2 ** 31) % 2 ** 32 - 2 ** 31
    assert -2 ** 31 <= total.min() and total.max() < 2 ** 31, "a word left int32's range"
    if op == "average":
        total = np.trunc(total.astype(np.float64) * (1.0 / n)).astype(np.int64)
    return total.astype(np.int32)


def reference_decode(own_payloads, ranges, diag, lay, op):
    """What every rank must output (float64 [d]), from the contributing ranks' own payloads.

    ``own_payloads``: the payloads of the ranks that took part (a joined rank is left out);
    ``ranges``: float32 [nb] R used this step (the same on all of them); ``diag``: [P].
    Non-finite or fingerprint disagreement give NaN / 0 as the docstring says.
    """
    parts = [split_payload(p, lay) for p in own_payloads]
    total = np.sum([lv for lv, _, _, _ in parts], axis=0).astype(np.float64)
    control = np.sum([c for _, _, _, c in parts], axis=0)
    c, bad, s1, s2 = (int(v) for v in control)
    if bad:
        return np.full(lay["d"], np.nan)
    if c * s2 != s1 * s1:
        return np.zeros(lay["d"])
    top = np.repeat(np.asarray(ranges, np.float64), lay["block"])
    delta = top * (2.0 * (1.0 + 2.0 ** -20) / lay["L"])
    values = total * delta - c * top
    if op == "average":
        values = values / lay["n"]
    return (fwht64(values, lay["block"]) * np.asarray(diag, np.float64))[:lay["d"]]


def reference_codes(y, lay, saturation=True, rate=None):
    """(codes, flags, wanted) of one rank's corrected rotated vector ``y`` [P], in float64.
    ``rate``: the config's ``saturation_rate``; None, its default, by the layout's levels and
    ranks (``T_1024`` from 15 levels above 0 up; :func:`hvd_gradcomp.thc.grid_saturation_rate`,
    tested on its own).

    Also returns the ties: blocks whose 4 log2(wanted) lies within 1e-4 of a rounding boundary
    (float32 vs float64 may round them either way).
    """
    threshold = thc.saturation_threshold(thc.grid_saturation_rate(lay["L"], lay["n"]) if rate is None else rate)
    yb = np.asarray(y, np.float64).reshape(lay["blocks"], lay["block"])
    wanted = threshold * np.sqrt((yb * yb).mean(1)) if saturation else np.abs(yb).max(1)
    usable = wanted > 1e-30
    with np.errstate(divide="ignore"):
        raw = np.where(usable, CODE_SCALE * np.log2(np.where(usable, wanted, 1.0)), 0.0)
    codes = np.where(usable, np.clip(np.round(raw) + CODE_OFFSET, 1, CODE_MAX), 0).astype(np.int64)
    ties = usable & (np.abs(raw - np.floor(raw) - 0.5) < 1e-4)
    return codes, usable.astype(np.int64), wanted, ties


def reference_ranges(own_payloads, lay):
    """The next step's agreed ranges (float64 [nb]) from the ranks' own statistics."""
    parts = [split_payload(p, lay) for p in own_payloads]
    codes = np.sum([cd for _, cd, _, _ in parts], axis=0).astype(np.float64)
    have = np.sum([fl for _, _, fl, _ in parts], axis=0).astype(np.float64)
    return np.where(have > 0, 2.0 ** ((codes / np.maximum(have, 1) - CODE_OFFSET) / CODE_SCALE), 0.0)


def fingerprint_ok(own_payloads, lay):
    control = np.sum([split_payload(p, lay)[3] for p in own_payloads], axis=0)
    return int(control[0]) * int(control[3]) == int(control[2]) ** 2


class Ranks:
    """``n`` simulated ranks of one tensor (module docstring); :meth:`step` is one training step.

    Args:
        op: the op Horovod applies ("sum" / "average").
        infer: if True, TensorInfo.op is None (a hand-made call): the scheme infers the op
            from the count word.
    """

    def __init__(self, backend, n, shape, config=THCConfig(), op="sum", infer=False, key="layer.w",
                 states=None):
        self.backend, self.n, self.op = backend, n, op
        self.ops = one_rank_ops(backend)
        self.scheme = THCScheme(config)
        self.shape = tuple(shape)
        self.infos = [TensorInfo(key, self.shape, "float32", n, r, None if infer else op) for r in range(n)]
        like = _tensor(backend, np.zeros(self.shape, np.float32))
        self.states = states or [self.scheme.init(self.ops, info, like) for info in self.infos]
        self.lay = layout_of(self.scheme, self.infos[0])
        self.wrap = False  # see emulate_allreduce

    def _compress(self, ops, xs, live):
        return {r: compress_tensor(self.scheme, ops, xs[r], self.states[r], self.infos[r])
                for r in range(self.n) if live[r]}

    def step(self, grads, contribute=None):
        """One step; ``grads[r]`` NumPy; ``contribute[r] = False``: rank r is in hvd.join().

        Returns a dict: outs (float64 NumPy per rank, None when joined), own (each live rank's
        payload, NumPy), ctxs, reduced (NumPy int32), before / after (states), side (the
        agreed side value with range="current").
        """
        live = [True] * self.n if contribute is None else list(contribute)
        xs = [_tensor(self.backend, np.asarray(g, np.float32).reshape(self.shape)) for g in grads]
        side = None
        if self.scheme.blocking:
            seen = []

            def record(v, op, name, group=None):
                assert op == "max" and name == f"hvd_gradcomp.thc.range.{self.infos[0].key}"
                seen.append(_np(v))
                return v
            self._compress(dataclasses.replace(self.ops, allreduce=record), xs, live)
            side = np.max(seen, axis=0).astype(np.float32)
            agreed = dataclasses.replace(self.ops, allreduce=lambda v, *a, **k: _tensor(self.backend, side))
            sent = self._compress(agreed, xs, live)
        else:
            sent = self._compress(self.ops, xs, live)
        own = {r: _np(p) for r, (p, _) in sent.items()}
        for p in own.values():
            assert p.dtype == np.int32, p.dtype
        # subtract_own: the words' sum may wrap (int32 two's complement), by design
        reduced = emulate_allreduce(list(own.values()), self.op, self.n,
                                    wrap=self.wrap or self.scheme.config.subtract_own)
        outs, after = [], []
        for r in range(self.n):
            if live[r]:
                out, new = finish_tensor(self.scheme, self.ops, _tensor(self.backend, reduced), sent[r][1],
                                         self.states[r], self.infos[r])
                outs.append(_np(out).astype(np.float64))
                after.append(new)
            else:
                outs.append(None)
                after.append(self.states[r])
        log = {"outs": outs, "own": own, "ctxs": {r: c for r, (_, c) in sent.items()}, "reduced": reduced,
               "before": self.states, "after": after, "side": side, "live": live}
        self.states = after
        return log

    def check_reference(self, log, rtol=2e-6):
        """Every live rank's output == the float64 reference from the ranks' own payloads."""
        live = [r for r in range(self.n) if log["live"][r]]
        ctx0 = log["ctxs"][live[0]]
        for r in live[1:]:  # the same grid and rotation on every rank
            np.testing.assert_array_equal(_np(log["ctxs"][r].ranges), _np(ctx0.ranges))
            np.testing.assert_array_equal(_np(log["ctxs"][r].diag), _np(ctx0.diag))
        ref = reference_decode([log["own"][r] for r in live], _np(ctx0.ranges), _np(ctx0.diag), self.lay, self.op)
        for r in live:
            out = log["outs"][r].reshape(-1)
            np.testing.assert_array_equal(out, log["outs"][live[0]].reshape(-1))
            if np.isnan(ref).all():
                assert np.isnan(out).all()
            else:
                atol = rtol * max(1.0, np.abs(ref).max()) * max(1.0, math.log2(self.lay["block"]))
                np.testing.assert_allclose(out, ref, rtol=0, atol=atol)
        return ref


def fails_cleanly_on_rank_1(sim, xs, gen):
    """One step in which rank 1's gradient counts as not finite: NaN in every coordinate of
    every rank's output, every rank's whole state as it was, rank 1's "not finite" word set;
    then a finite step that matches the reference (returned)."""
    before = [state_np(st) for st in sim.states]
    sim.wrap = True
    log = sim.step(xs)
    sim.wrap = False
    assert all(np.isnan(out).all() for out in log["outs"])
    for b, st in zip(before, log["after"]):
        for f, v in zip(st._fields, st):
            np.testing.assert_array_equal(as_numpy(v), b[f], err_msg=f)
    assert int(split_payload(log["own"][1], sim.lay)[3][1]) == 1
    log = sim.step([gen.standard_normal(sim.shape) for _ in range(sim.n)])
    sim.check_reference(log)
    return log


def top_level_misses_allowed(n, bits, count):
    """How many of ``count`` lane sums may fall short of n L when every rank sits at the top.

    A coordinate at +R has grid position u = L / (1 + 2**-20) (the widened step keeps u below
    L), so each rank rounds it up to L with probability 1 - L 2**-20 / (1 + 2**-20) and to L - 1
    otherwise: expected misses ``count (1 - (1 - p)**n)``, bounded here by that plus five
    standard deviations plus 3.
    """
    levels_max = (1 << bits) - 1
    p_miss = levels_max * 2.0 ** -20 / (1 + 2.0 ** -20)
    expected = count * (1 - (1 - p_miss) ** n)
    return expected + 5 * math.sqrt(expected) + 3


def rotated(x, diag, block):
    """float64 rht of x (zero-padded to diag's length)."""
    x = np.asarray(x, np.float64).reshape(-1)
    diag = np.asarray(diag, np.float64)
    return fwht64(np.concatenate([x, np.zeros(diag.size - x.size)]) * diag, block)


def unrotated(y, diag, block, d):
    return (fwht64(np.asarray(y, np.float64), block) * np.asarray(diag, np.float64))[:d]


def carried(state, block, d):
    """float64 [d]: the state's residual rotated back (what is still to be delivered); 0 without EF."""
    residual = _np(state.residual)
    return unrotated(residual, _np(state.diag), block, d) if residual.size else np.zeros(d)

