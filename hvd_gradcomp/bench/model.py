"""Scale model: projected step time and time-to-accuracy (TTA) ratio against FP16 for N workers.

``python -m hvd_gradcomp.bench model [--inputs FILE] [--workers 8,...,4096] [--gbps 10,...,400]``

We cannot run 4096 workers; this projects what the measured per-step quantities of each
compressor imply on a cluster, with every assumption a flag.

Inputs (per compressor, one step of one worker; JSON or CSV, see :func:`load_inputs`):
    compute_s         forward + backward time of the model (s), no communication.
    codec_s           compress + decompress time of all gradient tensors (s).
    payload_bytes     bytes of all payloads handed to Horovod's all-reduce.
    side_bytes        bytes of all side collectives issued inside compress.
    side_collectives  how many side collectives (each a separate synchronous all-reduce).
    steps_to_target   steps to reach the target accuracy (None: same as FP16's).
  optional:
    codec_fixed_s     part of codec_s that does not grow with tensor size (per-op dispatch
                      or launch overhead); it is not rescaled by ``codec_scale``.
    payload_bytes_by_workers / side_bytes_by_workers  {N: bytes}: wire sizes that depend on N
                      (THC's integer lanes widen like log2 N); the nearest N not above is used.
                      A null (None) value means the compressor cannot run at that N (THC
                      stops at 1024 workers): its step time is infinite, its ratio 0 ("n/a").

The model (one step, per worker):
    1. Ring all-reduce of ``b`` bytes over ``N`` workers on links of ``B`` bytes/s
       (bandwidth-optimal: each worker sends and receives ``2 (N-1)/N * b``; :mod:`.ring`,
       the formula the TTA link check uses too):
           t_ar(b) = lat(N) + 2 (N-1)/N * b / B
       ``lat(N) = alpha + hop * hops(N)``: ``alpha`` is the fixed cost of one collective
       (Horovod queues a request and serves it on its next cycle, 1 ms by default in 0.28.1,
       so half a cycle on average: default 0.5 ms), ``hop`` the per-message network latency
       (default 5 us), ``hops(N)`` = ``2 ceil(log2 N)`` (``tree``, default, the latency of a
       tree/NCCL-style small-message all-reduce), ``2 (N-1)`` (``ring``) or ``0`` (``none``:
       the plain ``alpha + 2(N-1)/N b/B`` form).
    2. Payloads: Horovod fuses the payloads of all tensors into buffers of
       ``fusion_bytes`` (128 MiB, its 0.28.1 default): ``ceil(P / F)`` collectives,
           t_payload = ceil(P / F) * lat(N) + 2 (N-1)/N * P / B.
       (Per-tensor collectives would cost one ``lat(N)`` each; fusion is Horovod's default.)
    3. Side collectives are synchronous calls inside compress, one per tensor, never fused:
           t_side = side_collectives * lat(N) + 2 (N-1)/N * side_bytes / B.
    4. Step time; the codec runs on the compute device in line with backward, the side
       collectives block the backward hook, and a fraction ``overlap`` of the compute time can
       hide the payload all-reduce (0 by default: nothing overlaps, the conservative case for
       FP16 and for the compressors alike):
           t_step = compute + codec + t_side + max(0, t_payload - overlap * compute)
           codec  = codec_fixed + (codec_s - codec_fixed) * codec_scale
    5. TTA ratio against FP16 (> 1: the compressor reaches the target sooner):
           ratio = (steps_fp16 * t_step_fp16) / (steps * t_step)

Not modelled: stragglers, congestion and oversubscribed fabrics (links are assumed to
deliver ``B`` per worker at any N), hierarchical all-reduce, compute that changes with N.

Outputs: a table of the ratio for every (N, bandwidth), the bandwidth below which each
compressor beats FP16 at each N (where it starts and where it stops), and a heat-map PNG.
:func:`predict_step_time` is the function to check against measured bandwidth-limited runs;
:func:`check_against_runs` applies it to the TTA harness's run summaries (``report.RUN_COLUMNS``).
"""
import argparse
import csv
import json
import math
import os
import sys
from typing import NamedTuple, Optional

