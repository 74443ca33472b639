"""The catalogue of schemes, and text specs such as ``"topkc:ratio=0.01,chunk=256"``.

A *scheme spec* is ``name`` or ``name:key=value,key=value``. Values are parsed by the option
each config field declares (:mod:`hvd_gradcomp.options`: a boolean accepts true/false/1/0/
yes/no/on/off), and :func:`to_spec` writes them back canonically from the same declaration.
Each backend's ``Compression`` namespace builds its compressors from this table, so both
frontends offer the same names and options. :func:`describe_options` lists every scheme's
options (``python -m hvd_gradcomp --list``; the README's option table is its Markdown form).

A *compressor spec* (``Compression.from_spec``) adds routing (:mod:`hvd_gradcomp.routing`):
which scheme sends which tensor. Grammar::

    compressor := [rule ";"]... default [";" rule]...     (exactly one default)
    rule       := selector "->" scheme-spec
    selector   := term [whitespace term]...
    term       := glob                                     (at most one; fnmatch, case-sensitive)
                | "numel" (">=" | ">" | "<" | "<=") integer  (coordinates of the tensor)
    default    := scheme-spec, which may also hold min_numel=N

Example: ``"*.bias -> fp16; *embed* -> topkc:0.01; numel>=1000000 -> powersgd:4;
thc:min_numel=4096"``. Rules are tried in order, the first whose every term matches wins;
a tensor no rule matches goes as fp16 if it has fewer than ``min_numel`` coordinates, else
with the default scheme. ``min_numel`` is a routing option every default accepts (``topk:0.1,
min_numel=1024``); its default is :data:`SMALL_DEFAULTS` (1024 for ``thc`` and ``topkc``, 1,
i.e. none, for the others). A rule's scheme-spec takes no ``min_numel`` (use ``numel>=N``),
and no scheme config has it: :func:`parse_spec` and :func:`make_scheme` refuse it as an
unknown option; :func:`parse_routing` takes it off the default (:func:`split_min_numel`).
Whitespace around items is ignored; a spec without ``->`` is a plain scheme spec, as before.
"""
import dataclasses
import re
from typing import NamedTuple, Optional

from .cast import Bf16Config, Bf16Scheme, Fp16Config, Fp16Scheme, NoneConfig, NoneScheme
from .auto import AutoConfig, AutoScheme
from .options import WARMUP, WARMUP_OPTION, Option, options_of, to_spec
from .powersgd import PowerSGDConfig, PowerSGDScheme
from .signsgd import SignSGDConfig, SignSGDScheme
from .thc import THCConfig, THCScheme
from .topk import TopKConfig, TopKScheme
from .topkc import TopKCConfig, TopKCScheme

__all__ = ["SCHEMES", "make_scheme", "parse_spec", "to_spec", "register", "SMALL_DEFAULTS", "SMALL_SCHEME",
           "small_default", "Selector", "parse_selector", "format_selector", "split_min_numel",
           "RoutingSpec", "parse_routing", "with_min_numel", "MIN_NUMEL", "describe_options",
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
    "auto": (AutoConfig, AutoScheme),
}
# Also accepted by parse_spec/make_scheme.
ALIASES = {"fp32": "none"}
# The option a bare first value sets: Compression.topkc(0.01), "topkc:0.01".
PRIMARY = {"topk": "ratio", "topkc": "ratio", "thc": "bits", "powersgd": "rank"}


def _canonical_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def register(name: str, config_cls, scheme_cls):
    """Add a scheme to the catalogue (used by the scheme modules that live outside this file).

    Declare the config's options with :func:`hvd_gradcomp.options.option` (fields without a
    declaration still parse and print, by their type: :func:`hvd_gradcomp.options.options_of`).

    Raises:
        TypeError: the config declares options and its ``SCHEME`` (the name its messages use)
            is not ``name``.
    """
    declares = any(o.declared for o in options_of(config_cls).values())
    if declares and getattr(config_cls, "SCHEME", None) != name:
        raise TypeError(f"register: {config_cls.__name__}.SCHEME must be {name!r} (its name in "
                        f"messages), got {getattr(config_cls, 'SCHEME', None)!r}")
    SCHEMES[name] = (config_cls, scheme_cls)


def given_twice(name: str, key: str) -> ValueError:
    """The one error for an option given twice, in a spec, a call or both: ``"topkc: ratio
    given twice"``."""
    return ValueError(f"{name}: {key} given twice")


