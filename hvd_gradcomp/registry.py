"""The catalogue of schemes, and text specs such as ``"topkc:ratio=0.01,chunk=256"``.

A spec is ``name`` or ``name:key=value,key=value``. Values are parsed by the type of the
config field they set (bool accepts true/false/1/0/yes/no). Each backend's ``Compression``
namespace builds its compressors from this table, so both frontends offer the same names and
options.
"""
import dataclasses
import typing

from .cast import Bf16Config, Bf16Scheme, Fp16Config, Fp16Scheme, NoneConfig, NoneScheme
from .powersgd import PowerSGDConfig, PowerSGDScheme
from .thc import THCConfig, THCScheme
from .topk import TopKConfig, TopKScheme
from .topkc import TopKCConfig, TopKCScheme

__all__ = ["SCHEMES", "make_scheme", "parse_spec", "to_spec", "register"]

# name -> (config class, scheme class); register() adds to it.
SCHEMES = {
    "none": (NoneConfig, NoneScheme),
    "fp16": (Fp16Config, Fp16Scheme),
    "bf16": (Bf16Config, Bf16Scheme),
    "topk": (TopKConfig, TopKScheme),
    "topkc": (TopKCConfig, TopKCScheme),
    "powersgd": (PowerSGDConfig, PowerSGDScheme),
    "thc": (THCConfig, THCScheme),
}
# Also accepted by parse_spec/make_scheme.
ALIASES = {"fp32": "none"}
# The option a bare first value sets: Compression.topkc(0.01), "topkc:0.01".
PRIMARY = {"topk": "ratio", "topkc": "ratio", "thc": "bits", "powersgd": "rank"}


def _canonical_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def _normalise(config_cls, options: dict) -> dict:
    """Options with ints given for float fields made floats, so equal configs compare equal
    and print the same spec (``ratio=1`` and ``ratio=1.0``)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    out = {}
    for key, value in options.items():
        typ = fields[key].type if key in fields else None
        if typ in (float, "float") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[key] = value
    return out


def register(name: str, config_cls, scheme_cls):
    """Add a scheme to the catalogue (used by the scheme modules that live outside this file)."""
    SCHEMES[name] = (config_cls, scheme_cls)


def make_scheme(name: str, *args, **options):
    """Build a scheme by name (case-insensitive) with config options; ValueError for unknown
    names or options. One positional value sets the scheme's main option (``PRIMARY``)."""
    name = _canonical_name(name)
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(SCHEMES)}")
    config_cls, scheme_cls = SCHEMES[name]
    if args:
        if len(args) > 1 or name not in PRIMARY:
            raise ValueError(f"{name}: takes {'at most one positional option (' + PRIMARY[name] + ')' if name in PRIMARY else 'no positional options'}, "
                             f"got {len(args)}; pass options by name")
        if PRIMARY[name] in options:
            raise ValueError(f"{name}: {PRIMARY[name]} given twice")
        options = {PRIMARY[name]: args[0], **options}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; expected some of {sorted(fields)}")
    return scheme_cls(config_cls(**_normalise(config_cls, options)))


def _convert(name: str, field, text: str):
    typ = field.type if not isinstance(field.type, str) else {
        "float": float, "int": int, "bool": bool, "str": str}.get(field.type, str)
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: option {field.name} must be true or false, got {text!r}")
    if typing.get_origin(typ) is typing.Union:  # Optional[int] etc.
        if text.strip().lower() in ("none", ""):
            return None
        typ = [t for t in typing.get_args(typ) if t is not type(None)][0]
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"{name}: option {field.name} must be {typ.__name__}, got {text!r}") from None


def parse_spec(spec: str):
    """``"topkc:ratio=0.01,chunk=256"`` -> ``("topkc", {"ratio": 0.01, "chunk": 256})``.

    Raises:
        ValueError: unknown name or option, malformed ``key=value``, or a value of the wrong type.
    """
    name, _, rest = spec.strip().partition(":")
    name = _canonical_name(name)
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; expected one of {sorted(SCHEMES)}")
    fields = {f.name: f for f in dataclasses.fields(SCHEMES[name][0])}
    options = {}
    for i, item in enumerate(filter(None, (p.strip() for p in rest.split(",")))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq and i == 0 and name in PRIMARY:  # "topkc:0.01"
            key, value, eq = PRIMARY[name], item, "="
        if not eq:
            raise ValueError(f"{name}: expected key=value in spec {spec!r}, got {item!r}")
        if key not in fields:
            raise ValueError(f"{name}: unknown option {key!r}; expected some of {sorted(fields)}")
        options[key] = _convert(name, fields[key], value)
    return name, options


def to_spec(scheme, full: bool = False) -> str:
    """The canonical spec of a scheme: options that differ from their defaults (every option
    with ``full=True``), values normalised, so equal configs give one string."""
    cfg = scheme.config
    parts = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if full or getattr(cfg, f.name) != f.default]
    return scheme.name + (":" + ",".join(parts) if parts else "")
