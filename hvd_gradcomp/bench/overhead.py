"""Compute overhead of every compressor: compress + decompress, collective excluded.

``python -m hvd_gradcomp.bench overhead [--quick] [--frameworks torch,tensorflow] ...``

What one timed *call* is:
    1. ``compress_tensor(scheme, ops, grad, state, info)`` (hvd_gradcomp.base), the same code
       path the Horovod adapters run, with ``info = TensorInfo(key, shape, "float32",
       world_size, rank=0)``.
    2. ``finish_tensor(...)`` on the payload exactly as compress returned it: the decoded
       output and the state after the step (as the adapters' ``decompress`` does).
    3. **Collective excluded**: the payload all-reduce is skipped. The default variants post
       no other collective; the blocking two-round variants (``blocking = True``, e.g.
       ``topkc:selection=current``) have their side all-reduce (``ops.allreduce``) replaced
       by the identity (:func:`hvd_gradcomp.primitives.one_rank`). The time is the
       compressor's own compute on this device, nothing else.
    4. The state returned is fed to the next call, so error feedback accumulates as in training.
    Each spec is a compressor: the scheme timed on a tensor is the one its routing picks for
    that tensor, as the adapters' (:class:`hvd_gradcomp.routing.Routing`; e.g. ``thc`` times a
    tensor below its ``min_numel``, 1024 by default, as fp16).

How it is timed:
    - Every compressor of one tensor is timed round-robin (one call each per round), so all of
      them see the same background load; FP16 is always among them and is the reference.
    - ``--warmup`` calls each first (TensorFlow: after one trace; the concrete function is
      reused), then rounds until ``--reps`` calls or ``--budget`` seconds per tensor (at least
      ``--min-reps``). The median is reported with the 10th-90th percentile spread.
    - CPU: the host clock around each call (CPU kernels run synchronously); ``--clock thread``
      (PyTorch, one thread): that thread's CPU time instead, on a machine shared with other
      jobs (the time slices others take are not counted; their memory traffic still is).
      ``--kernels both`` times each spec a second time with the core's reference kernels
      (row ``spec +ref``: no hand-written fused forms of ``torch_backend.kernels``, as with
      ``HVD_GRADCOMP_KERNELS=0``), in the same rounds. PyTorch on GPU:
      CUDA events around each call. TensorFlow on GPU (it has no device-event API): the host
      clock around one ``tf.function`` that runs the call ``--tf-inner`` times back to back
      and ends in one device sync; per-call time = sample / inner.

Columns (the table prints raw numbers first, then ratios; the CSV has the same fields):
    median_ms, p10_ms, p90_ms: per call.
    grad_gbps: gradient bytes (numel * 4) / median, in GB/s (1e9 bytes).
    payload_bytes, side_bytes, side_collectives: ``scheme.wire(info)`` (what would travel).
    floor_bytes: the bytes any implementation of the scheme must at least move through memory:
        gradient read once + result written once + state read and written once each +
        payload written and read once + side-collective buffers written and read once.
        (0 for ``none``, which hands the gradient over untouched.)
    floor_ms: floor_bytes / copy bandwidth, where the copy bandwidth is measured in the same run
        (``dst.copy_(src)`` of ``--copy-mib`` MiB, larger than the caches; bytes read + written
        per second; the best of the frameworks run on that device).
    vs_fp16: FP16 median / this median (>1 = cheaper than the FP16 cast; printed ``1.87x``).
    x_floor: median / floor_ms (1.00x = at memory speed; < 1 happens when the tensor stays in
        cache; large values mean extra passes, copies, sorting or per-call overhead).
    wire_vs_fp16: FP16 wire bytes / this scheme's wire bytes (payload + side), > 1 = fewer bytes.

Machine settings (their effect, measured: docs/bench.md, "The machine and the method"):
    - ``--malloc keep`` (default) calls glibc ``mallopt`` so freed memory is kept by the process
      (no mmap for large blocks, no trimming). Without it every temporary tensor above the
      mmap threshold is returned to the kernel when freed and page-faulted back in when the
      next one is allocated, which would be counted against whichever compressor makes the
      most temporaries. GPU frameworks cache their allocations anyway.
    - ``--threads 1`` (default on CPU): when other processes share the cores, a multi-thread
      kernel waits at its barrier for a descheduled thread.

Also writes scale-model inputs (``--model-inputs PATH``): the summed codec time and the wire
bytes of a reference model's gradient tensors per compressor (see ``model.py``).
"""
import argparse
import csv
import io
import json
import os
import sys

