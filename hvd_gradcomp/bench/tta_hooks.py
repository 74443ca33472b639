"""The DDP and FSDP rows of a time-to-accuracy sweep (:mod:`.tta_sweep`'s ``--ddp-hooks``,
``--fsdp-hooks`` and ``--fsdp-mesh``): parsing and checking them before anything runs, and
the FSDP rows' labels and recorded compression.
"""
import re
import sys

from hvd_gradcomp.routing import Routing

__all__ = ["FSDP_BASELINE", "parse_ddp_hooks", "fsdp_label", "fsdp_compression", "parse_fsdp_hooks",
           "parse_fsdp_mesh"]

# The FSDP rows' baseline, FP16-FSDP: the row ``fp16``, FSDP's own collectives in float16
# (workers.fsdp_torch); it sets the FSDP rows' target.
FSDP_BASELINE = "fp16"


def _check_spec(spec):
    """Parse ``spec`` as the workers' ``Compression.from_spec`` does and build its schemes
    (:func:`.tta.default_specs` checks its rows the same way). Raises ValueError naming the
    problem."""
    Routing.from_spec(spec)


def parse_ddp_hooks(text):
    """``"fp16;powersgd:rank=4"`` -> list; ``""`` or ``"off"`` -> []. Checked like the worker does."""
    if text.strip().lower() in ("", "off", "no"):
        return []
    hooks = [s.strip() for s in text.split(";") if s.strip()]
    for h in hooks:
        name, _, rest = h.partition(":")
        if name == "ours":  # this project's compressor as a DDP hook (torch_backend.ddp)
            _check_spec(rest)
            continue
        if name not in ("none", "fp32", "fp16", "powersgd") or (name != "powersgd" and rest) or (
                rest and not re.fullmatch(r"rank=\d+", rest)):
            raise ValueError(f"ddp hook must be none, fp16, powersgd:rank=R or ours:<spec>, got {h!r}")
    return hooks


def fsdp_label(spec, reduce_scatter=None, overlap=False, delay=0):
    """An FSDP row's label: ``FP16-FSDP`` (spec ``fp16``), ``FP32-FSDP`` (``none``) or ``<spec>
    on FSDP``, followed by ``, rs <spec>`` when the reduce-scatter is compressed too,
    ``, overlap`` with ``install(..., overlap=True)`` and ``, delay(D)`` with ``install(...,
    delay=D)`` (the worker's ``label``, :mod:`.workers.fsdp_torch`)."""
    out = {"fp16": "FP16-FSDP", "none": "FP32-FSDP"}.get(spec, f"{spec} on FSDP")
    return (out + (f", rs {reduce_scatter}" if reduce_scatter else "") + (", overlap" if overlap else "")
            + (f", delay({delay})" if delay else ""))


def fsdp_compression(spec, reduce_scatter=None, overlap=False, delay=0):
    """An FSDP run's ``meta.compression``: ``fsdp:<spec>[ with rs=<spec>][ with overlap][ with
    delay(D)]`` (the worker records the same)."""
    return (f"fsdp:{spec}" + (f" with rs={reduce_scatter}" if reduce_scatter else "")
            + (" with overlap" if overlap else "") + (f" with delay({delay})" if delay else ""))


