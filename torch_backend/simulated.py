"""N virtual ranks in one process: one compressor per rank, payloads reduced as the collective would.

Usage::

    from torch_backend.simulated import SimulatedEngine
    engine = SimulatedEngine(8)                       # 8 ranks, op "sum" (DDP's), or "average"
    comps = engine.compressors("thc")                 # one compressor per rank, each bound to
                                                      # its rank's view (rank r of 8)
    outs = engine.allreduce_bucket(comps, buffers, members)   # buffers[r]: rank r's flat bucket

Each virtual rank owns a compressor built from the same spec, bound (``bind_engine``) to its
:class:`RankEngine`: ``world()`` answers ``(N, r)``, so every rank keeps its own state (error
feedback) and its own random streams (THC's per-rank rounding, seeded by the rank), exactly
as on N processes. Only the compressor's public engine API is used: ``plan_bucket``,
``encode_unit``, ``decode``, ``bind_engine``, ``state_dict``/``load_state_dict``.

**The reduction** (:meth:`SimulatedEngine.reduce`), per payload dtype, of the ranks' payloads
packed into one flat buffer per dtype (sorted by dtype name, as the DDP hook packs them):

- integers are summed exactly (in int64) and wrapped to the payload's width, as a collective's
  integer adds wrap (THC's ``subtract_own`` lanes rely on the sum modulo 2**32);
- floats are summed in the payload's dtype, in ring order: the flat buffer is cut into N
  chunks (chunk c = elements ``[c*m//N, (c+1)*m//N)``) and chunk c is accumulated over ranks
  c, c+1, ..., c+N-1 (mod N), each addition rounded to the dtype, as a ring reduce-scatter does;
- ``op="average"`` then applies Horovod's Average as its CPU path does (the sum scaled by the
  double 1/N and converted back: floats rounded, integers truncated toward zero; THC's guard
  bits recover the exact sums from the truncated words).

Every rank then decodes its own copy of the reduced payload (``decode(divide=N)`` under
``"sum"``, ``decode()`` under ``"average"``), so each rank's state moves on as it would on its
own process, and the decoded results can be compared across ranks.

**Collectives outside compress** (``state_dict(gather=True)``'s object gather, ``calibrate``'s
all-reduce) need every rank to post them: :meth:`SimulatedEngine.run` runs a function once per
rank, a thread per rank, and the ranks' :class:`RankEngine` meet at a barrier (timeout
``timeout_s``: a rank that never posts its part breaks the barrier, every rank gets a
RuntimeError, none hangs). Called outside :meth:`~SimulatedEngine.run`, such a collective
raises RuntimeError at once. **Blocking collectives inside compress** (the papers' two-round
variants, e.g. THC ``range="current"``, whose side all-reduce is Horovod's ``ops.allreduce``)
are refused at :meth:`~SimulatedEngine.bind` with a ValueError, as the DDP hook refuses them:
they post Horovod's collective, not the engine's. ``auto`` without ``bandwidth_gbit`` is refused
there too (there is no link to measure in one process).
"""
import threading
import time

import torch

from .compression import Compression, check_compressor

__all__ = ["SimulatedEngine", "RankEngine"]

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class RankEngine:
    """Rank ``rank``'s view of a :class:`SimulatedEngine`: the engine protocol of
    ``bind_engine`` (``world()``, ``gather(obj)``, ``allreduce(x, average)``)."""

    def __init__(self, engine, rank: int):
        self.engine, self.rank = engine, rank

    def world(self):
        """``(N, rank)``."""
        return self.engine.world_size, self.rank

    def gather(self, obj):
        """``[obj of rank 0, 1, ...]``; inside :meth:`SimulatedEngine.run` only (RuntimeError else)."""
        return self.engine._collective(self.rank, "gather", obj)

    def allreduce(self, x, average: bool):
        """``x`` summed over the ranks (ring order, :meth:`SimulatedEngine.reduce`), divided by N
        when ``average``; inside :meth:`SimulatedEngine.run` only. ``x`` is left unchanged."""
        y = self.engine._collective(self.rank, "allreduce", x)
        return y / self.engine.world_size if average else y

    def __repr__(self):
        return f"RankEngine(rank {self.rank} of {self.engine.world_size})"