from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.bench.launch import MALLOC_TRIM_THRESHOLD
from hvd_gradcomp.bench.overhead_timing import (COLUMNS, COMPILED, REFERENCE, UNFUSED, make_runner,
                                                measure, numel_of, parse_devices)
from hvd_gradcomp.registry import SCHEMES
from hvd_gradcomp.routing import Routing

__all__ = ["main", "whole_model_table", "model_inputs", "DEFAULT_LAYERS", "apply_malloc_policy",
           "write_csv", "format_table"]

# Real layer shapes (PyTorch layout): a 3x3 conv kernel, a BERT-size linear and embedding.
DEFAULT_LAYERS = {
    "conv": ("conv 256x256x3x3", (256, 256, 3, 3)),
    "linear": ("linear 4096x1024", (4096, 1024)),
    "embedding": ("embedding 30000x512", (30000, 512)),
}


def apply_malloc_policy(policy: str) -> str:
    """``"keep"``: ask glibc to keep freed memory (no mmap'd blocks, no trimming).

    Returns a short description of what was done (``"system"`` when nothing was, or when the
    C library has no ``mallopt``).
    """
    if policy != "keep":
        return "system"
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        # mallopt parameters from <malloc.h>: M_TRIM_THRESHOLD = -1, M_MMAP_MAX = -4; the
        # values of launch.MALLOC_KEEP_TUNABLES, which the TTA sweep gives its ranks.
        ok = libc.mallopt(-1, MALLOC_TRIM_THRESHOLD) == 1 and libc.mallopt(-4, 0) == 1
    except (OSError, AttributeError):
        return "system (no glibc mallopt)"
    return "keep (glibc: mmap off, trim off)" if ok else "system (mallopt refused)"


def _build_schemes(text, compile_mode="off", kernels="on"):
    """[(spec, Routing)] from compressor specs separated by spaces or ';' ("all" = every
    registered name but the adaptive ``auto``); ``Routing.from_spec`` of each (so ``thc:min_numel=512`` is accepted).

    FP16 (the reference of the ratios) is always first and never compiled. ``compile_mode``
    "both" adds a compiled row (spec + :data:`COMPILED`) after each other spec; "on" compiles
    every other spec; "off" none. ``kernels`` "both" adds an unfused row (spec +
    :data:`UNFUSED`: the reference kernels, no fused forms) after each other spec.
    """
    # auto is left out of "all": its cost is its choice's plus its measurement windows,
    # which this benchmark times on their own (its candidates).
    every = [name for name in sorted(SCHEMES) if not SCHEMES[name][1].adaptive]
    specs = []
    for token in text.replace(";", " ").split():
        specs.extend(every if token == "all" else [token])
    out, seen = [], set()
    for spec in [REFERENCE] + specs:
        if spec in seen:
            continue
        seen.add(spec)
        routing = Routing.from_spec(spec)
        if spec == REFERENCE or compile_mode != "on":
            out.append((spec, routing))
        if spec != REFERENCE and kernels == "both":
            out.append((spec + UNFUSED, routing))
        if spec != REFERENCE and compile_mode in ("on", "both"):
            out.append((spec + COMPILED, routing))
    return out


def _cases(args):
    cases = [(f"flat 2^{p}", (2 ** p,)) for p in range(args.min_log2, args.max_log2 + 1, args.step)]
    for name in [n.strip() for n in args.layers.split(",") if n.strip() and n.strip() != "none"]:
        if name not in DEFAULT_LAYERS:
            raise ValueError(f"overhead: unknown layer {name!r}; expected some of {sorted(DEFAULT_LAYERS)} or none")
        cases.append(DEFAULT_LAYERS[name])
    return cases


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------
def _fmt(value, kind):
    if value is None or value == "":
        return "-"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "ms":
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    if kind == "mb":
        return f"{value / 1e6:.3f}" if value < 1e8 else f"{value / 1e6:.1f}"
    if kind == "f":
        return f"{value:.2f}"
    return str(value)


