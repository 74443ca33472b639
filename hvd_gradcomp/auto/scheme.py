"""``auto``'s scheme: its config and the per-tensor lifecycle (init, compress, receive,
decompress, finish) over the current candidate, with the schedule of windows and probes
(:mod:`hvd_gradcomp.auto`, docs/auto.md).
"""
import dataclasses
import logging
import math
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .. import composite
from ..base import FALLBACK, Scheme, TensorInfo, WireBytes, poison
from ..options import option, options_of, validate
from ..primitives import itemsize
from .decisions import DEFAULT_CANDIDATES, Decision, Link, REFERENCE_SHAPE, decide, start_choice
from .window import AutoWindow, _contributors, _count_lane, _delivered, _saturate_carried

__all__ = ["AutoConfig", "AutoScheme", "OPTION_JOIN"]

# Joins the options of one candidate in the ``candidates`` text ("topkc:ratio=0.1&max_age=20"):
# a spec's own separator, the comma, separates auto's options.
OPTION_JOIN = "&"

log = logging.getLogger("hvd_gradcomp")


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``auto`` (docs/auto.md), each declared once below
    (:mod:`hvd_gradcomp.options`).

    ``error_budget`` bounds the one-step relative error ``||c - out|| / ||c||``, which error
    feedback makes large for every sparsifier and low-rank scheme that still trains well.
    Measured on digits' weight matrices (first 12 steps), against how each trained there
    (``docs/bench.md``): TopKC 0.1 0.87-0.91 and PowerSGD rank 4 0.73-0.86 reach FP16's
    accuracy; TopKC 0.03 0.96-0.97, PowerSGD rank 1 0.96 and TopKC 0.01 0.98-0.99 (which
    trains badly) deliver almost nothing of a step; THC 4 bits 0.2-0.3. The default 0.95
    admits the first group and shuts out the second. ``bandwidth_gbit=0`` (the default)
    means measured: ``calibrate()`` runs when the compressor is built after ``hvd.init()``.
    ``step_penalty`` is the step gate's (docs/auto.md, step 5): compression must make the
    whole step at least ``1 + step_penalty`` times faster than fp16 everywhere; 0 turns the
    gate off.

    ``candidates`` is ``|``-separated scheme specs, the options of one joined by ``&`` (the
    comma separates auto's own options): ``"fp16|topkc:ratio=0.1&max_age=20|powersgd:8"``; a
    tuple or list of specs may use commas (``("fp16", "topkc:ratio=0.1,max_age=20")``). The
    config keeps the text as given (stripped); the scheme built from it
    (:func:`hvd_gradcomp.registry.make_scheme`) holds the canonical list
    (:meth:`AutoScheme.canonical`), so equal lists give equal specs and accept each other's
    checkpoints.

    Raises:
        ValueError: an option outside its rule (``"auto: every must be ..."``), ``every`` below
            ``warmup``; the registry and the scheme raise for bad candidates (unknown, auto,
            blocking, no fp16, equal).
    """

    SCHEME: ClassVar[str] = "auto"
    candidates: str = option(DEFAULT_CANDIDATES, kind="text",
                             doc="'|'-separated scheme specs to choose from, fp16 among them (one "
                                 "candidate's options joined by '&')")
    error_budget: float = option(0.95, kind="number", lo=0.0, lo_open=True,
                                 doc="largest one-step relative error a candidate may have")
    warmup: int = option(3, kind="integer", lo=2, doc="steps per measurement window (the first is not timed)")
    every: int = option(500, kind="integer", lo=2, doc="steps from one decision to the next (>= warmup)")
    hysteresis: float = option(0.1, kind="number", lo=0.0, hi=1.0, hi_open=True,
                               doc="least fraction of predicted time a switch must save")
    bandwidth_gbit: float = option(0.0, kind="number", lo=0.0,
                                   doc="link rate, Gbit/s; 0: measured by calibrate()")
    latency_ms: float = option(0.0, kind="number", lo=0.0,
                               doc="fixed cost of one all-reduce, ms (with bandwidth_gbit)")
    step_penalty: float = option(0.75, kind="number", lo=0.0,
                                 doc="fraction more steps a lossy choice is assumed to need (step gate)")
    follow: float = option(0.02, kind="number", lo=0.0,
                           doc="a tensor takes the leading tensor's choice if that costs it at most "
                               "this fraction of the step")

    def __post_init__(self):
        if isinstance(self.candidates, (tuple, list)):
            object.__setattr__(self, "candidates", "|".join(
                c.replace(",", OPTION_JOIN) if isinstance(c, str) else c for c in self.candidates))
        validate(self)
        object.__setattr__(self, "candidates", "|".join(s.strip() for s in self.candidates.split("|")))
        if self.every < self.warmup:
            raise ValueError(f"auto: every must be an integer >= warmup ({self.warmup}), got {self.every!r}")

    def specs(self) -> tuple:
        """The candidate specs as scheme specs (stripped, options joined by commas):
        ``"fp16 | topkc:ratio=0.1&max_age=20"`` -> ``("fp16", "topkc:ratio=0.1,max_age=20")``."""
        return tuple(s.strip().replace(OPTION_JOIN, ",") for s in self.candidates.split("|"))


class _AutoCtx(NamedTuple):
    probe: str  # "": a plain step; "ride": lanes after the candidate's payload; "flush": float32
    choice: int
    step: int
    inner: object  # the candidate's ctx ("" and "ride")
    shape: tuple  # the candidate's own payload's shape ("ride"; its lanes follow it flattened)
    carried: bool  # the state's carry was added to this step's gradient
    unsent: object  # what of gradient + carry the float16 payload could not hold (None: all fits)


class AutoScheme(AutoWindow, Scheme):
    """Per-tensor choice among candidate schemes (docs/auto.md)."""

    name = "auto"
    adaptive = True  # wire() follows each tensor's current choice
    # Tensors below this many coordinates go as fp16 (routing): they skip the measurement
    # windows, whose decision would be fp16 for them anyway.
    min_numel = 1024

    def __init__(self, config: AutoConfig, candidates):
        """``candidates``: the schemes of ``config.specs()``, built, in that order (the registry
        builds them: :func:`hvd_gradcomp.registry.make_scheme`, as it builds the warm-up's inner
        scheme, so this module never imports the catalogue). The scheme keeps ``config`` with
        its list written canonically (:meth:`canonical`).

        Raises:
            ValueError: not one candidate per spec of ``config``, a candidate that is adaptive
                (``auto``) or blocking, two equal candidates, or no ``fp16`` among them.
        """
        candidates = tuple(candidates)
        specs = config.specs()
        if len(candidates) != len(specs):
            raise ValueError(f"auto: {len(specs)} candidate specs {list(specs)} but {len(candidates)} "
                             f"candidate schemes given")
        for text, scheme in zip(specs, candidates):
            if scheme.adaptive:
                raise ValueError(f"auto: candidates must not include auto, got {text!r}")
            if scheme.blocking:
                raise ValueError(f"auto: candidate {text!r} is a blocking variant (a side "
                                 f"collective inside compress); use the single-collective default")
        self.config = dataclasses.replace(config, candidates=self.canonical(candidates))
        self.candidates = candidates
        self.specs = tuple(c.spec() for c in candidates)
        if len(set(self.specs)) != len(self.specs):
            raise ValueError(f"auto: candidates must differ, got {list(self.specs)}")
        if FALLBACK not in self.specs:
            raise ValueError(f"auto: candidates must include {FALLBACK} (the fallback), "
                             f"got {list(self.specs)}")
        self.fallback = self.specs.index(FALLBACK)
        self.scalable = all(c.scalable for c in candidates)
        self.rank_local_fields = tuple(sorted({"carry"} | {"a_" + f for c in candidates
                                                           for f in c.rank_local_fields}))
        self.link = None if not config.bandwidth_gbit else Link(
            config.bandwidth_gbit * 1e9 / 8, (config.latency_ms or 0.0) * 1e-3)
        self.start_costs = None  # agreed codec ms per candidate on the reference matrix
        self._counters = {}  # key -> (step, choice, world size): the state's counters, mirrored on the host
        self._shadows = {}  # key -> [shadow state per candidate] during a window
        self._samples = {}  # key -> [(times ms, errors)] per candidate during a window
        self._firsts = {}  # key -> [(screen ms, screen error) per candidate] of the window's first step
        self._pruned = {}  # key -> indices of candidates not run again in this window
        self._infos = {}  # key -> TensorInfo of the tensors in a window
        self._clock = {}  # step -> [host time of the step's first compress, shadow seconds]
        self._gate = (None, None)  # (probe step, this rank's step lanes for it: _round)
        self._types = {}  # field names -> (AutoState class, candidate state class)
        self.held_by = {}  # tensor key -> the key of the AutoGroup sending it now (auto/group.py)
        self.groups = {}  # group key -> its AutoGroup
        self.decisions = {}  # key -> the last Decision
        self.history = []  # every Decision of this process, in order (host values)

    @staticmethod
    def canonical(candidates) -> str:
        """The one way to write a list of built candidates (equal lists give equal specs and
        accept each other's checkpoints): each as its canonical spec (``scheme.spec()``: lower
        case, no blanks, options that differ from their defaults), its main option (the
        config's ``PRIMARY``) written as a bare value when it is the only one, default or
        not, and a candidate's options joined by ``&``: ``"FP16 | TopKC:ratio=0.1|thc"`` ->
        ``"fp16|topkc:0.1|thc:4"``, ``"topkc:max_age=20,ratio=0.1"`` ->
        ``"topkc:ratio=0.1&max_age=20"``."""
        out = []
        for scheme in candidates:
            spec = scheme.spec()
            name, _, rest = spec.partition(":")
            first = getattr(type(scheme.config), "PRIMARY", None)
            if first is not None and all(o.startswith(first + "=") for o in rest.split(",") if o):
                decl = options_of(scheme.config)[first]
                spec = f"{name}:{decl.format(getattr(scheme.config, first))}"
            out.append(spec.replace(",", OPTION_JOIN))
        return "|".join(out)

    def bind(self, ops):
        for c in self.candidates:
            c.bind(ops)
        return self

    def set_link(self, link: Link, start_costs=None):
        """Use ``link`` (the same on every rank) from the next decision on, and
        ``start_costs`` (per candidate, codec ms on the reference matrix averaged over the
        ranks, or None) for the start of tensors not seen yet."""
        self.link = Link(*(float(v) for v in link))
        self.start_costs = None if start_costs is None else tuple(float(v) for v in start_costs)

    # ---- state ----
    def _pack(self, step, choice, inner, carry):
        """An AutoState of the counters (tensors), the optional carry and ``inner``'s fields."""
        kept = () if carry is None else (carry,)
        fields = ("step", "choice") + (() if carry is None else ("carry",)) + \
            tuple("a_" + f for f in inner._fields)
        cls = self._types.get(fields)
        if cls is None:
            cls = self._types[fields] = (namedtuple("AutoState", fields), type(inner))
        return cls[0](step, choice, *kept, *inner)

    def _state(self, ops, like, step: int, choice: int, inner, carry=None):
        return self._pack(ops.constant(step, "int64", like), ops.constant(choice, "int64", like),
                          inner, carry)

    def _inner(self, state):
        cls = self._types[tuple(state._fields)][1]
        return cls(*(v for f, v in zip(state._fields, state) if f.startswith("a_")))

    def _next_state(self, state, inner, carry):
        """``state`` with its counters moved on by one on the device (no new host tensors)."""
        return self._pack(state.step + 1, state.choice, inner, carry)

    def init(self, ops, info: TensorInfo, like):
        """A fresh state at step 0 on the start choice (:func:`start_choice`); the tensor's
        host mirror starts over too. A tensor leaving an :class:`~hvd_gradcomp.auto.group.AutoGroup`
        (sent alone again before its window) starts from the group's step and choice instead."""
        left = self._leaving(ops, info, like)
        if left is not None:
            return left
        self.forget(info.key)
        reference = dataclasses.replace(info, key="auto.reference", shape=REFERENCE_SHAPE,
                                        dtype="float32")
        choice = self.fallback if self.link is None else start_choice(
            self._wires(info), self._wires(reference), info.world_size, self.link,
            self.fallback, self.config.hysteresis, self.start_costs, self.config.step_penalty,
            self._dtypes(reference))
        return self._state(ops, like, 0, choice, self.candidates[choice].init(ops, info, like))

    def _leaving(self, ops, info, like):
        """The state of a tensor leaving its group: the group's device step (one host read, at
        the window's start) and choice, the candidate's fresh state, the mirror at the group's;
        None if no group holds it."""
        gkey = self.held_by.pop(info.key, None)
        at = None if gkey is None else self._counters.get(gkey)
        if at is None or at[2] != info.world_size:
            return None
        grp = self.groups.get(gkey)
        step = at[0] if grp is None or grp.step is None else int(ops.to_host(grp.step))
        self._counters[info.key] = at
        return self._state(ops, like, step, at[1], self.candidates[at[1]].init(ops, info, like))

    def init_like(self, ops, info: TensorInfo, like, loaded):
        """The fresh state of the loaded state's choice (its fields differ by choice), with a
        zero ``carry`` if the loaded state holds one."""
        fields = dict(zip(getattr(loaded, "_fields", ()), loaded))
        choice = int(ops.to_host(fields["choice"])) if "choice" in fields else -1
        if not 0 <= choice < len(self.candidates):
            raise ValueError(f"auto: loaded state for tensor {info.key!r} has no valid choice "
                             f"(got {choice}; {len(self.candidates)} candidates)")
        if not self._fits(info)[choice]:
            raise ValueError(f"auto: loaded state for tensor {info.key!r} chose {self.specs[choice]}, "
                             f"which does not accept {info.dtype}{list(info.shape)}; start this "
                             f"compressor afresh (do not load its state_dict)")
        carry = ops.zeros((info.numel,), "float32", like) if "carry" in fields else None
        return self._state(ops, like, 0, choice, self.candidates[choice].init(ops, info, like), carry)

    def forget(self, key):
        """Drop the host mirror of ``key``'s counters (its state was replaced by a load), and
        the window's step clock and cached step lanes (their step numbers may come again)."""
        for table in (self._counters, self._shadows, self._samples, self._firsts, self._pruned, self._infos):
            table.pop(key, None)
        self._clock.clear()
        self._gate = (None, None)

    def residual_of(self, ops, state, info):
        """The pending error feedback in the gradient's coordinates: the current candidate's
        plus the ``carry``; None when there is neither."""
        cand = self.candidates[int(ops.to_host(state.choice))]
        own = composite.residual_of(cand, ops, self._inner(state), info)
        carry = getattr(state, "carry", None)
        if carry is None or own is None:
            return own if carry is None else carry
        return own + carry

    def add_residual(self, ops, state, info, residual):
        """``state`` with ``residual`` (float32 ``[numel]``, the gradient's coordinates) added
        to the current candidate's error feedback, or, for one that keeps none, to the
        ``carry`` when there is one; None when there is neither (the state keeps no error
        feedback: :func:`~hvd_gradcomp.composite.add_residual`'s rule). Used by
        :func:`~hvd_gradcomp.base.finish_tensor` for what a half-precision output could not
        hold: with neither, the output is then not clamped, exactly as for the fixed fp16 and
        bf16 schemes (its overflow is the sum's own). Never reads the device: a carry made
        here only when ``residual`` is not all 0 would take a host read (a device sync on a
        GPU) per tensor and step of every float16/bfloat16 gradient (issue 35). A state not
        stepped yet (no host mirror: error feedback moved into a fresh state, e.g. a checkpoint's
        slice of a grouped tensor, :mod:`~hvd_gradcomp.auto.group`) takes it as a ``carry``."""
        at = self._counters.get(info.key)
        choice = at[1] if at is not None else int(ops.to_host(state.choice))
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        absorbed = composite.add_residual(self.candidates[choice], ops, inner, info, residual)
        if absorbed is not None:
            return self._pack(state.step, state.choice, absorbed, carry)
        if carry is None:  # a state not stepped yet (error feedback moved into it from a bucket
            # group's checkpoint or holder) keeps it as a carry, which its sync step delivers
            return None if at is not None else self._pack(state.step, state.choice, inner, residual)
        return self._pack(state.step, state.choice, inner, carry + residual)

    def _position(self, ops, state, info):
        """``(step, choice, sync)`` of ``info``'s tensor for this compress (docs/auto.md,
        *Agreement*): ``sync`` at the first compress after an init or a load, or when the world
        size changed (its state is not known to be the other ranks'); at a probe of the host
        mirror the state's step is read (a step some rank missed did not count)."""
        at = self._counters.get(info.key)
        if at is None or at[2] != info.world_size:
            return int(ops.to_host(state.step)), int(ops.to_host(state.choice)), True
        step, choice, world = at
        if self._phase(step)[1]:
            true = int(ops.to_host(state.step))
            if true != step:
                step = true
                self._counters[info.key] = (step, choice, world)
        return step, choice, False

    def _phase(self, step: int):
        """(in a window, is the probe) for ``step``."""
        cfg = self.config
        end = cfg.warmup - 1
        if step <= end:
            return True, step == end
        offset = (step - end) % cfg.every
        return offset == 0 or offset > cfg.every - cfg.warmup, offset == 0

    # ---- the step ----
    def compress(self, ops, x, state, info, finite):
        if not ops.eager():
            raise ValueError("auto: runs eagerly only (it reads its step on the host); in TensorFlow "
                             "call tf.config.run_functions_eagerly(True) (Horovod's "
                             "DistributedGradientTape and DistributedOptimizer all-reduce inside a "
                             "tf.function of their own, even when called eagerly)")
        if self.link is None:
            raise ValueError("auto: the link is unknown: build the compressor after hvd.init() (it "
                             "measures the link then), call compressor.calibrate() on every rank, or "
                             "pass bandwidth_gbit= and latency_ms=")
        step, choice, sync = self._position(ops, state, info)
        window, probe = self._phase(step)
        if window:
            self._clock.setdefault(step, [time.perf_counter(), 0.0])
            self._measure(ops, x, info, step)
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        cand = self.candidates[choice]
        unsent = None
        if carry is not None:
            x = x + ops.reshape(carry, ops.shape(x))
            if cand.scalable and composite.payload_dtype(cand, info) == "float16":
                x, unsent = _saturate_carried(ops, x, info.world_size)
        if sync or (probe and not cand.scalable):  # the float32 flush (step 3; Agreement)
            residual = composite.residual_of(cand, ops, inner, info)
            flat = ops.reshape(x, (info.numel,))
            corrected = flat if residual is None else flat + residual
            tail = self._sync_lanes(info, step, choice) if sync else self._lanes(info, step)
            payload = ops.concat([corrected, ops.constant(tail, "float32", x)], 0)
            return poison(ops, payload, finite), _AutoCtx("sync" if sync else "flush", choice, step, None, (),
                                                      carry is not None, None)
        payload, ctx = cand.compress(ops, x, inner, info, finite if cand.guards_nonfinite else None)
        shape = tuple(ops.shape(payload))
        dtype = ops.dtype(payload)
        if probe:
            lanes = poison(ops, ops.constant(self._lanes(info, step), dtype, x), finite)
        else:  # one count lane (Agreement); made on the device (no host-to-device copy a step)
            lanes = ops.zeros((1,), dtype, x) + _count_lane(info, dtype)
        flat = ops.reshape(payload, (math.prod(shape),))
        return ops.concat([flat, lanes], 0), _AutoCtx("ride" if probe else "", choice, step, ctx, shape,
                                                  carry is not None, unsent)

    @staticmethod
    def _candidate_part(ops, payload, ctx):
        """The candidate's part of the all-reduced payload, in its own shape."""
        return ops.reshape(payload[:math.prod(ctx.shape)], ctx.shape)

    def receive(self, ops, payload, ctx, info):
        if ctx.probe in ("flush", "sync"):
            return ctx
        return ctx._replace(inner=self.candidates[ctx.choice].receive(ops, self._candidate_part(ops, payload, ctx), ctx.inner, info))

    def decompress(self, ops, payload, ctx, info):
        if ctx.probe in ("flush", "sync"):
            return payload[:info.numel]
        return self.candidates[ctx.choice].decompress(ops, self._candidate_part(ops, payload, ctx), ctx.inner, info)

    def finish(self, ops, payload, ctx, state, info):
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        n = info.world_size
        if ctx.probe in ("flush", "sync"):
            new, lanes = inner, ops.to_host(payload[info.numel:])
            if ctx.probe == "sync":
                return self._synced(ops, payload, ctx, state, info, lanes)
        else:
            own = self._candidate_part(ops, payload, ctx)
            new = self.candidates[ctx.choice].finish(ops, own, ctx.inner, inner, info)
            if ctx.carried:  # delivered: what did not fit is the new carry; a failed step keeps it
                carry = _delivered(ops, own, carry, ctx.unsent)
            if not ctx.probe:  # the step counts only if every rank contributed (no host read)
                count = ops.cast(payload[math.prod(ctx.shape)], "float32")
                full = _contributors(count, info, ops.dtype(payload)) >= n - 0.5
                self._counters[info.key] = (ctx.step + 1, ctx.choice, n)  # probes read the state's step
                return self._pack(state.step + ops.cast(full, "int64"), state.choice, new, carry)
            lanes = ops.to_host(ops.cast(payload[math.prod(ctx.shape):], "float32"))
        count = lanes[0]
        finite = all(math.isfinite(v) for v in lanes)
        if finite and not _contributors(count, info, "float32") >= n - 0.5:
            # Some rank sat this step out (hvd.join()): nothing decided, the step does not
            # count (the probe comes again); a flush delivered what this rank sent.
            if ctx.probe == "flush":
                new, carry = self._flushed(ops, inner, ctx.choice), None
            self._counters[info.key] = (ctx.step, ctx.choice, n)
            return self._pack(state.step, state.choice, new, carry)
        for table in (self._shadows, self._samples, self._firsts, self._pruned, self._infos):
            table.pop(info.key, None)
        if not finite:
            # A rank failed this step: nothing decided, nothing flushed (the states stay as the
            # candidate's finish left them); the schedule moves on, and the next window decides.
            self._counters[info.key] = (ctx.step + 1, ctx.choice, n)
            return self._state(ops, payload, ctx.step + 1, ctx.choice, new, carry)
        if ctx.probe == "flush":  # exact: the residual and the carry are delivered
            new, carry = self._flushed(ops, inner, ctx.choice), None
        cands = len(self.candidates)
        codec_ms = [lanes[1 + i] / count for i in range(cands)]
        errors = [lanes[1 + cands + i] / count for i in range(cands)]
        speedup, step_ms = lanes[1 + 2 * cands] / count, lanes[2 + 2 * cands] / count
        lead = [v / count for v in lanes[3 + 2 * cands:]]
        wire = self._wires(info)
        cfg = self.config
        current = None if ctx.step == cfg.warmup - 1 else ctx.choice
        choice, predicted, reason = decide(codec_ms, errors, wire, info.world_size, self.link,
                                           current, self.fallback, cfg.error_budget, cfg.hysteresis,
                                           self._dtypes(info))
        # The leading tensor's decision, from its agreed figures (the same on every rank).
        held = lead[2 * cands:]
        leader = decide([v - 1000.0 * self.link.seconds(0, info.world_size) for v in lead[:cands]],
                        lead[cands:2 * cands], [0] * cands, info.world_size, self.link,
                        held.index(max(held)) if max(held) > 0.5 else None, self.fallback,
                        cfg.error_budget, cfg.hysteresis)[0]
        if leader != choice and (leader == self.fallback or errors[leader] <= cfg.error_budget) \
                and math.isfinite(wire[leader]) and predicted[leader] - predicted[choice] <= cfg.follow * step_ms:
            reason = (f"follows the leading tensor's choice: {predicted[leader] - predicted[choice]:.3g} ms "
                      f"more, below follow x step ({cfg.follow:.3g} x {step_ms:.3g} ms)")
            choice = leader
        # A lossy current choice is held by the hysteresis; the start is not (a guess: held,
        # it kept the LM on PowerSGD for 500 steps at a predicted 1.42x, 0.47x FP16's TTA).
        held = current is not None and current != self.fallback
        need = (1.0 + cfg.step_penalty) * (1.0 - cfg.hysteresis if held else 1.0)
        if choice != self.fallback and cfg.step_penalty > 0 and not speedup >= need:
            choice, reason = self.fallback, (f"step gate: compression predicted {speedup:.3g}x faster "
                                             f"a step than fp16, below {need:.3g}")
        decision = Decision(choice, self.specs[choice], predicted, tuple(errors), reason, ctx.step,
                            info.key, speedup)
        self.decisions[info.key] = decision
        self.history.append(decision)
        if choice != ctx.choice and info.rank == 0:
            log.info("hvd_gradcomp auto: tensor %s: %s -> %s at step %d (%s; predicted %.3g ms "
                     "against %.3g ms; error %.3g; step speedup %.3g; %d payload bytes against "
                     "fp16's %d)", info.key, self.specs[ctx.choice], self.specs[choice], ctx.step,
                     reason, predicted[choice], predicted[ctx.choice], errors[choice], speedup,
                     wire[choice], wire[self.fallback])
        self._counters[info.key] = (ctx.step + 1, choice, n)
        if choice != ctx.choice:  # step 6: carry the old candidate's error feedback over
            old = self.candidates[ctx.choice]
            pending = None if ctx.probe == "flush" else composite.residual_of(old, ops, new, info)
            if carry is not None:
                pending = carry if pending is None else pending + carry
            new = self.candidates[choice].init(ops, info, payload)
            carry = None
            if pending is not None:
                absorbed = composite.add_residual(self.candidates[choice], ops, new, info, pending)
                new, carry = (new, pending) if absorbed is None else (absorbed, None)
        return self._state(ops, payload, ctx.step + 1, choice, new, carry)

    # ---- facts ----
    def wire(self, info: TensorInfo) -> WireBytes:
        """The current choice's bytes and its count lane (a probe step adds ``2 + 5 C`` lane
        values more, or sends float32 instead, as a sync step does; neither is counted here)."""
        cand = self.candidates[self._counters.get(info.key, (0, self.fallback))[1]]
        own = cand.wire(info)
        return own._replace(payload=own.payload + itemsize(composite.payload_dtype(cand, info)))

    def sent_zeros(self, ops, ctx):
        """The chosen candidate's ctx as a rank that sent zeros
        (:func:`~hvd_gradcomp.composite.sent_zeros`); a flush or sync step's float32 payload
        is summed whole."""
        if ctx.probe in ("flush", "sync"):
            return ctx
        return ctx._replace(inner=composite.sent_zeros(self.candidates[ctx.choice], ops, ctx.inner))

    def metrics(self, state) -> dict:
        return {"choice": state.choice, "step": state.step}

    def history_records(self) -> list:
        """Every decision so far as plain dicts, oldest first: ``key``, ``step`` (the probe
        step), ``scheme`` (the spec chosen), ``reason``, ``speedup`` (the step gate's), and per
        candidate spec its ``predicted_ms`` and ``errors`` (JSON-ready; NaN/inf as None)."""
        def num(v):
            return v if math.isfinite(v) else None
        return [{"key": d.key, "step": d.step, "scheme": d.spec, "reason": d.reason,
                 "speedup": num(d.speedup),
                 "predicted_ms": {s: num(v) for s, v in zip(self.specs, d.predicted_ms)},
                 "errors": {s: num(v) for s, v in zip(self.specs, d.errors)}} for d in self.history]

    def explain(self, key) -> dict:
        """Host facts of ``key``'s last decision: scheme, predicted ms, error, reason, the step
        gate's speedup and the step penalty it was held to (fixed by the option; not learned);
        bytes saved against fp16 per step are added by the adapter (``metrics()``); {} before
        one."""
        d = self.decisions.get(key)
        if d is None:
            at = self._counters.get(key)
            return {} if at is None else {"scheme": self.specs[at[1]]}
        return {"scheme": d.spec, "predicted_ms": d.predicted_ms[d.choice],
                "fp16_predicted_ms": d.predicted_ms[self.fallback], "error": d.errors[d.choice],
                "reason": d.reason, "decided_at": d.step, "speedup": d.speedup,
                "step_penalty": self.config.step_penalty}
