"""``python -m hvd_gradcomp.bench model [--inputs FILE] [--workers 8,...,4096] [--gbps 10,...,400]``:
the scale model (:mod:`.model`) tabulated over workers and link bandwidths.

Outputs (``--out``): ``model.txt``, a table of the TTA ratio against FP16 for every
(N, bandwidth), the bandwidth below which each compressor beats FP16 at each N (where it starts
and where it stops), and ``auto``'s predicted choice per cell (:func:`auto_choice`);
``model.csv``, the projected rows; ``model_heatmap.png``. With ``--check RUNS_CSV``: the model's
step time against a TTA sweep's measured ones (:func:`.model.check_against_runs`).
"""
import argparse
import csv
import math
import os
import sys
from typing import Optional

from .model import (BANDWIDTHS_GBPS, BASELINE, DEFAULT_INPUTS, WORKERS, Network, check_against_runs,
                    format_check, load_inputs, predict_step_time, tta_ratio, winning_ranges)

__all__ = ["AUTO", "auto_choice", "project", "format_report", "heatmap", "main"]


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
                     "see model_projection.auto_choice)")
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
