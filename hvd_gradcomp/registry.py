"""The catalogue of schemes, and text specs such as ``"topkc:ratio=0.01,chunk=256"``.

A *scheme spec* is ``name`` or ``name:key=value,key=value``. Values are parsed by the option
each config field declares (:mod:`hvd_gradcomp.options`: a boolean accepts true/false/1/0/
yes/no/on/off), and :func:`to_spec` writes them back canonically from the same declaration.
Each backend's ``Compression`` namespace builds its compressors from this table, so both
frontends offer the same names and options. :func:`describe_options` lists every scheme's
options (``python -m hvd_gradcomp --list``; the README's option table is its Markdown form).

Compressor specs, which add routing rules around scheme specs, are
:mod:`hvd_gradcomp.routing_spec`'s. A scheme is added by its own module and one line in
:data:`SCHEMES`: its config declares its options and, as ``PRIMARY``, the one a bare first
value sets; its scheme class declares its routing defaults (``min_numel``, ``accepts``,
``fallback``: :mod:`hvd_gradcomp.base`).
"""
import dataclasses

from . import composite
from .cast import Bf16Config, Bf16Scheme, Fp16Config, Fp16Scheme, NoneConfig, NoneScheme
from .auto import AutoConfig, AutoScheme
from .options import MIN_NUMEL, ROUTING_OPTION, WARMUP, WARMUP_OPTION, options_of, to_spec
from .powersgd import PowerSGDConfig, PowerSGDScheme
from .signsgd import SignSGDConfig, SignSGDScheme
from .sparseloco import SparseLoCoConfig, SparseLoCoScheme
from .thc import THCConfig, THCScheme
from .topk import TopKConfig, TopKScheme
from .topkc import TopKCConfig, TopKCScheme

__all__ = ["SCHEMES", "make_scheme", "parse_spec", "to_spec", "register", "primary", "describe_options",
           "OPTIONS_BLOCK", "WARMUP", "WARMUP_OPTION"]

# name -> (config class, scheme class); register() adds to it.
SCHEMES = {
    "none": (NoneConfig, NoneScheme),
    "fp16": (Fp16Config, Fp16Scheme),
    "bf16": (Bf16Config, Bf16Scheme),
    "topk": (TopKConfig, TopKScheme),
    "topkc": (TopKCConfig, TopKCScheme),
    "powersgd": (PowerSGDConfig, PowerSGDScheme),
    "thc": (THCConfig, THCScheme),
    "signsgd": (SignSGDConfig, SignSGDScheme),
    "sparseloco": (SparseLoCoConfig, SparseLoCoScheme),
    "auto": (AutoConfig, AutoScheme),
}
# Also accepted by parse_spec/make_scheme.
ALIASES = {"fp32": "none"}


def primary(name: str):
    """The option a bare first value sets for scheme ``name`` (canonical, in the catalogue):
    its config's ``PRIMARY`` (``Compression.topkc(0.01)``, ``"topkc:0.01"``), or None."""
    return getattr(SCHEMES[name][0], "PRIMARY", None)




def _canonical_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def register(name: str, config_cls, scheme_cls):
    """Add a scheme to the catalogue (used by the scheme modules that live outside this file).

    Declare every config field with :func:`hvd_gradcomp.options.option`.

    Raises:
        TypeError: a config field is not declared (:func:`~hvd_gradcomp.options.options_of`),
            the config declares options and its ``SCHEME`` (the name its messages use) is
            not ``name``, or the scheme defines a hook of :mod:`hvd_gradcomp.composite` with
            other arguments than it is called with (:func:`~hvd_gradcomp.composite.check_hooks`).
    """
    if options_of(config_cls) and getattr(config_cls, "SCHEME", None) != name:
        raise TypeError(f"register: {config_cls.__name__}.SCHEME must be {name!r} (its name in "
                        f"messages), got {getattr(config_cls, 'SCHEME', None)!r}")
    composite.check_hooks(scheme_cls)
    SCHEMES[name] = (config_cls, scheme_cls)