def format_table(rows, header_lines=()):
    """The human-readable table: definitions, then per framework/device a block of rows."""
    out = io.StringIO()
    out.write("Compress + decompress per call, COLLECTIVE EXCLUDED (payload all-reduce skipped; the\n"
              "side all-reduce of blocking variants = identity). Raw numbers first, then ratios:\n"
              "  median, p10-p90: ms per call; GB/s: gradient bytes (4 B/coord) / median;\n"
              "  wire MB: payload + side bytes per call; floor MB: bytes the scheme must at least\n"
              "  read+write (grad in, result out, state in+out, payload out+in, side out+in);\n"
              "  vs fp16 = FP16 median / ours (>1 = cheaper than the FP16 cast of the same tensor);\n"
              "  x floor = median / (floor MB / copy bandwidth) (1.00x = memory speed);\n"
              "  1st call s: the first call (tracing, and compiling for '+compile' rows).\n")
    for line in header_lines:
        out.write(line + "\n")
    groups = {}
    for r in rows:
        groups.setdefault((r["framework"], r["device"], r["threads"], r["timer"], r.get("copy_gbps")), []).append(r)
    cols = [("case", 20), ("numel", 10), ("spec", 22), ("median", 9), ("p10-p90", 17), ("GB/s", 7),
            ("wire MB", 9), ("floor MB", 9), ("vs fp16", 8), ("x floor", 8), ("1st call s", 10)]
    for (fw, dev, threads, timer, copy), group in groups.items():
        copy_txt = f"{copy:.1f} GB/s" if copy else "-"
        out.write(f"\n== {fw} on {dev} (threads={threads or 'default'}, timer={timer}, "
                  f"copy bandwidth {copy_txt} read+write)\n")
        out.write(" ".join(name.ljust(w) if i < 3 else name.rjust(w) for i, (name, w) in enumerate(cols)) + "\n")
        for r in group:
            if r["error"]:
                out.write(f"{r['case']:<20} {r['numel']:<10} {r['spec']:<22} ERROR {r['error']}\n")
                continue
            spread = f"{_fmt(r.get('p10_ms'), 'ms')}-{_fmt(r.get('p90_ms'), 'ms')}"
            wire = r["payload_bytes"] + r["side_bytes"]
            vals = [r["case"], str(r["numel"]), r["spec"], _fmt(r.get("median_ms"), "ms"), spread,
                    _fmt(r.get("grad_gbps"), "f"), _fmt(wire, "mb"), _fmt(r.get("floor_bytes"), "mb"),
                    _fmt(r.get("vs_fp16"), "x"), _fmt(r.get("x_floor"), "x"),
                    _fmt(r.get("first_call_s"), "f")]
            out.write(" ".join(v.ljust(w) if i < 3 else v.rjust(w)
                               for i, (v, (_, w)) in enumerate(zip(vals, cols))) + "\n")
    return out.getvalue()