def make_scheme(name: str, *args, **options):
    """Build a scheme by name (case-insensitive) with config options; ValueError for unknown
    names or options. One positional value sets the scheme's main option (``PRIMARY``).
    ``fp16_warmup=N`` (:data:`WARMUP`, every scheme) wraps it in
    :class:`~hvd_gradcomp.warmup.WarmupScheme` when N > 0 (``fp16`` and ``none``: no effect;
    ``auto``: refused)."""
    name = _canonical_name(name)
    warmup = options.pop(WARMUP_OPTION, 0)
    WARMUP.check(name, WARMUP_OPTION, warmup)
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
        if len(args) > 1 or name not in PRIMARY:
            raise ValueError(f"{name}: takes {'at most one positional option (' + PRIMARY[name] + ')' if name in PRIMARY else 'no positional options'}, "
                             f"got {len(args)}; pass options by name")
        if PRIMARY[name] in options:
            raise given_twice(name, PRIMARY[name])
        options = {PRIMARY[name]: args[0], **options}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; expected some of {sorted(fields)}")
    return scheme_cls(config_cls(**options))


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
        if not eq and i == 0 and name in PRIMARY:  # "topkc:0.01"
            key, value, eq = PRIMARY[name], item, "="
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
    by_value = {}
    for name, value in SMALL_DEFAULTS.items():
        by_value.setdefault(value, []).append(name)
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
                first = " (first)" if PRIMARY.get(name) == key else ""
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
        first = f" (first option positional: {name}:VALUE sets {PRIMARY[name]})" if name in PRIMARY else ""
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


# ---------------------------------------------------------------- routing grammar

# The scheme of tensors below min_numel that no rule names (pre-scaled fp16, see cast.py).
SMALL_SCHEME = "fp16"
# min_numel when none is given, by the default scheme's name: tensors with fewer coordinates
# go as fp16. 1024 where the scheme's fixed costs (THC's 4 control words and ranges, TopKC's
# 16 vote slots and chunk padding) outweigh its saving on a small tensor; 1 (no size routing)
# for the others: topk is the accuracy reference, powersgd decides from the matrix shape
# itself (min_compression_rate), the casts have nothing to gain. auto: 1024 too, so small
# tensors skip its measurement windows (they would end on fp16 anyway).
SMALL_DEFAULTS = {"thc": 1024, "topkc": 1024, "auto": 1024}
ROUTING_OPTION = "min_numel"
# The routing's one option, declared like a scheme's (its default depends on the default
# scheme: SMALL_DEFAULTS, else 1).
MIN_NUMEL = Option("integer", 1, "tensors no rule names with fewer coordinates go as fp16",
                   lo=1)
# The FP16 warm-up every scheme spec accepts (hvd_gradcomp.warmup), declared like an option.
RULE_ARROW = "->"
_SIZE_TERM = re.compile(r"numel\s*(>=|<=|>|<)\s*([0-9]+)")
_TERMS = re.compile(r"numel\s*(?:>=|<=|>|<)\s*[0-9]+|\S+")


def small_default(name: str) -> int:
    """The ``min_numel`` of a compressor whose default scheme is ``name``, when none is given."""
    return SMALL_DEFAULTS.get(_canonical_name(name), 1)


class Selector(NamedTuple):
    """Which tensors a rule names: a glob on the name and a range of sizes.

    pattern: fnmatch glob (case-sensitive), "*" names every tensor (no name needed).
    min_numel: the tensor has at least this many coordinates (>= 0).
    max_numel: the tensor has fewer than this many coordinates (None: no bound).
    """

    pattern: str = "*"
    min_numel: int = 0
    max_numel: Optional[int] = None

    def matches(self, name, numel: int) -> bool:
        """True if a tensor called ``name`` with ``numel`` coordinates is selected."""
        import fnmatch
        if numel < self.min_numel or (self.max_numel is not None and numel >= self.max_numel):
            return False
        return self.pattern == "*" or fnmatch.fnmatchcase(name, self.pattern)