def given_twice(name: str, key: str) -> ValueError:
    """The one error for an option given twice, in a spec, a call or both: ``"topkc: ratio
    given twice"``."""
    return ValueError(f"{name}: {key} given twice")


def make_scheme(name: str, *args, **options):
    """Build a scheme by name (case-insensitive) with config options; ValueError for unknown
    names or options. One positional value sets the scheme's main option (:func:`primary`).
    ``fp16_warmup=N`` (:data:`WARMUP`, every scheme) wraps it in
    :class:`~hvd_gradcomp.warmup.WarmupScheme` when N > 0 (``fp16`` and ``none``: no effect;
    ``auto``: refused)."""
    name = _canonical_name(name)
    warmup = options.pop(WARMUP_OPTION, 0)
    WARMUP.check(name, WARMUP_OPTION, warmup)
    warmup = WARMUP.normalise(warmup)
    scheme = _make(name, *args, **options)
    if not warmup or name in ("fp16", "none"):
        return scheme
    if scheme.adaptive:
        raise ValueError(f"{name}: {WARMUP_OPTION} is not for an adaptive scheme (auto starts every "
                         f"tensor on fp16 and decides when to leave it), got {WARMUP_OPTION}={warmup}")
    from .warmup import WarmupScheme
    return WarmupScheme(scheme, warmup)


def _make(name: str, *args, **options):
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(SCHEMES)}")
    config_cls, scheme_cls = SCHEMES[name]
    if args:
        first = primary(name)
        if len(args) > 1 or first is None:
            raise ValueError(f"{name}: takes {'at most one positional option (' + first + ')' if first else 'no positional options'}, "
                             f"got {len(args)}; pass options by name")
        if first in options:
            raise given_twice(name, first)
        options = {first: args[0], **options}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; expected some of {sorted(fields)}")
    config = config_cls(**options)
    if issubclass(scheme_cls, AutoScheme):
        return scheme_cls(config, _candidates(config))
    return scheme_cls(config)


def _candidates(config):
    """``auto``'s candidates built from its config's specs, in order: the catalogue builds
    them and hands them over (as :func:`make_scheme` hands the warm-up its inner scheme), so
    :mod:`hvd_gradcomp.auto` never imports this module.

    Raises:
        ValueError: a spec :func:`parse_spec` or :func:`make_scheme` refuses, or ``auto``
            itself (``"auto: candidates must not include auto, got 'auto'"``).
    """
    built = []
    for text in config.specs():
        name, options = parse_spec(text)
        if name == "auto":
            raise ValueError(f"auto: candidates must not include auto, got {text!r}")
        built.append(make_scheme(name, **options))
    return tuple(built)


def parse_spec(spec: str):
    """``"topkc:ratio=0.01,chunk=256"`` -> ``("topkc", {"ratio": 0.01, "chunk": 256})``.

    Raises:
        ValueError: unknown name or option, malformed ``key=value``, an option given twice
            (:func:`given_twice`), or a value of the wrong type.
    """
    name, _, rest = spec.strip().partition(":")
    name = _canonical_name(name)
    if name not in SCHEMES:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; expected one of {sorted(SCHEMES)}")
    fields = options_of(SCHEMES[name][0])
    options = {}
    for i, item in enumerate(filter(None, (p.strip() for p in rest.split(",")))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq and i == 0 and primary(name):  # "topkc:0.01"
            key, value, eq = primary(name), item, "="
        if not eq:
            raise ValueError(f"{name}: expected key=value in spec {spec!r}, got {item!r}")
        if key.lower() == WARMUP_OPTION:
            options[WARMUP_OPTION] = WARMUP.parse(name, WARMUP_OPTION, value)
            continue
        if key not in fields:
            raise ValueError(f"{name}: unknown option {key!r}; expected some of {sorted(fields)}")
        if key in options:  # "topkc:ratio=0.1,ratio=0.5", "topkc:0.1,ratio=0.5"
            raise given_twice(name, key)
        options[key] = fields[key].parse(name, key, value)
    return name, options


# ---------------------------------------------------------------- option listings

# README block the Markdown listing fills: <!-- options:start --> ... <!-- options:end -->.
OPTIONS_BLOCK = "options"


def _names(names):
    if names is None:
        return list(SCHEMES)
    out = []
    for name in names:
        canonical = _canonical_name(name)
        if canonical not in SCHEMES:
            raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(SCHEMES)}")
        out.append(canonical)
    return out