from ..ring import ring_allreduce_seconds, ring_rounds

__all__ = ["Measurement", "Network", "StepTime", "latency", "allreduce_time",
           "predict_step_time", "tta_ratio", "winning_ranges", "load_inputs",
           "measurement_from_run", "check_against_runs", "load_shapes",
           "REFERENCE_MODELS", "WORKERS", "BANDWIDTHS_GBPS", "DEFAULT_INPUTS", "main"]

WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BANDWIDTHS_GBPS = (10, 25, 40, 100, 200, 400)
DEFAULT_INPUTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_inputs_resnet50.json")
BASELINE = "fp16"
_FIELDS = ("compute_s", "codec_s", "payload_bytes", "side_bytes", "side_collectives",
           "steps_to_target", "codec_fixed_s")
_REQUIRED = ("compute_s", "codec_s", "payload_bytes")


class Measurement(NamedTuple):
    """One compressor's measured per-step quantities (module docstring, "Inputs")."""

    compute_s: float
    codec_s: float
    payload_bytes: float
    side_bytes: float = 0.0
    side_collectives: int = 0
    steps_to_target: Optional[float] = None
    codec_fixed_s: float = 0.0
    payload_bytes_by_workers: Optional[dict] = None  # {N (int): bytes}
    side_bytes_by_workers: Optional[dict] = None  # {N (int): bytes}

    def payload_at(self, workers: int) -> float:
        """Payload bytes at ``workers`` (the by-workers table if given, nearest N not above)."""
        return _bytes_at_world_size(self.payload_bytes_by_workers, workers, self.payload_bytes)

    def side_at(self, workers: int) -> float:
        """Side-collective bytes at ``workers`` (as :meth:`payload_at`)."""
        return _bytes_at_world_size(self.side_bytes_by_workers, workers, self.side_bytes)


def _bytes_at_world_size(table, workers, default):
    """``table``'s value at the largest world size <= ``workers`` (its smallest if none is; ``default``
    for an empty table; inf where the value is None: the scheme cannot run there)."""
    if not table:
        return default
    keys = sorted(k for k in table if k <= workers)
    value = table[keys[-1]] if keys else table[min(table)]
    return math.inf if value is None else value