def parse_selector(text: str) -> Selector:
    """``"*embed* numel>=4096"`` -> ``Selector("*embed*", 4096, None)``.

    Raises:
        ValueError: two globs, an empty selector, or bounds that select nothing.
    """
    pattern, low, high = None, 0, None
    terms = _TERMS.findall(text)
    if not terms:
        raise ValueError(f"routing: empty selector in {text!r}; expected a glob and/or numel bounds")
    for term in terms:
        size = _SIZE_TERM.fullmatch(term)
        if size is None:
            if pattern is not None:
                raise ValueError(f"routing: selector {text!r} has two globs ({pattern!r}, {term!r}); "
                                 f"expected at most one")
            pattern = term
            continue
        op, value = size.group(1), int(size.group(2))
        if op in (">=", ">"):
            low = max(low, value + (op == ">"))
        else:
            bound = value + (op == "<=")
            high = bound if high is None else min(high, bound)
    if high is not None and high <= low:
        raise ValueError(f"routing: selector {text!r} selects no size (numel >= {low} and < {high})")
    return Selector(pattern or "*", low, high)


def format_selector(selector: Selector) -> str:
    """The canonical text of a selector (inverse of :func:`parse_selector`)."""
    terms = [selector.pattern] if selector.pattern != "*" or (
        not selector.min_numel and selector.max_numel is None) else []
    if selector.min_numel:
        terms.append(f"numel>={selector.min_numel}")
    if selector.max_numel is not None:
        terms.append(f"numel<{selector.max_numel}")
    return " ".join(terms)


def split_min_numel(spec: str):
    """``"topk:0.1,min_numel=512"`` -> ``("topk:0.1", 512)``; ``(spec, None)`` without it.

    Raises:
        ValueError: min_numel is not an integer >= 1, or given twice.
    """
    name, colon, rest = spec.strip().partition(":")
    kept, value = [], None
    for item in rest.split(","):
        key, eq, text = item.partition("=")
        if eq and key.strip().lower() == ROUTING_OPTION:
            if value is not None:
                raise given_twice(name.strip(), ROUTING_OPTION)
            value = MIN_NUMEL.parse(name.strip(), ROUTING_OPTION, text)
            MIN_NUMEL.check(name.strip(), ROUTING_OPTION, value)
        elif item.strip():
            kept.append(item.strip())
    return name.strip() + (":" + ",".join(kept) if kept else ""), value


def with_min_numel(spec: str, min_numel: int) -> str:
    """``spec`` with ``min_numel=N`` appended as its last option."""
    return spec + ("," if ":" in spec else ":") + f"min_numel={min_numel}"


class RoutingSpec(NamedTuple):
    """A parsed compressor spec: ``rules`` ((Selector, scheme spec text), ...) in order,
    ``default`` (scheme spec text, without min_numel) and ``min_numel`` (None: the default's)."""

    rules: tuple
    default: str
    min_numel: Optional[int]


def parse_routing(spec: str) -> RoutingSpec:
    """Split a compressor spec (module docstring) into rules, default and min_numel.

    The scheme specs are checked (names, options, values) by :func:`parse_spec`.

    Raises:
        ValueError: no default or two of them, a malformed selector or scheme spec, or
            ``min_numel`` inside a rule, each naming the item.
    """
    if not isinstance(spec, str):
        raise ValueError(f"expected a compressor spec string, got {type(spec).__name__}")
    rules, default, min_numel = [], None, None
    items = [item.strip() for item in spec.split(";") if item.strip()]
    if not items:
        raise ValueError(f"empty compressor spec {spec!r}")
    for item in items:
        selector, arrow, scheme = item.partition(RULE_ARROW)
        if not arrow:
            if default is not None:
                raise ValueError(f"routing: two defaults in {spec!r} ({default!r}, {item!r}); every "
                                 f"other item needs a selector: 'glob -> scheme'")
            default, min_numel = split_min_numel(item)
            parse_spec(default)
            continue
        scheme = scheme.strip()
        text, inner = split_min_numel(scheme)
        if inner is not None:
            raise ValueError(f"routing: rule {item!r}: min_numel is the default's threshold; in a "
                             f"rule use a size term, e.g. '{selector.strip()} numel>={inner} -> {text}'")
        parse_spec(text)
        rules.append((parse_selector(selector.strip()), text))
    if default is None:
        raise ValueError(f"routing: no default scheme in {spec!r}; add one item without '->', e.g. "
                         f"'{spec.strip().rstrip(';')}; thc'")
    return RoutingSpec(tuple(rules), default, min_numel)