def write_csv(rows, path):
    """Write rows with exactly COLUMNS (empty cells for missing values)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in COLUMNS})


# ---------------------------------------------------------------------------------------
# Scale-model inputs for a reference model
# ---------------------------------------------------------------------------------------
def model_inputs(runner, schemes, reference, *, world_size, warmup, reps, min_reps, budget,
                 copy_gbps, worker_counts, target_copy_gbps=None):
    """Per-compressor inputs of the scale model for a reference model's gradient tensors.

    Every distinct tensor shape is timed once (round-robin over the schemes) and counted as
    often as the model has it. ``codec_fixed_s`` sums, per tensor, ``min(t, t_small)`` where
    ``t_small`` is the scheme's time on a 64x64 tensor: the per-call cost that does not grow
    with size (op dispatch here, kernel launches on a GPU), which the scale model does not
    rescale. ``compute_s`` is the reference's assumed compute time
    (``model.REFERENCE_MODELS``); ``steps_to_target`` is None (equal to FP16's).

    Returns:
        ``{"meta": {...}, "compressors": {spec: {...}}}`` as ``model.load_inputs`` reads it;
        meta ``codec_scale`` = copy_gbps / target_copy_gbps when a target is given.
    """
    from hvd_gradcomp.bench.model import REFERENCE_MODELS
    ref = REFERENCE_MODELS[reference]
    counts = {}
    for shape in ref["shapes"]:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    timing = dict(world_size=world_size, warmup=warmup, reps=reps, min_reps=min_reps, budget=budget,
                  copy_gbps=copy_gbps)
    small = {spec: row.get("median_ms") for (spec, _), row in
             zip(schemes, measure(runner, schemes, "64x64", (64, 64), **timing))}
    totals = {spec: {"codec_s": 0.0, "codec_fixed_s": 0.0, "payload_bytes": 0, "side_bytes": 0,
                     "side_collectives": 0,
                     "payload_bytes_by_workers": {str(n): 0 for n in worker_counts},
                     "side_bytes_by_workers": {str(n): 0 for n in worker_counts}}
              for spec, _ in schemes}
    errors = {}
    for shape, count in counts.items():
        rows = measure(runner, schemes, "x".join(map(str, shape)), shape, **timing)
        for (spec, routing), row in zip(schemes, rows):
            scheme = routing.decide(None, TensorInfo("bench", tuple(shape), "float32", 1, 0)).scheme
            if row["error"] or small[spec] is None:
                errors[spec] = row["error"] or "failed on the 64x64 tensor"
                continue
            t = totals[spec]
            t["codec_s"] += count * row["median_ms"] / 1e3
            t["codec_fixed_s"] += count * min(row["median_ms"], small[spec]) / 1e3
            t["payload_bytes"] += count * row["payload_bytes"]
            t["side_bytes"] += count * row["side_bytes"]
            t["side_collectives"] += count * row["side_collectives"]
            for n in worker_counts:
                key = str(n)
                if t["payload_bytes_by_workers"][key] is None:
                    continue
                try:
                    w = scheme.wire(TensorInfo(f"bench.{row['case']}", shape, "float32", n, 0))
                except ValueError:  # the scheme does not run at this world size (None = n/a)
                    t["payload_bytes_by_workers"][key] = t["side_bytes_by_workers"][key] = None
                    continue
                t["payload_bytes_by_workers"][key] += count * w.payload
                t["side_bytes_by_workers"][key] += count * w.side
        print(f"  reference tensor {shape} x{count}: done", file=sys.stderr, flush=True)
    compressors = {spec: dict(compute_s=ref["compute_s"], steps_to_target=None, **t)
                   for spec, t in totals.items() if spec not in errors}
    meta = {
        "reference": reference, "reference_note": ref["note"],
        "parameters": sum(numel_of(s) for s in ref["shapes"]), "tensors": len(ref["shapes"]),
        "codec_measured_on": f"{runner.framework} {runner.device}, threads={runner.threads}, "
                             f"timer={runner.timer}, world_size={world_size}",
        "copy_gbps": copy_gbps,
        "errors": errors,
    }
    if target_copy_gbps:
        meta["codec_scale"] = copy_gbps / target_copy_gbps
        meta["codec_scale_note"] = (f"size-dependent codec time scaled by this machine's copy bandwidth "
                                    f"({copy_gbps:.1f} GB/s) over a target device's ({target_copy_gbps:g} GB/s)")
    return {"meta": meta, "compressors": compressors}


def whole_model_table(data) -> str:
    """One line per compressor: the codec time of one whole step of the reference model (every
    gradient tensor once, routed as the adapters route it), as measured on this device
    (``codec_s``, not rescaled), and its ratio to FP16's. ``data``: :func:`model_inputs`'s
    result."""
    meta, comps = data["meta"], data["compressors"]
    ref = comps.get(REFERENCE, {}).get("codec_s")
    out = [f"whole model ({meta['reference']}, {meta['tensors']} tensors, {meta['parameters']:,} "
           f"parameters; {meta['codec_measured_on']}): codec time per step, x FP16's"]
    for spec, c in comps.items():
        ratio = f"{c['codec_s'] / ref:.2f}x" if ref else "-"
        out.append(f"  {spec:<36} {c['codec_s'] * 1e3:9.1f} ms  {ratio:>7}  "
                   f"wire {c['payload_bytes'] + c['side_bytes']:>12,} B, "
                   f"{c['side_collectives']} side collectives")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench overhead",
                                description="Compress + decompress cost per compressor and tensor "
                                            "size (collective excluded), against FP16 and a "
                                            "memory-traffic floor.")
    p.add_argument("--schemes", default="all",
                   help="specs separated by spaces or ';' (e.g. 'fp16 topkc:ratio=0.01 thc'); "
                        "'all' = every registered compressor with default options (default)")
    p.add_argument("--frameworks", default="torch,tensorflow")
    p.add_argument("--devices", default="auto", help="cpu, gpu or auto (cpu, plus gpu when present)")
    p.add_argument("--min-log2", type=int, default=12)
    p.add_argument("--max-log2", type=int, default=24, help="largest flat size 2^N (26 for the full range)")
    p.add_argument("--step", type=int, default=2, help="stride of log2 sizes (default 2)")
    p.add_argument("--layers", default="conv,linear,embedding", help="real layer shapes, or none")
    p.add_argument("--world-size", type=int, default=8, help="world size given to the schemes (wire sizes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=3.0, help="seconds per tensor after --min-reps")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per framework (0 = framework default)")
    p.add_argument("--tf-inner", type=int, default=10, help="TF on GPU: calls per synced sample")
    p.add_argument("--malloc", choices=("keep", "system"), default="keep")
    p.add_argument("--copy-mib", type=int, default=64, help="buffer size for the copy bandwidth")
    p.add_argument("--compile", choices=["off", "both", "on"], default="off",
                   help="time the schemes' kernels compiled (torch.compile / XLA): 'both' adds a "
                        "'+compile' row after each spec, 'on' compiles all but FP16")
    p.add_argument("--clock", choices=["host", "thread"], default="host",
                   help="PyTorch on CPU with --threads 1: 'thread' times each call in this thread's "
                        "CPU time (for a machine shared with other jobs; the copy bandwidth stays "
                        "host-timed); default: the host clock")
    p.add_argument("--kernels", choices=["on", "both"], default="on",
                   help="'both' adds a '+ref' row after each spec, timed with the reference kernels "
                        "(no hand-written fused forms, as HVD_GRADCOMP_KERNELS=0) in the same rounds")
    p.add_argument("--ddp-hooks", default="fp16;powersgd:rank=4",
                   type=lambda t: tuple(x.strip() for x in t.split(";") if x.strip() and x.strip() != "off"),
                   help="';'-separated DDP hooks timed as extra PyTorch CPU rows on the same tensors "
                        "(fp16, powersgd:rank=R; 'off' for none)")
    p.add_argument("--quick", action="store_true",
                   help="sizes 2^12..2^18, conv layer only, 5 reps, 0.5 s budget")
    p.add_argument("--out", default="runs/overhead", help="folder for overhead.csv / overhead.txt")
    p.add_argument("--model-inputs", default=None,
                   help="also time a reference model's tensors and write scale-model inputs (JSON) here")
    p.add_argument("--reference", default="resnet50", help="reference model for --model-inputs")
    p.add_argument("--model-only", action="store_true", help="with --model-inputs: skip the size sweep")
    p.add_argument("--target-copy-gbps", type=float, default=1500.0,
                   help="with --model-inputs: copy bandwidth (read+write GB/s) of the device the "
                        "model projects to; sets meta codec_scale (default 1500, an A100-class GPU; "
                        "0 = no scaling)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.min_log2, args.max_log2 = 12, min(args.max_log2, 18)
        args.layers = "conv" if args.layers == _parser().get_default("layers") else args.layers
        args.reps, args.budget = min(args.reps, 5), min(args.budget, 0.5)
    malloc = apply_malloc_policy(args.malloc)
    schemes = _build_schemes(args.schemes, args.compile, args.kernels)
    cases = _cases(args)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    devices = parse_devices(args.devices)
    timing = dict(world_size=args.world_size, warmup=args.warmup, reps=args.reps,
                  min_reps=min(args.min_reps, args.reps), budget=args.budget)
    runners = [r for r in (make_runner(fw, dev, args) for dev in devices for fw in frameworks) if r]
    copy = {}
    for r in runners:
        copy[r.device] = max(copy.get(r.device, 0.0), r.copy_gbps(args.copy_mib))
    rows = []
    if not args.model_only:
        for r in runners:
            for case, shape in cases:
                hooks = args.ddp_hooks if (r.framework, r.device) == ("torch", "cpu") else ()
                rows.extend(measure(r, schemes, case, shape, copy_gbps=copy[r.device], ddp_hooks=hooks,
                                    **timing))
                print(f"  {r.framework}/{r.device} {case}: done", file=sys.stderr, flush=True)
    header = [f"malloc: {malloc}; world_size={args.world_size}; warmup={args.warmup}, "
              f"reps<={args.reps} (>= {timing['min_reps']}, budget {args.budget} s per tensor); "
              f"schemes: {', '.join(s for s, _ in schemes)}"]
    os.makedirs(args.out, exist_ok=True)
    if rows:
        table = format_table(rows, header)
        print(table)
        write_csv(rows, os.path.join(args.out, "overhead.csv"))
        with open(os.path.join(args.out, "overhead.txt"), "w") as f:
            f.write(table)
        print(f"wrote {os.path.join(args.out, 'overhead.csv')} and overhead.txt")
    if args.model_inputs:
        from hvd_gradcomp.bench.model import WORKERS
        first = runners[0]
        data = model_inputs(first, schemes, args.reference, copy_gbps=copy[first.device],
                            worker_counts=WORKERS, target_copy_gbps=args.target_copy_gbps or None,
                            **timing)
        data["meta"]["malloc"] = malloc
        print(whole_model_table(data))
        with open(args.model_inputs, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote scale-model inputs {args.model_inputs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