class SimulatedEngine:
    """N virtual ranks in one process (module docstring).

    Args:
        world_size: N >= 1.
        op: ``"sum"`` (DDP's: decoded with ``divide=N``) or ``"average"`` (Horovod's
            ``op=Average``, emulated as its CPU path applies it; decoded as Horovod's decompress).
        timeout_s: how long a rank waits at a collective of :meth:`run` for the others.
        clock: the clock of :attr:`timings` (default ``time.perf_counter``; ``time.thread_time``
            counts this thread's CPU time only, unaffected by other jobs on a shared machine).

    Attributes:
        timings: ``{"encode_s": [per rank], "decode_s": [per rank], "reduce_s": float}``,
            seconds summed over :meth:`allreduce_bucket` calls (:meth:`take_timings` resets).

    Raises:
        ValueError: ``world_size`` < 1 or an unknown ``op``.
    """

    def __init__(self, world_size: int, op: str = "sum", timeout_s: float = 120.0, clock=None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"SimulatedEngine: world_size must be an int >= 1, got {world_size!r}")
        if op not in ("sum", "average"):
            raise ValueError(f"SimulatedEngine: op must be 'sum' or 'average', got {op!r}")
        self.world_size, self.op, self.timeout_s = world_size, op, float(timeout_s)
        self.clock = clock or time.perf_counter
        self._views = [RankEngine(self, r) for r in range(world_size)]
        self._barrier = None
        self._slots = None
        self.timings = None
        self.take_timings()

    def view(self, rank: int) -> RankEngine:
        """Rank ``rank``'s engine (what its compressor is bound to)."""
        return self._views[rank]

    def __repr__(self):
        return f"SimulatedEngine({self.world_size}, op={self.op!r})"

    # ---- binding ----
    def bind(self, compressors) -> list:
        """Bind ``compressors[r]`` to rank r's view, for every r; returns them as a list.

        Raises:
            ValueError: not one compressor per rank, specs that differ between ranks, a
                compressor bound already, a route to a blocking variant (module docstring), an
                adaptive scheme without a given link (``auto`` needs ``bandwidth_gbit=``).
            TypeError: not a PyTorch compressor (``torch_backend.Compression``).
        """
        compressors = list(compressors)
        if len(compressors) != self.world_size:
            raise ValueError(f"{self!r}.bind: expected {self.world_size} compressors (one per rank), "
                             f"got {len(compressors)}")
        for r, comp in enumerate(compressors):
            check_compressor(comp, "SimulatedEngine.bind", "the simulated engine")
            if comp.spec != compressors[0].spec:
                raise ValueError(f"SimulatedEngine.bind: rank {r}'s compressor is {comp.spec!r}, rank "
                                 f"0's {compressors[0].spec!r}; every rank must run the same spec")
            if any(s.adaptive and s.link is None for s in comp.routing.schemes()):
                raise ValueError(f"SimulatedEngine.bind: {comp.spec!r} is adaptive and measures its "
                                 f"link at bind time; one process has no link: give it one "
                                 f"(e.g. auto:bandwidth_gbit=10)")
            if len(set(map(id, compressors))) != len(compressors):
                raise ValueError("SimulatedEngine.bind: one compressor object given for several "
                                 "ranks; each rank needs its own (its own state)")
        for r, comp in enumerate(compressors):
            comp.codec.bind_engine(self._views[r])
        return compressors

    def compressors(self, spec: str) -> list:
        """One new compressor per rank from the text ``spec``, bound (:meth:`bind`)."""
        return self.bind([Compression.from_spec(spec) for _ in range(self.world_size)])

    # ---- the reduction ----
    def reduce(self, tensors, op=None):
        """The collective's result of the ranks' ``tensors`` (one per rank, equal shapes and
        dtypes), reduced with ``op`` (default the engine's) as the module docstring says.
        Returns a new tensor of that shape and dtype.

        Raises:
            ValueError: not one tensor per rank, or shapes/dtypes that differ (naming the rank).
        """
        op = op or self.op
        n = self.world_size
        if len(tensors) != n:
            raise ValueError(f"{self!r}.reduce: expected {n} tensors (one per rank), got {len(tensors)}")
        first = tensors[0]
        for r, t in enumerate(tensors):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"{self!r}.reduce: rank {r} sent {t.dtype}{list(t.shape)}, rank 0 "
                                 f"{first.dtype}{list(first.shape)}; a collective needs equal payloads")
        dtype, shape = first.dtype, first.shape
        flat = torch.stack([t.reshape(-1) for t in tensors])  # [n, m]
        m = flat.shape[1]
        if dtype in _INT_DTYPES or dtype == torch.bool:
            out = flat.to(torch.int64).sum(0)
            if dtype != torch.int64 and dtype != torch.bool:
                bits = torch.iinfo(dtype).bits
                lo = 1 << (bits - 1) if dtype != torch.uint8 else 0
                out = torch.remainder(out + lo, 1 << bits) - lo  # wrap as the collective's adds do
            if op == "average":
                out = torch.trunc(out.to(torch.float64) * (1.0 / n)).to(torch.int64)
            return out.to(dtype).reshape(shape)
        if n == 1 or m == 0:
            out = flat[0].clone()
        else:
            # chunk c of [c*m//n, (c+1)*m//n) is summed over ranks c, c+1, ... (mod n)
            bounds = torch.tensor([c * m // n for c in range(n + 1)])
            chunk = torch.bucketize(torch.arange(m), bounds[1:], right=True)  # [m]
            order = (chunk.unsqueeze(0) + torch.arange(n).unsqueeze(1)) % n  # [n, m]: summand j
            ranked = flat.gather(0, order.to(flat.device))
            out = ranked[0].clone()
            for j in range(1, n):
                out = out + ranked[j]  # rounded to the dtype at every addition
        if op == "average":
            out = (out.to(torch.float64) * (1.0 / n)).to(dtype)
        return out.reshape(shape)

    # ---- one bucket through every rank's codec ----
    def allreduce_bucket(self, compressors, buffers, members) -> list:
        """Every rank's bucket planned, encoded, reduced, decoded: ``[rank r's decoded buffer]``.

        Args:
            compressors: one per rank, bound by :meth:`bind` to this engine.
            buffers: rank r's flat bucket (1-D, one float dtype, equal sizes on every rank),
                without autograd history; not modified.
            members: the bucket's tensors (:class:`hvd_gradcomp.buckets.Member`: key, label,
                shape, offset, numel), the same on every rank.

        Returns a new flat tensor per rank (the buffer's dtype): the decoded mean of every
        member (the engine's op: ``"sum"`` decodes with ``divide=N``; ``"average"`` as Horovod's
        decompress), zero where no member lies. Each rank's compressor state moves on.

        Raises:
            ValueError: before any reduction, on a mismatch between ranks (buffer sizes or
                dtypes, payload shapes), a compressor not bound to this engine, or what the
                compressor refuses (``plan_bucket``/``encode_unit``: a shape change under one
                key, ...).
        """
        n = self.world_size
        compressors, buffers = list(compressors), list(buffers)
        if len(compressors) != n or len(buffers) != n:
            raise ValueError(f"{self!r}.allreduce_bucket: expected {n} compressors and buffers, got "
                             f"{len(compressors)} and {len(buffers)}")
        for r, (comp, buf) in enumerate(zip(compressors, buffers)):
            if comp.engine is not self._views[r]:
                raise ValueError(f"{self!r}.allreduce_bucket: rank {r}'s compressor is bound to "
                                 f"{comp.engine!r}, not {self._views[r]!r}; use engine.bind()")
            if buf.dim() != 1 or buf.shape != buffers[0].shape or buf.dtype != buffers[0].dtype:
                raise ValueError(f"{self!r}.allreduce_bucket: rank {r}'s buffer is "
                                 f"{buf.dtype}{list(buf.shape)}, rank 0's {buffers[0].dtype}"
                                 f"{list(buffers[0].shape)}; one flat buffer of one size per rank")
        dtype = str(buffers[0].dtype).removeprefix("torch.")
        members = tuple(members)
        encoded, plans = [], []
        for r in range(n):
            t0 = self.clock()
            plan = compressors[r].codec.plan_bucket(members, dtype, self.op, None, buffers[r])
            units = []
            for unit in plan.units:
                buf = buffers[r]
                x = buf[unit.start:unit.stop] if unit.contiguous else buf.index_select(0, unit.index)
                if len(unit.members) == 1 and tuple(x.shape) != tuple(unit.info.shape):
                    x = x.view(unit.info.shape)
                units.append(compressors[r].codec.encode_unit(unit, x))
            self.timings["encode_s"][r] += self.clock() - t0
            plans.append(plan)
            encoded.append(units)
        keys = [u.key for u in plans[0].units]
        for r in range(1, n):
            if [u.key for u in plans[r].units] != keys:
                raise ValueError(f"{self!r}.allreduce_bucket: rank {r} planned units "
                                 f"{[u.key for u in plans[r].units]}, rank 0 {keys}")
            for k, ((p, _), (p0, _)) in enumerate(zip(encoded[r], encoded[0])):
                if p.shape != p0.shape or p.dtype != p0.dtype:
                    raise ValueError(f"{self!r}.allreduce_bucket: unit {keys[k]!r}: rank {r}'s payload is "
                                     f"{p.dtype}{list(p.shape)}, rank 0's {p0.dtype}{list(p0.shape)}")
        t0 = self.clock()
        reduced = self._reduce_packed([[p for p, _ in units] for units in encoded])
        covered = [False] * len(members)
        for unit in plans[0].units:
            for i in unit.members:
                covered[i] = True
        loose = [m for m, c in zip(members, covered) if not c and m.numel]  # passed through whole
        loose_sum = {m.offset: self.reduce([b[m.offset:m.offset + m.numel] for b in buffers]) for m in loose}
        self.timings["reduce_s"] += self.clock() - t0
        outs = []
        for r in range(n):
            t0 = self.clock()
            out = torch.zeros_like(buffers[r])
            for unit, (_, ctx), payload in zip(plans[r].units, encoded[r], reduced):
                payload = payload.clone()  # each rank decodes its own copy, as after a real collective
                if self.op == "sum":
                    dec = compressors[r].codec.decode(payload, ctx, divide=n)
                else:
                    dec = compressors[r].codec.decode(payload, ctx)
                dec = dec.reshape(-1).to(out.dtype)
                if unit.contiguous:
                    out[unit.start:unit.stop] = dec
                else:
                    out.index_copy_(0, unit.index, dec)
            for m in loose:
                s = loose_sum[m.offset]
                out[m.offset:m.offset + m.numel] = s / n if self.op == "sum" and s.is_floating_point() else s
            self.timings["decode_s"][r] += self.clock() - t0
            outs.append(out)
        return outs

    def _reduce_packed(self, payloads):
        """``payloads[r][k]``: rank r's payload of unit k. Packed into one flat buffer per dtype
        (sorted by name), each reduced (:meth:`reduce`), unpacked: ``[reduced payload of unit k]``."""
        n_units = len(payloads[0])
        by_dtype = {}
        for k, p in enumerate(payloads[0]):
            by_dtype.setdefault(p.dtype, []).append(k)
        out = [None] * n_units
        for dt in sorted(by_dtype, key=str):
            ks = by_dtype[dt]
            flats = [torch.cat([payloads[r][k].reshape(-1) for k in ks]) for r in range(self.world_size)]
            summed = self.reduce(flats)
            offset = 0
            for k in ks:
                shape, numel = payloads[0][k].shape, payloads[0][k].numel()
                out[k] = summed[offset:offset + numel].view(shape)
                offset += numel
        return out

    def take_timings(self) -> dict:
        """The :attr:`timings` so far, and reset them."""
        out = self.timings
        self.timings = {"encode_s": [0.0] * self.world_size, "decode_s": [0.0] * self.world_size,
                        "reduce_s": 0.0}
        return out

    # ---- collectives outside compress: a thread per rank ----
    def run(self, fn) -> list:
        """``[fn(0), fn(1), ..., fn(N-1)]``, each call in its own thread, so the ranks'
        collectives outside compress (``gather``, ``allreduce``) meet. An exception on any rank
        breaks the collectives of the others (RuntimeError there); the lowest rank's own
        exception is raised here after every thread has ended.

        Raises:
            RuntimeError: :meth:`run` is already running (it does not nest).
        """
        if self._barrier is not None:
            raise RuntimeError(f"{self!r}.run: already running; it does not nest")
        n = self.world_size
        results, errors = [None] * n, [None] * n
        self._barrier = threading.Barrier(n, timeout=self.timeout_s)
        self._slots = [None] * n

        def body(r):
            try:
                results[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after every thread
                errors[r] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"simulated-rank-{r}") for r in range(n)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self._barrier = None
            self._slots = None
        own = [e for e in errors if e is not None and not isinstance(e, _Broken)]
        if own or any(errors):
            raise (own or [e for e in errors if e is not None])[0]
        return results

    def _collective(self, rank: int, kind: str, value):
        barrier, slots = self._barrier, self._slots
        if barrier is None:
            raise RuntimeError(f"{self!r}: rank {rank} posted a {kind} outside SimulatedEngine.run(); "
                               f"collectives outside compress need every rank to post them: call "
                               f"e.g. engine.run(lambda r: comps[r].state_dict(gather=True))")
        slots[rank] = (kind, value)
        try:
            barrier.wait()
            kinds = {k for k, _ in slots}
            if len(kinds) > 1:
                raise _Broken(f"{self!r}: the ranks posted different collectives ({sorted(kinds)}); "
                              f"rank {rank} posted a {kind}")
            if kind == "gather":
                out = [v for _, v in slots]
            else:
                out = self.reduce([v for _, v in slots], "sum")
            barrier.wait()
        except threading.BrokenBarrierError:
            raise _Broken(f"{self!r}: rank {rank}'s {kind} broke off: another rank failed or did not "
                          f"post it within {self.timeout_s:g} s") from None
        return out


class _Broken(RuntimeError):
    """A collective of :meth:`SimulatedEngine.run` that another rank broke (not the root cause)."""
