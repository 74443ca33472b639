"""``auto``'s measurement window: shadow runs of the candidates beside the real step, the figures
they ride on in the payload (lanes), and the sync step that realigns ranks
(:mod:`hvd_gradcomp.auto`, docs/auto.md).
"""
import logging
import dataclasses
import math
import time

from .. import composite
from ..base import FP16_MAX, TensorInfo, compress_tensor, finish_tensor, fp16_floor, payload_finite
from .. import rng
from .decisions import LANE_MAX, PRUNE_FACTOR, PRUNE_MIN_MS, REFERENCE_SHAPE, UNUSABLE, decide

__all__ = ["AutoWindow"]

log = logging.getLogger("hvd_gradcomp")


def _saturate_carried(ops, x, world_size: int):
    """``(sent, unsent)``: ``x`` (float32, the gradient plus the carry) with its finite values
    clamped to what a float16 payload pre-scaled by ``1 / world_size`` holds (the largest
    float16 <= 65504 / n, times n: :func:`~hvd_gradcomp.base.saturating_cast`'s cap), and the
    excess, kept as the next carry (docs/auto.md, step 6). NaN/inf stay (a failed step must
    be seen as one); their excess is 0."""
    limit = world_size * fp16_floor(FP16_MAX / world_size)
    finite = ops.isfinite(x)
    sent = ops.where(finite, ops.clip(x, -limit, limit), x)
    return sent, ops.where(finite, x - sent, 0.0 * x)


def _count_lane(info, dtype):
    """This rank's count lane in a payload of ``dtype``: ``1 / n`` (float; pre-scaled as the
    probe's lanes), or for an integer payload 1 under Sum and ``n`` otherwise (Horovod's
    integer Average truncates ``k n / n`` to ``k``)."""
    if dtype.startswith("int"):
        return 1 if info.op == "sum" else info.world_size
    return 1.0 / info.world_size


def _contributors(count, info, dtype):
    """The number of contributing ranks from the all-reduced count lane (a host number or a
    0-d tensor): Sum adds ``1 / n`` per rank, Average divides that by ``n`` once more; an
    unknown op is taken as Horovod's default, Average."""
    n = info.world_size
    if dtype.startswith("int"):
        return count
    return count * n if info.op == "sum" else count * (n * n)


def _delivered(ops, own, carry, unsent):
    """The carry after a step that carried it: ``unsent`` flattened (None when it is 0 or
    None) if the all-reduced ``own`` payload is finite, else ``carry`` (one host read)."""
    if unsent is None:
        return None if ops.to_host(payload_finite(ops, own)) else carry
    ok, most = ops.to_host(ops.concat([ops.reshape(ops.cast(payload_finite(ops, own), "float32"), (1,)),
                                       ops.reshape(ops.max(ops.abs(unsent), None), (1,))], 0))
    if not ok:
        return carry
    return ops.reshape(unsent, ops.shape(carry)) if most > 0 else None


def _alone_step(cand, ops, x, state, info):
    """One step of ``cand`` on ``x`` as if alone (``info``: world size 1): ``(out`` float32
    ``[numel]``, new state, host ms)``, the device waited for before the clock is read."""
    start = time.perf_counter()
    payload, ctx = compress_tensor(cand, ops, x, state, info)
    out, state = finish_tensor(cand, ops, payload, ctx, state, info)
    out = ops.reshape(out, (info.numel,))
    ops.to_host(ops.sum(out[:1], None))
    return out, state, (time.perf_counter() - start) * 1000.0