class Network(NamedTuple):
    """Cluster assumptions (module docstring, steps 1-4).

    alpha_s: fixed cost of one collective, seconds (default 0.5e-3: half a Horovod cycle).
    hop_s: latency of one network message, seconds (default 5e-6).
    hops: "tree" (2 ceil(log2 N), default), "ring" (2 (N-1)) or "none" (0).
    fusion_bytes: Horovod fusion buffer, bytes (default 128 MiB).
    overlap: fraction of compute that can hide the payload all-reduce, in [0, 1] (default 0).
    """

    alpha_s: float = 0.5e-3
    hop_s: float = 5e-6
    hops: str = "tree"
    fusion_bytes: int = 128 * 2 ** 20
    overlap: float = 0.0

    def check(self):
        """Raise ValueError for out-of-range settings."""
        if self.hops not in ("tree", "ring", "none"):
            raise ValueError(f"model: hops must be tree, ring or none, got {self.hops!r}")
        if self.alpha_s < 0 or self.hop_s < 0:
            raise ValueError(f"model: latencies must be >= 0, got alpha {self.alpha_s}, hop {self.hop_s}")
        if self.fusion_bytes <= 0:
            raise ValueError(f"model: fusion_bytes must be > 0, got {self.fusion_bytes}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"model: overlap must be in [0, 1], got {self.overlap}")
        return self


class StepTime(NamedTuple):
    """Predicted step time and its parts, seconds."""

    compute: float
    codec: float
    side: float
    payload: float  # the exposed part (after overlap)
    total: float


def latency(workers: int, net: Network = Network()) -> float:
    """lat(N) = alpha + hop * hops(N), seconds; 0 for a single worker (no collective)."""
    if workers <= 1:
        return 0.0
    hops = {"tree": 2 * math.ceil(math.log2(workers)), "ring": ring_rounds(workers), "none": 0}[net.hops]
    return net.alpha_s + net.hop_s * hops


def allreduce_time(nbytes: float, workers: int, gbps: float, net: Network = Network(),
                   collectives: int = 1) -> float:
    """Seconds for ``collectives`` ring all-reduces moving ``nbytes`` in total.

    ``collectives * lat(N) + 2 (N-1)/N * nbytes / (gbps * 1e9 / 8)``
    (:func:`.ring.ring_allreduce_seconds` with ``lat(N)`` from :func:`latency`); 0 for one
    worker. ``gbps`` is the link bandwidth in Gbit/s.

    Raises:
        ValueError: ``gbps`` <= 0.
    """
    if workers <= 1 or (collectives == 0 and nbytes == 0):
        return 0.0
    if gbps <= 0:
        raise ValueError(f"model: bandwidth must be > 0 Gbit/s, got {gbps}")
    return ring_allreduce_seconds(nbytes, workers, gbps * 1e9 / 8, latency(workers, net), collectives)


def predict_step_time(m: Measurement, workers: int, gbps: float, net: Network = Network(),
                      codec_scale: float = 1.0) -> StepTime:
    """Predicted time of one training step (module docstring, steps 2-4).

    Args:
        m: the compressor's measured quantities (for FP16 itself too).
        workers: N, number of workers in the all-reduce.
        gbps: link bandwidth per worker, Gbit/s.
        net: latency, fusion and overlap assumptions.
        codec_scale: factor on the size-dependent part of the codec time (e.g. this CPU's copy
            bandwidth over the target device's).

    Returns:
        StepTime(compute, codec, side, payload, total), seconds.
    """
    payload = m.payload_at(workers)
    side_bytes = m.side_at(workers)
    if math.isinf(payload) or math.isinf(side_bytes):  # not runnable at this N
        return StepTime(m.compute_s, math.inf, math.inf, math.inf, math.inf)
    fused = math.ceil(payload / net.fusion_bytes) if payload > 0 else 0
    t_payload = allreduce_time(payload, workers, gbps, net, collectives=fused)
    t_side = allreduce_time(side_bytes, workers, gbps, net, collectives=m.side_collectives)
    exposed = max(0.0, t_payload - net.overlap * m.compute_s)
    fixed = min(m.codec_fixed_s, m.codec_s)
    codec = fixed + (m.codec_s - fixed) * codec_scale
    return StepTime(m.compute_s, codec, t_side, exposed, m.compute_s + codec + t_side + exposed)


def tta_ratio(m: Measurement, fp16: Measurement, workers: int, gbps: float,
              net: Network = Network(), codec_scale: float = 1.0) -> float:
    """(steps_fp16 * t_step_fp16) / (steps * t_step); > 1 = reaches the target sooner than FP16.

    A missing ``steps_to_target`` (on either side) counts as equal steps; a compressor that
    cannot run at ``workers`` gets 0.
    """
    ours = predict_step_time(m, workers, gbps, net, codec_scale).total
    ref = predict_step_time(fp16, workers, gbps, net, codec_scale).total
    if math.isinf(ours):
        return 0.0
    steps = 1.0
    if m.steps_to_target is not None and fp16.steps_to_target is not None:
        steps = fp16.steps_to_target / m.steps_to_target
    return steps * ref / ours


def winning_ranges(m, fp16, workers, lo_gbps, hi_gbps, net=Network(), codec_scale=1.0, points=400):
    """Bandwidth intervals (Gbit/s) within [lo, hi] where ``tta_ratio > 1`` at ``workers``.

    Scans a log-spaced grid and refines each crossing by bisection (to 0.1%).

    Returns:
        list of (start, end) pairs, ascending; [] if FP16 wins everywhere in the range.
    """
    def ratio(b):
        return tta_ratio(m, fp16, workers, b, net, codec_scale)

    grid = [lo_gbps * (hi_gbps / lo_gbps) ** (i / (points - 1)) for i in range(points)]
    wins = [ratio(b) > 1.0 for b in grid]

    def crossing(a, b):
        wa = ratio(a) > 1.0
        while b / a > 1.001:
            mid = math.sqrt(a * b)
            if (ratio(mid) > 1.0) == wa:
                a = mid
            else:
                b = mid
        return math.sqrt(a * b)

    out, start = [], (grid[0] if wins[0] else None)
    for i in range(1, points):
        if wins[i] != wins[i - 1]:
            x = crossing(grid[i - 1], grid[i])
            if wins[i]:
                start = x
            else:
                out.append((start, x))
                start = None
    if start is not None:
        out.append((start, grid[-1]))
    return out


def measurement_from_run(row):
    """A TTA-harness run summary (``report.RUN_COLUMNS``) as model inputs.

    Per-step means from the run: ``compute_s = compute_share * clock_s / steps`` and
    ``codec_s = codec_share * clock_s / steps``; wire bytes from ``bytes_payload``,
    ``bytes_side`` and ``side_collectives``.

    Returns:
        (Measurement, workers, gbps, link_latency_s): ``gbps`` from ``bandwidth_mbit``
        (None when the run was not bandwidth-limited), ``link_latency_s`` from ``latency_ms``.

    Raises:
        ValueError: the row lacks steps, clock or shares.
    """
    steps, clock = row.get("steps"), row.get("clock_s")
    if not steps or clock in (None, "") or row.get("compute_share") in (None, ""):
        raise ValueError(f"model: run {row.get('run_id')!r} lacks steps, clock_s or compute_share")
    per_step = float(clock) / float(steps)
    m = Measurement(compute_s=float(row["compute_share"]) * per_step,
                    codec_s=float(row.get("codec_share") or 0.0) * per_step,
                    payload_bytes=float(row.get("bytes_payload") or 0.0),
                    side_bytes=float(row.get("bytes_side") or 0.0),
                    side_collectives=int(float(row.get("side_collectives") or 0)))
    mbit = row.get("bandwidth_mbit")
    gbps = float(mbit) / 1e3 if mbit not in (None, "") else None
    latency_s = float(row.get("latency_ms") or 0.0) / 1e3
    return m, int(row["world_size"]), gbps, latency_s


def check_against_runs(rows, net: Network = Network(hops="ring")):
    """Predicted vs measured step time for bandwidth-limited TTA runs.

    For each run with a bandwidth and a median step time: the model's step time from the
    run's own compute, codec and wire numbers (:func:`measurement_from_run`), with the run's
    link latency as ``hop_s`` (``net.hop_s`` when the run has none), against
    ``step_ms_median``. Runs without a bandwidth or status other than "ok" are skipped.

    Returns:
        list of dicts: run_id, spec, workers, gbps, predicted_s, measured_s, rel_error
        ((predicted - measured) / measured).
    """
    out = []
    for row in rows:
        if (row.get("status") or "ok") != "ok" or row.get("step_ms_median") in (None, ""):
            continue
        m, workers, gbps, latency_s = measurement_from_run(row)
        if gbps is None:
            continue
        run_net = net._replace(hop_s=latency_s) if latency_s else net
        predicted = predict_step_time(m, workers, gbps, run_net).total
        measured = float(row["step_ms_median"]) / 1e3
        out.append({"run_id": row.get("run_id"), "spec": row.get("spec"), "workers": workers,
                    "gbps": gbps, "predicted_s": predicted, "measured_s": measured,
                    "rel_error": (predicted - measured) / measured})
    return out


# ---------------------------------------------------------------------------------------
# Reference model (used by ``overhead --model-inputs`` to build the default inputs)
# ---------------------------------------------------------------------------------------
_HERE = os.path.dirname(os.path.abspath(__file__))


def load_shapes(path: str):
    """Gradient tensor shapes of a reference model, from a package-data JSON file.

    The file holds ``{"model", "source", "tensors", "parameters", "shapes": [[d0, d1, ...], ...]}``
    (see ``model_shapes_resnet50.json``).

    Returns:
        list of shape tuples (ints), in the model's parameter order.

    Raises:
        ValueError: the count of shapes or of parameters differs from the file's own
            ``tensors`` / ``parameters``, or a dimension is not a positive integer.
    """
    with open(path) as f:
        data = json.load(f)
    shapes = [tuple(int(d) for d in s) for s in data["shapes"]]
    if any(d < 1 for s in shapes for d in s):
        raise ValueError(f"model: {path}: every dimension must be an integer >= 1")
    params = sum(math.prod(s) for s in shapes)
    if len(shapes) != data["tensors"] or params != data["parameters"]:
        raise ValueError(f"model: {path}: {len(shapes)} shapes with {params} parameters, but the file "
                         f"states {data['tensors']} and {data['parameters']}")
    return shapes


REFERENCE_MODELS = {
    "resnet50": {
        # torchvision's ResNet-50 parameter shapes, in its parameter order (package data).
        "shapes": load_shapes(os.path.join(_HERE, "model_shapes_resnet50.json")),
        # An assumption, not a measurement: ResNet-50 v1.5 training with mixed precision at
        # batch 256 per GPU runs at roughly 2,500 images/s on one A100, i.e. ~0.1 s per step.
        "compute_s": 0.1,
        "note": "ResNet-50 (torchvision layout, 161 gradient tensors, 25.6 M parameters); "
                "compute_s = 0.1 s is an assumption (A100, batch 256, mixed precision)",
    },
}


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------
def _measurement(name, entry) -> Measurement:
    missing = [f for f in _REQUIRED if entry.get(f) in (None, "")]
    if missing:
        raise ValueError(f"model: compressor {name!r} lacks {missing}; expected fields "
                         f"{list(_FIELDS)}")
    values = {}
    for f in _FIELDS:
        v = entry.get(f)
        if v in (None, ""):
            continue
        v = float(v)
        if v < 0:
            raise ValueError(f"model: compressor {name!r} has {f} = {v}, expected >= 0")
        values[f] = int(v) if f == "side_collectives" else v
    for f in ("payload_bytes_by_workers", "side_bytes_by_workers"):
        table = entry.get(f)
        if table:
            values[f] = {int(k): (None if v is None else float(v)) for k, v in table.items()}
    return Measurement(**values)


def load_inputs(path: str):
    """Read per-compressor measurements.

    Accepted forms:
        JSON ``{"compressors": {name: {field: value}}, "meta": {...}}`` or a bare
        ``{name: {field: value}}``; CSV with a ``compressor`` column and field columns.
        Fields: see the module docstring ("Inputs").

    Returns:
        ({name: Measurement}, meta dict).

    Raises:
        ValueError: a required field is missing or negative, or there is no ``fp16`` entry.
    """
    meta = {}
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            raw = {row["compressor"]: row for row in csv.DictReader(f)}
    else:
        with open(path) as f:
            data = json.load(f)
        if "compressors" in data:
            raw, meta = data["compressors"], data.get("meta", {})
        else:
            raw = {k: v for k, v in data.items() if k != "meta"}
            meta = data.get("meta", {})
    out = {name: _measurement(name, entry) for name, entry in raw.items()}
    if BASELINE not in out:
        raise ValueError(f"model: inputs need an {BASELINE!r} entry (the baseline), got {sorted(out)}")
    return out, meta


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
def _describe(ranges, lo, hi):
    if not ranges:
        return f"never in {lo:g}-{hi:g}"
    parts = []
    for a, b in ranges:
        a_in, b_in = a > lo * 1.0001, b < hi * 0.9999
        if not a_in and not b_in:
            parts.append(f"always in {lo:g}-{hi:g}")
        elif not a_in:
            parts.append(f"below {b:.3g}")
        elif not b_in:
            parts.append(f"above {a:.3g}")
        else:
            parts.append(f"{a:.3g}-{b:.3g}")
    return ", ".join(parts)


def _ratio_cell(r):
    return f"{'n/a':>7}" if r == 0.0 else f"{r:>6.2f}x"


AUTO = "auto"


def auto_choice(inputs, workers: int, gbps: float, net: Network = Network(), codec_scale: float = 1.0,
                hysteresis: Optional[float] = None):
    """What ``auto`` (:mod:`hvd_gradcomp.auto`) would choose in one cell: ``(name, ratio)``.

    Its candidates among the inputs: the schemes of its default candidate list
    (:data:`hvd_gradcomp.auto.DEFAULT_CANDIDATES`) measured without side collectives (auto
    never uses a blocking variant). The one with the highest TTA ratio against FP16 wins if it
    beats FP16 by the hysteresis (ratio >= 1 / (1 - h), h = auto's default), else FP16 stays
    (ratio 1). The model's inputs are whole-model sums, so this is one choice for the whole
    model, where auto decides per tensor (and keeps small tensors on FP16): a lower bound on
    what it gains.
    """
    from hvd_gradcomp.auto import DEFAULT_CANDIDATES, AutoConfig
    families = {spec.split(":")[0] for spec in DEFAULT_CANDIDATES.split("|")}
    h = AutoConfig().hysteresis if hysteresis is None else hysteresis
    fp16 = inputs[BASELINE]
    best, best_ratio = BASELINE, 1.0
    for name, m in inputs.items():
        if name == BASELINE or m.side_collectives > 0 or name.split(":")[0] not in families:
            continue
        ratio = tta_ratio(m, fp16, workers, gbps, net, codec_scale)
        if ratio > best_ratio:
            best, best_ratio = name, ratio
    return (best, best_ratio) if best_ratio >= 1.0 / (1.0 - h) else (BASELINE, 1.0)


def project(inputs, workers, gbps, net, codec_scale):
    """All projections: list of row dicts (compressor, workers, gbps, step parts, ratio,
    choice), with ``auto``'s rows (:func:`auto_choice`) last; ``choice`` is the compressor
    itself, or for ``auto`` the one it picks."""
    fp16 = inputs[BASELINE]
    rows = []
    for name, m in inputs.items():
        for n in workers:
            for b in gbps:
                st = predict_step_time(m, n, b, net, codec_scale)
                rows.append({"compressor": name, "workers": n, "gbps": b,
                             "compute_s": st.compute, "codec_s": st.codec, "side_s": st.side,
                             "payload_s": st.payload, "step_s": st.total,
                             "tta_vs_fp16": tta_ratio(m, fp16, n, b, net, codec_scale), "choice": name})
    for n in workers:
        for b in gbps:
            choice, ratio = auto_choice(inputs, n, b, net, codec_scale)
            st = predict_step_time(inputs[choice], n, b, net, codec_scale)
            rows.append({"compressor": AUTO, "workers": n, "gbps": b, "compute_s": st.compute,
                         "codec_s": st.codec, "side_s": st.side, "payload_s": st.payload,
                         "step_s": st.total, "tta_vs_fp16": ratio, "choice": choice})
    return rows


def format_report(inputs, meta, rows, workers, gbps, net, codec_scale):
    """The text report: assumptions, ratio table, where each compressor beats FP16."""
    lines = ["Scale model: TTA ratio vs FP16 = (steps_fp16 * step_fp16) / (steps * step), "
             ">1 = reaches the target sooner than FP16.",
             f"Network: lat(N) = {net.alpha_s * 1e3:g} ms + {net.hop_s * 1e6:g} us * hops(N), "
             f"hops = {net.hops}; ring all-reduce bandwidth term 2(N-1)/N * bytes / link; payloads "
             f"fused into {net.fusion_bytes / 2 ** 20:g} MiB buffers; side collectives one per "
             f"tensor, synchronous; overlap = {net.overlap:g}.",
             f"Codec time scale (size-dependent part): {codec_scale:.4g}."]
    if meta.get("reference_note"):
        lines.append(f"Inputs: {meta['reference_note']}; codec measured on {meta.get('codec_measured_on', '?')}.")
    lines.append("")
    lines.append("Measured inputs per step (raw):")
    lines.append(f"  {'compressor':28} {'compute s':>10} {'codec ms':>10} {'fixed ms':>9} "
                 f"{'payload MB':>11} {'side KB':>9} {'side #':>7} {'steps':>8}")
    for name, m in inputs.items():
        steps = "-" if m.steps_to_target is None else f"{m.steps_to_target:g}"
        lines.append(f"  {name:28} {m.compute_s:10.4f} {m.codec_s * 1e3:10.2f} {m.codec_fixed_s * 1e3:9.2f} "
                     f"{m.payload_bytes / 1e6:11.3f} {m.side_bytes / 1e3:9.1f} {m.side_collectives:7d} {steps:>8}")
    by = {(r["compressor"], r["workers"], r["gbps"]): r for r in rows}
    fp16 = inputs[BASELINE]
    lo, hi = min(gbps), max(gbps)
    for name, m in inputs.items():
        if name == BASELINE:
            continue
        lines.append("")
        lines.append(f"{name}: TTA ratio vs FP16 (rows N, columns Gbit/s); where it beats FP16")
        lines.append("  " + f"{'N':>6} " + " ".join(f"{b:>7g}" for b in gbps) + "   beats FP16 (Gbit/s)")
        for n in workers:
            cells = " ".join(_ratio_cell(by[(name, n, b)]["tta_vs_fp16"]) for b in gbps)
            ranges = winning_ranges(m, fp16, n, lo, hi, net, codec_scale)
            lines.append(f"  {n:>6} {cells}   {_describe(ranges, lo, hi)}")
        for b in gbps:
            won = [n for n in workers if by[(name, n, b)]["tta_vs_fp16"] > 1.0]
            if not won:
                txt = "never"
            elif len(won) == len(workers):
                txt = f"at every N in {workers[0]}-{workers[-1]}"
            else:
                txt = f"at N = {', '.join(map(str, won))}"
            lines.append(f"  at {b:g} Gbit/s it beats FP16 {txt}")
    auto = {(r["workers"], r["gbps"]): r for r in rows if r["compressor"] == AUTO}
    if auto:
        width = max(7, max(len(r["choice"]) for r in auto.values()))
        lines.append("")
        lines.append("auto: its predicted choice (rows N, columns Gbit/s; one choice for the whole model, "
                     "see model.auto_choice)")
        lines.append("  " + f"{'N':>6} " + " ".join(f"{b:>{width}g}" for b in gbps))
        for n in workers:
            lines.append(f"  {n:>6} " + " ".join(f"{auto[(n, b)]['choice']:>{width}}" for b in gbps))
    return "\n".join(lines) + "\n"


def heatmap(rows, inputs, workers, gbps, path, title=""):
    """One panel per compressor (not FP16): log2 TTA ratio over (bandwidth, N), cells annotated."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    names = [n for n in inputs if n != BASELINE]
    if not names:
        return None
    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 4.0 * nrows + 0.6), squeeze=False,
                             layout="constrained")
    by = {(r["compressor"], r["workers"], r["gbps"]): r["tta_vs_fp16"] for r in rows}
    image = None
    for ax, name in zip(axes.flat, names):
        grid = np.array([[by[(name, n, b)] for b in gbps] for n in workers])
        shown = np.ma.masked_where(grid <= 0, np.log2(np.where(grid > 0, grid, 1.0)))
        image = ax.imshow(shown, cmap="RdBu", vmin=-2, vmax=2, origin="lower", aspect="auto")
        for i in range(len(workers)):
            for j in range(len(gbps)):
                text = "n/a" if grid[i, j] <= 0 else f"{grid[i, j]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5)
        ax.set_xticks(range(len(gbps)), [f"{b:g}" for b in gbps])
        ax.set_yticks(range(len(workers)), [str(n) for n in workers])
        ax.set_xlabel("link Gbit/s")
        ax.set_ylabel("workers N")
        ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    cbar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    cbar.set_ticks([-2, -1, 0, 1, 2], labels=["0.25x", "0.5x", "1x", "2x", "4x"])
    cbar.set_label("TTA ratio vs FP16 (blue: beats FP16)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()]


def _parser():
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench model",
                                description="Project step time and TTA ratio vs FP16 for N workers "
                                            "and link bandwidths from measured inputs.")
    p.add_argument("--inputs", default=DEFAULT_INPUTS, help="JSON or CSV of per-compressor measurements")
    p.add_argument("--check", default=None, metavar="RUNS_CSV",
                   help="instead: predicted vs measured step time for a TTA sweep's runs.csv")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)))
    p.add_argument("--gbps", default=",".join(map(str, BANDWIDTHS_GBPS)), help="link bandwidths, Gbit/s")
    p.add_argument("--alpha-ms", type=float, default=Network().alpha_s * 1e3,
                   help="fixed cost per collective, ms (default 0.5: half a Horovod cycle)")
    p.add_argument("--hop-us", type=float, default=Network().hop_s * 1e6, help="per-message latency, us")
    p.add_argument("--hops", choices=("tree", "ring", "none"), default="tree")
    p.add_argument("--fusion-mib", type=float, default=128.0)
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of compute hiding the payload")
    p.add_argument("--codec-scale", type=float, default=None,
                   help="factor on the size-dependent codec time (default: the inputs' meta "
                        "codec_scale, else 1)")
    p.add_argument("--compute-s", type=float, default=None, help="override every compute_s")
    p.add_argument("--ignore-codec", action="store_true",
                   help="set every codec time to 0 (the communication-only view that ignores "
                        "compute overhead), for comparison")
    p.add_argument("--only", default=None, help="comma-separated compressors to keep (fp16 always kept)")
    p.add_argument("--out", default="runs/model", help="folder for model.txt, model.csv, model_heatmap.png")
    return p


def format_check(checks) -> str:
    """Text table of :func:`check_against_runs` results."""
    lines = [f"{'run':44s} {'predicted ms':>12s} {'measured ms':>12s} {'error':>7s}"]
    for c in checks:
        lines.append(f"{c['spec']:44s} {c['predicted_s'] * 1e3:12.1f} {c['measured_s'] * 1e3:12.1f} "
                     f"{c['rel_error']:+7.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        with open(args.check) as f:
            checks = check_against_runs(list(csv.DictReader(f)))
        print(f"Scale model vs measured median step time ({args.check}):")
        print(format_check(checks))
        return 0
    inputs, meta = load_inputs(args.inputs)
    if args.compute_s is not None:
        inputs = {k: m._replace(compute_s=args.compute_s) for k, m in inputs.items()}
    if args.ignore_codec:
        inputs = {k: m._replace(codec_s=0.0, codec_fixed_s=0.0) for k, m in inputs.items()}
    if args.only:
        keep = {BASELINE} | {s.strip() for s in args.only.split(",")}
        inputs = {k: m for k, m in inputs.items() if k in keep}
    net = Network(args.alpha_ms / 1e3, args.hop_us / 1e6, args.hops,
                  int(args.fusion_mib * 2 ** 20), args.overlap).check()
    codec_scale = args.codec_scale if args.codec_scale is not None else float(meta.get("codec_scale", 1.0))
    workers, gbps = _ints(args.workers), _floats(args.gbps)
    rows = project(inputs, workers, gbps, net, codec_scale)
    report = format_report(inputs, meta, rows, workers, gbps, net, codec_scale)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model.txt"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "model.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    png = heatmap(rows, inputs, workers, gbps, os.path.join(args.out, "model_heatmap.png"),
                  title=f"TTA ratio vs FP16; lat = {net.alpha_s * 1e3:g} ms + {net.hop_s * 1e6:g} us x "
                        f"{net.hops} hops; codec scale {codec_scale:.3g}")
    print(f"wrote {args.out}/model.txt, model.csv" + (", model_heatmap.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
