"""Scale model: projected step time and time-to-accuracy (TTA) ratio against FP16 for N workers.

We cannot run 4096 workers; this projects what the measured per-step quantities of each
compressor imply on a cluster, with every assumption a flag. This module is the model (its
inputs, the step time, the ratio, the check against measured runs); the command
``python -m hvd_gradcomp.bench model`` that tabulates it over (N, bandwidth), with ``auto``'s
choice and the heat-map, is :mod:`.model_projection`.

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

:func:`predict_step_time` is the function to check against measured bandwidth-limited runs;
:func:`check_against_runs` applies it to the TTA harness's run summaries (``report.RUN_COLUMNS``).
"""
import csv
import json
import math
import os
from typing import NamedTuple, Optional

from ..ring import ring_allreduce_seconds, ring_rounds

__all__ = ["Measurement", "Network", "StepTime", "latency", "allreduce_time",
           "predict_step_time", "tta_ratio", "winning_ranges", "load_inputs",
           "measurement_from_run", "check_against_runs", "load_shapes",
           "REFERENCE_MODELS", "WORKERS", "BANDWIDTHS_GBPS", "DEFAULT_INPUTS", "BASELINE",
           "format_check"]

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


def format_check(checks) -> str:
    """Text table of :func:`check_against_runs` results."""
    lines = [f"{'run':44s} {'predicted ms':>12s} {'measured ms':>12s} {'error':>7s}"]
    for c in checks:
        lines.append(f"{c['spec']:44s} {c['predicted_s'] * 1e3:12.1f} {c['measured_s'] * 1e3:12.1f} "
                     f"{c['rel_error']:+7.0%}")
    return "\n".join(lines)