def parse_fsdp_hooks(text, shards=2):
    """``"fp16; thc; topkc:0.1; fp16 with rs=thc; thc with overlap; thc with delay(1)"`` ->
    ``[(spec, rs or None, overlap, delay), ...]`` (``;`` separates rows; ``""``/``"off"`` -> []). A row is the all-reduce's
    spec across replicas (``fp16``: FP16-FSDP, FSDP's own float16 collectives; ``none``/``fp32``:
    FSDP's own float32 ones; any other: our compressor through ``torch_backend.fsdp.install``),
    optionally ``with rs=SPEC``: the reduce-scatter within the shard group compressed by
    ``install_reduce_scatter``, ``with overlap``: our hook installed with ``overlap=True``, and
    ``with delay(1)``: installed with ``delay=1`` (delayed sync across replicas,
    :mod:`torch_backend.fsdp_delayed`).
    FP16-FSDP (``fp16``), the FSDP rows' baseline, is put first (added when missing, with a note
    on stderr): it sets their target and ratios.

    Args:
        text: the option's value.
        shards: S, ranks per replica of the sweep's mesh (``rs=`` needs S >= 2).

    Raises:
        ValueError: a bad spec (the registry's message); a blocking two-round variant (install
            refuses them); an ``rs=`` spec that cannot be reduce-scattered (named, with why), or
            ``rs=`` with one shard per replica; ``overlap`` on FSDP's own collectives (``fp16``,
            ``none``); ``delay`` other than 1, on FSDP's own collectives, or with ``overlap``
            (install refuses both together); an unknown clause; a row given twice.
    """
    if text.strip().lower() in ("", "off", "no"):
        return []
    out = []
    for row in (x.strip() for x in text.split(";")):
        if not row:
            continue
        parts = [x.strip() for x in row.split(" with ")]
        spec = "none" if parts[0] == "fp32" else parts[0]
        rs, overlap, delay = None, False, 0
        for clause in parts[1:]:
            key, eq, val = (x.strip() for x in clause.partition("="))
            if key == "overlap" and not eq and not overlap:
                overlap = True
                continue
            d = re.fullmatch(r"delay\((.*)\)", clause)
            if d and not delay:
                if d.group(1).strip() != "1":
                    raise ValueError(f"fsdp row {row!r}: delay(D) takes D = 1 (install(..., delay=1)), "
                                     f"got {d.group(1).strip()!r}")
                delay = 1
                continue
            if key != "rs" or not eq or not val or rs is not None:
                raise ValueError(f"fsdp row {row!r}: expected 'SPEC', 'SPEC with rs=SPEC', 'SPEC with "
                                 f"overlap' or 'SPEC with delay(1)', got clause {clause!r}")
            rs = val
        if not spec:
            raise ValueError(f"fsdp row {row!r}: expected a compressor spec before 'with'")
        _check_spec(spec)
        if overlap and spec in (FSDP_BASELINE, "none"):
            raise ValueError(f"fsdp row {row!r}: overlap installs our hook with overlap=True; "
                             f"{spec!r} is FSDP's own all-reduce (overlap needs one of this project's specs, e.g. thc)")
        if delay and spec in (FSDP_BASELINE, "none"):
            raise ValueError(f"fsdp row {row!r}: delay(1) installs our hook with delay=1; {spec!r} is "
                             f"FSDP's own all-reduce (delay needs one of this project's specs, e.g. thc)")
        if delay and overlap:
            raise ValueError(f"fsdp row {row!r}: delay(1) and overlap together: install refuses them "
                             f"(delay posts without waiting already); pick one")
        blocking = [s.spec() for s in Routing.from_spec(spec).schemes() if s.blocking]
        if blocking:
            raise ValueError(f"fsdp row {row!r}: {blocking[0]} is a blocking two-round variant, which "
                             f"torch_backend.fsdp.install refuses (its side all-reduce is Horovod's)")
        if rs is not None:
            _check_spec(rs)
            if shards < 2:
                raise ValueError(f"fsdp row {row!r}: rs= compresses the reduce-scatter within a replica, "
                                 f"but the mesh has one shard per replica (nothing is reduce-scattered)")
            from torch_backend import Compression
            from torch_backend.fsdp_scatter import _scatter_refusal
            for scheme in Compression.from_spec(rs).routing.schemes():
                why = _scatter_refusal(scheme, shards)
                if why is not None:
                    raise ValueError(f"fsdp row {row!r}: rs={rs} routes tensors to {scheme.spec()}, which "
                                     f"cannot be reduce-scattered: {why}")
        if (spec, rs, overlap, delay) in out:
            raise ValueError(f"fsdp row {row!r} given twice")
        out.append((spec, rs, overlap, delay))
    base = (FSDP_BASELINE, None, False, 0)
    if out and base not in out:
        print(f"tta: FSDP rows: FP16-FSDP ({FSDP_BASELINE!r}), their baseline, added first", file=sys.stderr)
    return [base] + [r for r in out if r != base] if out else []


def parse_fsdp_mesh(text, workers):
    """``--fsdp-mesh``: ``"2x2"`` -> ``(2, 2)`` (R replicas x S shards); None or ``""`` ->
    ``(2, workers // 2)``.

    Raises:
        ValueError: not ``RxS``, R < 2, or R x S != ``workers``
            (named).
    """
    r, _, s = (text or "").lower().partition("x")
    if not text:
        if workers < 2 or workers % 2:
            raise ValueError(f"--fsdp-mesh: the default 2 x (workers / 2) needs an even --workers >= 2, "
                             f"got {workers}; give the mesh as RxS")
        return 2, workers // 2
    if not (r.strip().isdigit() and s.strip().isdigit()) or int(r) < 1 or int(s) < 1:
        raise ValueError(f"--fsdp-mesh: expected RxS (replicas x shards, positive integers), got {text!r}")
    r, s = int(r), int(s)
    if r < 2:
        raise ValueError(f"--fsdp-mesh {text}: at least 2 replicas are needed (FSDP rows compress the "
                         f"all-reduce across replicas)")
    if r * s != workers:
        raise ValueError(f"--fsdp-mesh {text}: {r} x {s} = {r * s} ranks, but --workers is {workers}; "
                         f"the workers must divide into the mesh")
    return r, s
