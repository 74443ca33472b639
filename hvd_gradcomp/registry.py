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


def register(name: str, config_cls, scheme_cls):
    """Add a scheme to the catalogue (used by the scheme modules that live outside this file)."""
    SCHEMES[name] = (config_cls, scheme_cls)


def make_scheme(name: str, **options):
    """Build a scheme by name with config options; ValueError for unknown names or options."""
    name = ALIASES.get(name, name)
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(SCHEMES)}")
    config_cls, scheme_cls = SCHEMES[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; expected some of {sorted(fields)}")
    return scheme_cls(config_cls(**options))


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
    name = ALIASES.get(name.strip(), name.strip())
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; expected one of {sorted(SCHEMES)}")
    fields = {f.name: f for f in dataclasses.fields(SCHEMES[name][0])}
    options = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{name}: expected key=value in spec {spec!r}, got {item!r}")
        if key not in fields:
            raise ValueError(f"{name}: unknown option {key!r}; expected some of {sorted(fields)}")
        options[key] = _convert(name, fields[key], value)
    return name, options


def to_spec(scheme) -> str:
    """The spec of a scheme, listing only options that differ from their defaults."""
    cfg = scheme.config
    parts = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != f.default]
    return scheme.name + (":" + ",".join(parts) if parts else "")
