"""One run of a time-to-accuracy sweep (:mod:`.tta_sweep`): the worker's command line
(:func:`command`), its launch on the emulated network with a progress bar and its result
(:func:`execute`), and what stops the rows after FP16 (:func:`note_fp16`, :func:`stop_flags`);
the checkout's commit and package versions for the records.
"""
import json
import os
import queue
import subprocess
import sys
import threading
import time

from . import device, fp16_estimate, launch, netem, report
from .tta import DDP_WORKER, FP16_TTA_CAP, FSDP_WORKER, RECIPE_WORKLOADS, WORKLOAD_FLAGS, WORKLOADS
from .tta_hooks import FSDP_BASELINE, fsdp_compression, parse_fsdp_mesh
from .worker import PROGRESS_PREFIX

__all__ = ["git_commit", "versions", "command", "stub_result", "is_fp16_baseline", "stop_group",
           "note_fp16", "stop_flags", "network_for", "execute"]


def git_commit():
    """The commit of the source checkout this package runs from (``-dirty`` when modified);
    None for an installed package (no ``.git`` beside it) or without git."""
    root = launch.IMPORT_ROOT
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions():
    from importlib import metadata
    import platform
    out = {"python": platform.python_version()}
    for dist in ("torch", "horovod", "tensorflow-cpu", "tensorflow", "numpy", "scikit-learn",
                 "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def command(run, args, out_json, extra=()):
    """The command every rank runs: ``python -m <worker module> <flags>`` (never a file path);
    ``extra`` flags (:func:`stop_flags`) go before ``--worker-args``, which can override them."""
    framework, module, wname, _ = WORKLOADS[run.workload]
    cmd = [sys.executable, "-m", {"ddp": DDP_WORKER, "fsdp": FSDP_WORKER}.get(run.system, module)]
    if run.system == "ddp":
        cmd += ["--workload", wname, "--hook", run.spec]
        if run.delay:
            cmd += ["--delay", str(run.delay)]
        cap = getattr(args, "ddp_bucket_cap_mb", None)
        if cap is not None and run.spec.split(":")[0] in ("ours", "none", "fp32"):
            cmd += ["--bucket-cap-mb", f"{cap:g}"]
    elif run.system == "fsdp":
        r, s = getattr(args, "fsdp_mesh_shape", None) or parse_fsdp_mesh(getattr(args, "fsdp_mesh", None), args.workers)
        cmd += ["--workload", wname, "--compression", run.spec, "--mesh", f"{r}x{s}"]
        if run.reduce_scatter:
            cmd += ["--reduce-scatter", run.reduce_scatter]
        if run.overlap:
            cmd += ["--overlap"]
        if run.delay:
            cmd += ["--delay", str(run.delay)]
    else:
        cmd += ["--compression", run.spec]
    if run.optimizer:
        cmd += ["--optimizer", run.optimizer]
    if run.accumulate > 1:
        cmd += ["--accumulate", str(run.accumulate)]
    if run.groups:
        cmd += ["--num-groups", str(run.groups)]
    if run.update_sync is not None:
        cmd += ["--update-sync", run.update_sync]
    if getattr(args, "recipe", None) and run.workload in RECIPE_WORKLOADS:
        cmd += ["--recipe", args.recipe]
    cmd += ["--seed", str(args.seed), "--out", out_json, "--progress"]
    if getattr(args, "device", "cpu") != "cpu":
        cmd += ["--device", args.device]
    cmd += list(WORKLOAD_FLAGS.get(run.workload, ())) if run.system == "horovod" else []
    if args.max_seconds:
        cmd += ["--max-seconds", str(args.max_seconds)]
    if getattr(args, "budget_epochs", None):
        cmd += ["--max-epochs", f"{args.budget_epochs:g}"]
    cmd += list(extra)
    cmd += args.worker_args.split() if args.worker_args else []
    return cmd


def stub_result(run, status, error="", network=None):
    out = {"status": status, "error": error,
           "meta": {"workload": WORKLOADS[run.workload][2], "framework": WORKLOADS[run.workload][0],
                    "system": run.system, "label": run.label, "compression": run.spec,
                    "optimizer": run.optimizer, "accumulate": run.accumulate, "update_sync": run.update_sync,
                    "num_groups": run.groups, "delay": run.delay,
                    "repeat": run.repeat, "reference": run.reference}}
    if run.system == "fsdp":  # as the worker records it (workers.fsdp_torch)
        out["meta"]["compression"] = fsdp_compression(run.spec, run.reduce_scatter, run.overlap, run.delay)
    if network is not None:
        out["network"] = network
    return out


def is_fp16_baseline(run):
    """Horovod's FP16 row (the workload's own optimizer, no clause), or FP16-FSDP (the FSDP
    row ``fp16`` with FSDP's own reduce-scatter): the baseline of its :func:`stop_group`."""
    if run.system == "fsdp":
        return run.spec == FSDP_BASELINE and not run.reduce_scatter and not run.optimizer and not run.overlap
    return (run.system == "horovod" and run.spec == "fp16" and not run.optimizer and not run.reference
            and run.accumulate == 1 and run.update_sync is None and not run.groups)


def stop_group(run):
    """The key of ``stops`` (:func:`note_fp16`) that ``run`` belongs to: its workload (Horovod
    and DDP rows, measured against Horovod's FP16), or ``"<workload> fsdp"`` for FSDP rows
    (against FP16-FSDP)."""
    return f"{run.workload} fsdp" if run.system == "fsdp" else run.workload


def note_fp16(run, result, stops, cap=None):
    """After a run: when it is the FP16 baseline (Horovod ``fp16``, the workload's own
    optimizer; for FSDP rows FP16-FSDP) of a workload in :data:`.tta.FP16_TTA_CAP` and recorded
    ``target_vs_fp16``, store in ``stops[stop_group(run)]`` (:func:`stop_group`: the workload,
    or ``"<workload> fsdp"``) what the later rows of that group stop at (:func:`stop_flags`): the target
    (factor x its final rolling metric), FP16's TTA to it (``fp16_tta_s``, training clock,
    :func:`.report.time_to_target`), the cap (``cap``, default :data:`.tta.FP16_TTA_CAP`'s) and
    ``max_seconds`` = cap x FP16's TTA, and FP16's steps (``fp16_steps``: the learning-rate
    schedule's length for the later rows). The first FP16 run of the sweep sets them (with
    repeats: round 1's)."""
    meta, evals = result.get("meta") or {}, result.get("evals") or {}
    if stop_group(run) in stops or run.workload not in FP16_TTA_CAP or not is_fp16_baseline(run):
        return
    if result.get("status") != "ok" or not meta.get("target_vs_fp16") or not evals.get("metric"):
        return
    from .worker import rolling_mean
    window = int(meta.get("window", 5))
    final = rolling_mean(evals["metric"], window)[-1]
    target = meta["target_vs_fp16"] * final
    tta_s = report.time_to_target(evals["t"], evals["metric"], target, bool(meta.get("higher_is_better")), window)
    if tta_s is None:  # a factor below 1 (or a higher-is-better metric): FP16 never got there
        tta_s = evals["t"][-1]
    steps = int(meta.get("steps_run") or len((result.get("steps") or {}).get("step", [])))
    factor = FP16_TTA_CAP[run.workload] if cap is None else float(cap)
    early = fp16_estimate.stop_values(result, factor)  # stopped early on a slow link (--fp16-reference)
    if early is not None:
        stops[stop_group(run)] = early
        return
    stops[stop_group(run)] = {"target": target, "fp16_tta_s": tta_s, "cap": factor,
                           "max_seconds": factor * tta_s, "fp16_steps": steps}


def stop_flags(run, stops):
    """Worker flags that stop ``run`` at its workload's FP16-relative target or time cap
    (:func:`note_fp16`): ``--target T --epochs-past-target 0 --max-seconds S --max-epochs 1e9
    --schedule-steps N`` (the training-clock cap S = cap x FP16's TTA, not a step or epoch
    budget, ends it; N = FP16's steps, so the learning-rate schedule is FP16's); none for the
    FP16 baseline itself or before FP16 has run. FSDP rows stop at FP16-FSDP's
    (:func:`stop_group`)."""
    stop = stops.get(stop_group(run))
    if stop is None or is_fp16_baseline(run):
        return []
    return ["--target", f"{stop['target']:.6g}", "--epochs-past-target", "0",
            "--max-seconds", f"{stop['max_seconds']:.6g}", "--max-epochs", "1e9",
            "--schedule-steps", str(stop["fp16_steps"])]


def network_for(net, run):
    """The network ``run`` goes on: the sweep's ``net``, or for the no-communication
    reference (``run.reference``) a :class:`.netem.LoopbackNetwork` of the same size, which
    needs no set-up: the network left out (no rate limit, no namespaces; the ranks still
    all-reduce, over 127.0.0.1)."""
    if not run.reference:
        return net
    return netem.LoopbackNetwork(net.world_size, "no-communication reference")


def execute(net, run, args, out_dir, progress=True, extra=()):
    """Run one planned run on ``net`` (the reference on :func:`network_for`'s loopback);
    returns its result dict (``status`` "ok" or why not). A reference run's result holds
    its own network's ``describe()`` under ``"network"`` and ``meta["reference"] = True``."""
    if run.unavailable:
        print(f"tta: run {run.run_id} not run: {run.unavailable}", file=sys.stderr)
        return stub_result(run, f"not run: {run.unavailable}", run.unavailable)
    from tqdm import tqdm
    log_dir = os.path.join(out_dir, "logs", run.run_id)
    os.makedirs(log_dir, exist_ok=True)
    out_json = os.path.join(out_dir, "runs", run.run_id + ".json")
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = command(run, args, out_json, extra)
    with open(os.path.join(log_dir, "command.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    own = network_for(net, run)
    handle = launch.launch(own, cmd, kind="horovod" if run.system == "horovod" else "ddp",
                           env={**launch.malloc_env(args.malloc),
                                **device.launch_env(getattr(args, "device", "cpu"), own)},
                           log_dir=log_dir, pipe_rank0=True)
    lines = queue.Queue()
    stdout = handle.procs[0].stdout

    def reader():
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    rnd = f" r{run.repeat}/{run.repeats}" if run.repeats > 1 else ""
    bar = tqdm(total=None, desc=f"{run.workload} {run.label}"[:48 - len(rnd)] + rnd, unit="step", leave=True,
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    capped = max([float(extra[i + 1]) for i, f in enumerate(extra[:-1]) if f == "--max-seconds"] or [0.0])
    limit = capped or args.max_seconds
    timeout = args.run_timeout or (3 * limit + 300 if limit else 1800)
    deadline = time.monotonic() + timeout
    code, eof = None, False
    with open(os.path.join(log_dir, "rank0.stdout"), "w") as raw:
        try:
            while True:
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    line = ""
                if line is None:
                    eof = True
                elif line:
                    if line.startswith(PROGRESS_PREFIX):
                        p = json.loads(line[len(PROGRESS_PREFIX):])
                        bar.total = p["total"]
                        bar.n = p["step"]
                        bar.set_postfix(metric=f"{p['metric']:.4g}", rolling=f"{p['rolling']:.4g}",
                                        clock=f"{p['t']:.0f}s", refresh=False)
                        bar.refresh()
                    else:
                        raw.write(line)
                code = handle.poll()
                if code not in (None, 0) or (code == 0 and eof):
                    break
                if time.monotonic() > deadline:
                    code = 124
                    break
        finally:
            bar.close()
            handle.kill()
            handle.close()
    if code == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            result = json.load(f)
        result["status"] = "ok"
        result["meta"]["label"] = run.label
        result["meta"]["optimizer"] = run.optimizer
        result["meta"]["accumulate"] = run.accumulate
        result["meta"]["update_sync"] = run.update_sync
        result["meta"]["num_groups"] = run.groups
        result["meta"]["delay"] = run.delay
        result["meta"]["repeat"] = run.repeat
        result["meta"]["reference"] = run.reference
        if run.reference:
            result["network"] = own.describe()
        return result
    tail = ""
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("rank"):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                text = f.read()
            tail += f"--- {name} ---\n" + "\n".join(text.strip().splitlines()[-15:]) + "\n"
    status = "timeout" if code == 124 else f"failed (exit {code})"
    print(f"tta: run {run.run_id} {status}; logs in {log_dir}\n{tail}", file=sys.stderr)
    return stub_result(run, status, tail, own.describe() if run.reference else None)