class AutoWindow:
    """The measurement half of :class:`~hvd_gradcomp.auto.scheme.AutoScheme` (a mixin): the
    reference costs, the sync step, the window's shadow runs and the lanes that carry their
    figures in the payload. Its methods use the scheme's config, candidates and tables."""

    def reference_costs(self, ops, like) -> list:
        """This rank's codec ms of every candidate on a :data:`REFERENCE_SHAPE` Gaussian
        matrix, as if alone (compress + finish; the least of two timed calls after an untimed
        first). ``calibrate()`` averages them over the ranks for :func:`start_choice`."""
        info = TensorInfo("auto.reference", REFERENCE_SHAPE, "float32", 1, 0, "sum")
        x = ops.reshape(rng.normal(ops, rng.stream_key("auto.reference"), info.numel, like),
                        REFERENCE_SHAPE)
        costs = []
        for cand in self.candidates:
            if not cand.accepts(info):
                costs.append(LANE_MAX)
                continue
            state, runs = cand.init(ops, info, x), []
            for i in range(3):
                _, state, ms = _alone_step(cand, ops, x, state, info)
                if i:
                    runs.append(ms)
            costs.append(min(min(runs), LANE_MAX))
        return costs

    def _synced(self, ops, payload, ctx, state, info, lanes):
        """The state after a sync step (docs/auto.md, *Agreement*): every rank sent its
        gradient plus all it owed in float32 (delivered exactly), and, when every rank
        contributed and none failed, all take rank 0's step and choice (from the lanes), with
        the choice's fresh state; else each keeps its own, and the next step syncs again."""
        n = info.world_size
        if not all(math.isfinite(v) for v in lanes):  # nothing delivered
            return state
        inner = self._flushed(ops, self._inner(state), ctx.choice)
        if not _contributors(lanes[0], info, "float32") >= n - 0.5:
            return self._pack(state.step, state.choice, inner, None)
        scale = 1 if info.op == "sum" else n  # rank 0's lanes alone, averaged or not
        step, choice = int(round(lanes[1] * scale)), int(round(lanes[2] * scale))
        if not 0 <= choice < len(self.candidates) or step < 0:
            return self._pack(state.step, state.choice, inner, None)
        if (step, choice) != (ctx.step, ctx.choice) or self._phase(ctx.step)[1]:
            for table in (self._shadows, self._samples, self._firsts, self._pruned, self._infos):
                table.pop(info.key, None)  # this window's figures: not this schedule's
        if (step, choice) != (ctx.step, ctx.choice):
            log.info("hvd_gradcomp auto: tensor %s: realigned to rank 0's schedule (step %d, %s; "
                     "this rank was at step %d, %s)", info.key, step, self.specs[choice], ctx.step,
                     self.specs[ctx.choice])
        self._counters[info.key] = (step + 1, choice, n)
        return self._state(ops, payload, step + 1, choice, self.candidates[choice].init(ops, info, payload))

    def _sync_lanes(self, info, step, choice):
        """A sync step's lanes: the count lane, then rank 0's step and choice (0 from the other
        ranks, not pre-scaled: float32 holds them exactly)."""
        mine = [float(step), float(choice)] if info.rank == 0 else [0.0, 0.0]
        return [1.0 / info.world_size] + mine

    def _flushed(self, ops, inner, choice):
        """``inner`` (candidate ``choice``'s state) after a flush: its error feedback fields
        (:attr:`~hvd_gradcomp.base.Scheme.residual_fields`, those it has) zero."""
        fields = [f for f in self.candidates[choice].residual_fields if f in inner._fields]
        return inner._replace(**{f: getattr(inner, f) * 0.0 for f in fields}) if fields else inner

    # ---- measurement ----
    def _measure(self, ops, x, info, step):
        """Run every candidate as a shadow on this rank's gradient (docs/auto.md, step 2).

        A candidate whose first (untimed) window step, with its ring all-reduce ms, came to
        more than :data:`PRUNE_FACTOR` times the fastest such figure among fp16 and the
        candidates whose first-step error was within the budget (and took more than
        :data:`PRUNE_MIN_MS`) is not run again in this window: it would cost its codec on every
        window step (THC on digits' 4M-coordinate weight: 60-100 ms a step) and could win
        only if every faster candidate then failed the budget, which the next window checks. Its lanes then
        say so (:data:`UNUSABLE`), the same way on every rank after the all-reduce. The time
        spent here is taken off the step's measured time (the step gate's input).
        """
        key = info.key
        began = time.perf_counter()
        alone = dataclasses.replace(info, world_size=1, rank=0, op="sum", group=None, dtype="float32")
        shadows = self._shadows.get(key)
        first = shadows is None
        if first:
            shadows = self._shadows[key] = [c.init(ops, alone, x) if ok else None
                                            for c, ok in zip(self.candidates, self._fits(info))]
            self._samples[key] = [([], []) for _ in self.candidates]
            self._firsts[key] = [(math.nan, math.nan)] * len(self.candidates)
            self._pruned[key] = self._hopeless(info)
            self._infos[key] = info
        pruned = self._pruned[key]
        flat = ops.reshape(x, (info.numel,))
        for i, cand in enumerate(self.candidates):
            if i in pruned:
                continue
            before = composite.residual_of(cand, ops, shadows[i], alone)
            out, shadows[i], elapsed = _alone_step(cand, ops, x, shadows[i], alone)
            corrected = flat if before is None else flat + before
            diff = corrected - out
            num, den = ops.to_host(ops.concat([ops.reshape(ops.sum(diff * diff, None), (1,)),
                                               ops.reshape(ops.sum(corrected * corrected, None), (1,))], 0))
            if not (math.isfinite(num) and math.isfinite(den)):
                continue  # a non-finite gradient on this rank: no figure (step 2)
            if first:  # one-time costs and empty agreed stats: not a sample, only a screen
                self._firsts[key][i] = (elapsed, math.sqrt(num / den) if den > 0 else 0.0)
            else:
                times, errors = self._samples[key][i]
                times.append(elapsed)
                errors.append(math.sqrt(num / den) if den > 0 else 0.0)
        if first:
            f, budget = self.fallback, self.config.error_budget
            current = self._counters.get(key, (0, f))[1]  # its real step runs anyway: never pruned
            screened = [ms + 1000.0 * self._comm(info, i) for i, (ms, _) in enumerate(self._firsts[key])]
            admissible = [p for i, (p, (_, e)) in enumerate(zip(screened, self._firsts[key]))
                          if math.isfinite(p) and (i == f or e <= budget)]
            best = min(admissible) if admissible else math.inf
            pruned.update(i for i, (p, (ms, _)) in enumerate(zip(screened, self._firsts[key]))
                          if i not in (f, current) and p > PRUNE_FACTOR * best and ms > PRUNE_MIN_MS)
        self._clock[step][1] += time.perf_counter() - began

    def _hopeless(self, info) -> set:
        """Candidates not even screened for ``info``: with the start costs measured
        (``calibrate()``), a candidate whose codec ms on the reference matrix, scaled to this
        tensor's size, plus its all-reduce ms, exceeds :data:`PRUNE_FACTOR` times that figure of
        the tensor's current choice (and :data:`PRUNE_MIN_MS`). Agreed facts only. THC's first
        call on digits' 4M-coordinate weight was the largest part of the window's first step
        (0.13-0.55 s); its figure there is about 10x PowerSGD's. Candidates that do not accept
        the tensor (:meth:`_fits`) are never run."""
        unfit = {i for i, ok in enumerate(self._fits(info)) if not ok}
        if self.start_costs is None:
            return unfit
        scale = info.numel / math.prod(REFERENCE_SHAPE)
        guess = [ms * scale + 1000.0 * self._comm(info, i) for i, ms in enumerate(self.start_costs)]
        current = self._counters.get(info.key, (0, self.fallback))[1]
        return unfit | {i for i, g in enumerate(guess) if i not in (self.fallback, current)
                        and g > PRUNE_FACTOR * guess[current] and self.start_costs[i] * scale > PRUNE_MIN_MS}

    def _fits(self, info) -> list:
        """Per candidate: it accepts ``info`` (:meth:`~hvd_gradcomp.base.Scheme.accepts`; the
        fallback takes every tensor). A candidate that does not is never run nor chosen."""
        return [i == self.fallback or c.accepts(info) for i, c in enumerate(self.candidates)]

    def _wires(self, info) -> list:
        """Per candidate, its payload bytes for ``info``; ``math.inf`` where it does not accept
        the tensor (what :func:`~hvd_gradcomp.auto.decisions.decide` never chooses)."""
        return [c.wire(info).payload if ok else math.inf for c, ok in zip(self.candidates, self._fits(info))]

    def _comm(self, info, i):
        """Predicted ring all-reduce seconds of candidate ``i``'s wire bytes for ``info``
        (inf where it does not accept the tensor)."""
        cand = self.candidates[i]
        if not (i == self.fallback or cand.accepts(info)):
            return math.inf
        return self.link.seconds(cand.wire(info).payload, info.world_size, composite.payload_dtype(cand, info))

    def _dtypes(self, info):
        return [composite.payload_dtype(c, info) for c in self.candidates]

    def _local(self, key):
        """This rank's window figures for ``key``: (codec ms, errors) per candidate; the
        screen's until a sample exists, :data:`UNUSABLE` when pruned, NaN with neither."""
        samples = self._samples.get(key) or [([], []) for _ in self.candidates]
        firsts = self._firsts.get(key) or [(math.nan, math.nan)] * len(self.candidates)
        pruned = self._pruned.get(key, set())
        times, errors = [], []
        for i, ((t, e), (ms0, e0)) in enumerate(zip(samples, firsts)):
            if i in pruned:
                times.append(UNUSABLE)
                errors.append(UNUSABLE)
            else:  # the screen's figures only until a sample exists (the gate's early reads);
                # none at all (this rank's window gradients were not finite): NaN, so that the
                # probe decides nothing
                times.append(min(min(t) if t else ms0, LANE_MAX))
                errors.append(min(sum(e) / len(e) if e else e0, LANE_MAX))
        return times, errors

    def _round(self, step):
        """This rank's step lanes for the probe ``step`` (docs/auto.md, steps 4-5):
        ``[speedup, step ms]`` and, of the tensor with the most predicted fp16 time (the
        model's leading tensor), per candidate its predicted ms, its error and a 1 for its
        current choice (0 at its first decision); computed once per probe step from the
        window's measurements so far."""
        if self._gate[0] == step:
            return self._gate[1]
        cfg = self.config
        periods = []
        for s in range(max(0, step - cfg.warmup + 1), step):
            if s in self._clock and s + 1 in self._clock:
                t0, shadows = self._clock[s]
                periods.append(self._clock[s + 1][0] - t0 - shadows)
        for s in [s for s in self._clock if s < step - cfg.warmup]:
            del self._clock[s]
        cands = len(self.candidates)
        period = 1000.0 * min(periods) if periods else 0.0
        now = mix = fp16 = 0.0
        lead = (None, None)
        for key, info in self._infos.items():
            times, errors = self._local(key)
            wire = self._wires(info)
            at, current = self._counters.get(key, (0, self.fallback, 0))[:2]
            best, predicted, _ = decide(times, errors, wire, info.world_size, self.link,
                                        None if at == cfg.warmup - 1 else current,
                                        self.fallback, cfg.error_budget, cfg.hysteresis,
                                        self._dtypes(info))
            now, mix, fp16 = now + predicted[current], mix + predicted[best], fp16 + predicted[self.fallback]
            size = (self._comm(info, self.fallback), key)  # static facts: the same leader everywhere
            if lead[1] is None or size > lead[0]:
                held = [float(i == current) for i in range(cands)] if at != cfg.warmup - 1 else [0.0] * cands
                lead = (size, list(predicted) + list(errors) + held)
        leader = lead[1] or [UNUSABLE] * (2 * cands) + [0.0] * cands
        if periods:
            rest = max(period - now, 0.0)  # compute and everything else of the step
            speedup = (rest + fp16) / max(rest + mix, 1e-6)
        else:
            speedup = LANE_MAX  # nothing measured: no gate
        self._gate = (step, [min(speedup, LANE_MAX), min(period, LANE_MAX)] +
                      [min(v, LANE_MAX) for v in leader])
        return self._gate[1]

    def _lanes(self, info, step):
        """``[1, codec ms per candidate, error per candidate, speedup, step ms, the leading
        tensor's figures] / world_size`` of this rank's window, each clamped to
        :data:`LANE_MAX` first (docs/auto.md, step 3)."""
        times, errors = self._local(info.key)
        scale = 1.0 / info.world_size
        return [scale * v for v in [1.0] + times + errors + self._round(step)]