def _default_min_numel() -> str:
    """The schemes' own ``min_numel`` defaults (their class attribute), grouped by value."""
    by_value = {}
    for name, (_, scheme_cls) in SCHEMES.items():
        if scheme_cls.min_numel != MIN_NUMEL.default:
            by_value.setdefault(scheme_cls.min_numel, []).append(name)
    parts = [f"{value} for {', '.join(names)}" for value, names in by_value.items()]
    return "; ".join(parts + [f"{MIN_NUMEL.default} otherwise"])


def describe_options(names=None, markdown: bool = False) -> str:
    """Every scheme's options as their declarations state them (kind and range, default,
    which way compresses harder, doc), then the routing's ``min_numel``.

    Args:
        names: schemes to list (case-insensitive, aliases allowed); None: all, in catalogue
            order.
        markdown: a Markdown table (the README's option table, between ``<!-- options:start
            -->`` and ``<!-- options:end -->``) instead of plain text (``python -m
            hvd_gradcomp --list``).

    Raises:
        ValueError: an unknown scheme name.
    """
    names = _names(names)
    plain = [n for n in names if not options_of(SCHEMES[n][0])]
    aliases = {n: [a for a, target in ALIASES.items() if target == n] for n in names}

    def title(name, code):
        quote = "`" if code else ""
        extra = f" ({', '.join(quote + a + quote for a in aliases[name])})" if aliases[name] else ""
        return quote + name + quote + extra

    if markdown:
        def cell(text):  # a "|" inside a cell would end it
            return text.replace("|", "\\|")

        lines = ["| scheme | option | values | default | compresses harder | what it does |",
                 "|---|---|---|---|---|---|"]
        for name in names:
            for key, decl in options_of(SCHEMES[name][0]).items():
                first = " (first)" if primary(name) == key else ""
                lines.append(f"| {title(name, True)} | `{key}`{first} | {cell(decl.values())} | "
                             f"`{cell(decl.format(decl.default))}` | {cell(decl.harder_text())} | "
                             f"{cell(decl.doc or '-')} |")
        lines.append(f"| every compressor | `{ROUTING_OPTION}` | {MIN_NUMEL.values()} | "
                     f"{_default_min_numel()} | - | {MIN_NUMEL.doc} (routing) |")
        lines.append(f"| every compressor | `{WARMUP_OPTION}` | {WARMUP.values()} | "
                     f"`{WARMUP.default}` | - | {WARMUP.doc} |")
        if plain:
            lines += ["", ", ".join(title(n, True) for n in plain) + " take no options."]
        lines += ["", "The first option may be given without its name (`topkc:0.1`, "
                      "`Compression.topkc(0.1)`); \"compresses harder\" is the way that sends "
                      "fewer bytes per step on large tensors (`-`: neither way)."]
        return "\n".join(lines)
    lines = []
    for name in names:
        options = options_of(SCHEMES[name][0])
        if not options:
            lines.append(f"{title(name, False)}: no options")
            continue
        first = f" (first option positional: {name}:VALUE sets {primary(name)})" if primary(name) else ""
        lines.append(f"{title(name, False)}{first}")
        for key, decl in options.items():
            lines.append(f"  {key}={decl.format(decl.default)}  [{decl.values()}; harder: "
                         f"{decl.harder_text()}]")
            lines.append(f"      {decl.doc}")
    lines.append("every compressor (routing)")
    lines.append(f"  {ROUTING_OPTION}  [{MIN_NUMEL.values()}; default {_default_min_numel()}]")
    lines.append(f"      {MIN_NUMEL.doc}")
    lines.append(f"  {WARMUP_OPTION}={WARMUP.default}  [{WARMUP.values()}; harder: -]")
    lines.append(f"      {WARMUP.doc}")
    return "\n".join(lines)
