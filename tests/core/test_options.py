"""hvd_gradcomp.options: one rule per kind of option, one wording, in every scheme; each option
declared once, and its checks, spec text, listing, docs/options.md table and "harder" direction derived
from that declaration."""
import dataclasses
import math
import os
import re
import subprocess
import sys
from typing import ClassVar, Optional

import pytest

from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.options import (WIRE_DTYPES, check_bool, check_choice, check_float, check_int,
                                  option, option_of, options_of, validate)
from hvd_gradcomp.powersgd import PowerSGDConfig
from hvd_gradcomp.routing import Routing
from hvd_gradcomp.registry import (OPTIONS_BLOCK, SCHEMES, describe_options, make_scheme,
                                   parse_spec, primary, to_spec)
from hvd_gradcomp.thc import THCConfig
from hvd_gradcomp.topk import TopKConfig
from hvd_gradcomp.topkc import TopKCConfig
from tests.conftest import ROOT


def message(check, *args, **kwargs):
    with pytest.raises(ValueError) as err:
        check(*args, **kwargs)
    return str(err.value)


def test_int():
    check_int("s", "n", 3, 1, 16)
    check_int("s", "n", 1, 1, 16)
    check_int("s", "n", -5)
    assert message(check_int, "s", "n", 17, 1, 16) == "s: n must be an integer in [1, 16], got 17"
    assert message(check_int, "s", "n", 0, lo=1) == "s: n must be an integer >= 1, got 0"
    assert message(check_int, "s", "n", 9, hi=8) == "s: n must be an integer <= 8, got 9"
    for bad in (2.0, True, "3", None):
        assert message(check_int, "s", "n", bad) == f"s: n must be an integer, got {bad!r}"


def test_float():
    check_float("s", "x", 1, 0.0, 1.0, lo_open=True)  # ints are numbers
    check_float("s", "x", math.inf, lo=1.0)  # no upper bound: inf passes
    check_float("s", "x", 0.0, 0.0, 1.0)
    assert (message(check_float, "s", "x", 0.0, 0.0, 0.5, lo_open=True)
            == "s: x must be a number in (0, 0.5], got 0.0")
    assert (message(check_float, "s", "x", 1.0, 0.0, 1.0, hi_open=True)
            == "s: x must be a number in [0, 1), got 1.0")
    assert message(check_float, "s", "x", 0.5, lo=1.0) == "s: x must be a number >= 1, got 0.5"
    assert message(check_float, "s", "x", 0.0, lo=0.0, lo_open=True) == "s: x must be a number > 0, got 0.0"
    assert message(check_float, "s", "x", 3, hi=2.5) == "s: x must be a number <= 2.5, got 3"
    for bad in (math.nan, True, "0.5", None):
        with pytest.raises(ValueError, match=r"^s: x must be a number in \(0, 1\], got "):
            check_float("s", "x", bad, 0.0, 1.0, lo_open=True)


def test_numpy_scalars_are_numbers_and_other_types_are_named():
    """NumPy scalars are accepted and kept as the Python number they stand for
    (``np.float32(0.1)`` as 0.1, so equal configs print one spec); a tensor or an array is
    refused with its type named."""
    np = pytest.importorskip("numpy")
    from torch_backend import Compression
    topkc = Compression.topkc(np.float32(0.1), chunk=np.int64(64))
    cfg = topkc.scheme.config
    assert (cfg.ratio, type(cfg.ratio), cfg.chunk, type(cfg.chunk)) == (0.1, float, 64, int)
    assert topkc.spec == Compression.topkc(0.1, chunk=64).spec == "topkc:ratio=0.1,chunk=64"
    assert make_scheme("thc", bits=np.int32(2)).config == THCConfig(bits=2)
    assert type(make_scheme("thc", bits=np.int32(2)).config.bits) is int
    assert make_scheme("topk", np.float64(1 / 3)).config.ratio == 1 / 3
    assert Compression.topkc(min_numel=np.int64(512)).routing.min_numel == 512
    assert type(Compression.topkc(min_numel=np.int64(512)).routing.min_numel) is int
    with pytest.raises(ValueError, match=r"^topkc: ratio must be a number in \(0, 1\], got .*1\.5.* \(numpy\.float32\)$"):
        Compression.topkc(np.float32(1.5))
    with pytest.raises(ValueError, match=r"^thc: bits must be an integer in \[1, 16\], got .*2\.0.* \(numpy\.float64\)$"):
        make_scheme("thc", bits=np.float64(2.0))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError) as err:
        Compression.topkc(torch.tensor(0.1))
    assert str(err.value) == "topkc: ratio must be a number in (0, 1], got tensor(0.1000) (torch.Tensor)"
    assert message(check_int, "s", "n", np.array(3)) == "s: n must be an integer, got array(3) (numpy.ndarray)"
    assert message(check_bool, "s", "b", np.bool_(True)).endswith("(numpy.bool_)")
    check_int("s", "n", np.uint8(3), 1, 16)
    check_float("s", "x", np.float16(0.5), 0.0, 1.0)


def test_plain_number():
    np = pytest.importorskip("numpy")
    from fractions import Fraction
    from hvd_gradcomp.options import plain_number
    assert plain_number(np.float32(0.1)) == 0.1 and plain_number(np.float16(0.1)) == 0.1
    assert plain_number(np.float32(1 / 3)) == 0.33333334  # the same float32, shortest digits
    assert plain_number(np.float64(0.1)) == 0.1 and plain_number(np.int64(7)) == 7
    assert plain_number(Fraction(1, 4)) == 0.25 and plain_number(Fraction(1, 3)) == 1 / 3
    assert plain_number(np.float32(np.inf)) == math.inf


def test_bool_and_choice():
    check_bool("s", "b", False)
    for bad in (1, 0, "yes", None):
        assert message(check_bool, "s", "b", bad) == f"s: b must be True or False, got {bad!r}"
    check_choice("s", "c", "float32", WIRE_DTYPES)
    assert (message(check_choice, "s", "c", "bfloat16", WIRE_DTYPES)
            == "s: c must be 'float16' or 'float32', got 'bfloat16'")
    assert message(check_choice, "s", "c", "d", ("a", "b", "c")) == "s: c must be 'a', 'b' or 'c', got 'd'"
    assert message(check_choice, "s", "c", None, ("a",)) == "s: c must be 'a', got None"


def test_seed():
    """A seed is any integer >= 0 (the rule of every scheme's ``seed``)."""
    for seed in (0, 2 ** 40):
        assert THCConfig(seed=seed).seed == seed
    assert message(THCConfig, seed=-1) == "thc: seed must be an integer >= 0, got -1"


@pytest.mark.parametrize("config,name", [(TopKConfig, "topk"), (TopKCConfig, "topkc"),
                                         (THCConfig, "thc"), (PowerSGDConfig, "powersgd")])
def test_shared_options_share_one_rule(config, name):
    """error_feedback, seed and ratio are refused alike in every scheme that has them."""
    fields = config.__dataclass_fields__
    # TopKC and PowerSGD offer one more form of error feedback, EF21, by name.
    rule = "True, False or 'ef21'" if name in ("topkc", "powersgd") else "True or False"
    assert message(config, error_feedback="yes") == f"{name}: error_feedback must be {rule}, got 'yes'"
    assert message(config, error_feedback=1) == f"{name}: error_feedback must be {rule}, got 1"
    if "seed" in fields:
        assert message(config, seed=-1) == f"{name}: seed must be an integer >= 0, got -1"
        assert message(config, seed=1.0) == f"{name}: seed must be an integer >= 0, got 1.0"
    if "ratio" in fields:
        assert message(config, ratio=0.0) == f"{name}: ratio must be a number in (0, 1], got 0.0"


def test_each_option_named():
    """Each option is checked on its own, so the message names the one that is wrong."""
    assert message(THCConfig, saturation=1) == "thc: saturation must be True or False, got 1"
    assert message(THCConfig, saturation_rate=0.7) == "thc: saturation_rate must be a number in (0, 0.5] or None, got 0.7"
    assert message(PowerSGDConfig, min_compression_rate="2") == (
        "powersgd: min_compression_rate must be a number >= 1, got '2'")
    assert message(PowerSGDConfig, uncompressed_dtype="bfloat16") == (
        "powersgd: uncompressed_dtype must be 'float16' or 'float32', got 'bfloat16'")
    assert message(TopKCConfig, payload_dtype="int8") == (
        "topkc: payload_dtype must be 'float16' or 'float32', got 'int8'")


# ---------------------------------------------------------------- declarations

# For every option declared with ``harder``: (harder spec, softer spec), differing in that
# option only (plus what the option needs to matter), checked against the scheme's wire().
HARDER_PAIRS = {
    ("topk", "ratio"): ("topk:ratio=0.01", "topk:ratio=0.1"),
    ("topkc", "ratio"): ("topkc:ratio=0.01", "topkc:ratio=0.1"),
    ("topkc", "payload_dtype"): ("topkc:ratio=0.1", "topkc:ratio=0.1,payload_dtype=float32"),
    ("topkc", "selection"): ("topkc:ratio=0.1", "topkc:ratio=0.1,selection=current"),
    ("powersgd", "rank"): ("powersgd:rank=1", "powersgd:rank=8"),
    ("powersgd", "min_compression_rate"): ("powersgd:rank=4,min_compression_rate=2",
                                           "powersgd:rank=4,min_compression_rate=1000"),
    ("powersgd", "start_step"): ("powersgd:variant=two_round",
                                 "powersgd:variant=two_round,start_step=10"),
    ("powersgd", "uncompressed_dtype"): ("powersgd:rank=4", "powersgd:rank=4,uncompressed_dtype=float32"),
    ("powersgd", "variant"): ("powersgd:rank=4", "powersgd:rank=4,variant=two_round"),
    ("thc", "bits"): ("thc:bits=2", "thc:bits=8"),
    ("thc", "lane_bits"): ("thc:lane_bits=4", "thc:lane_bits=16"),
    ("thc", "range"): ("thc", "thc:range=current"),
    ("sparseloco", "ratio"): ("sparseloco:ratio=0.01", "sparseloco:ratio=0.1"),
    ("sparseloco", "bits"): ("sparseloco:bits=2", "sparseloco:bits=4"),
}
# Large enough that fixed costs do not decide (the options' "harder" is stated for these).
LARGE_SHAPES = [(65536,), (100000,), (1 << 20,), (512, 1024), (3000, 700), (256, 128, 3, 3)]


def _declared():
    for name, (config, _) in SCHEMES.items():
        for key, decl in options_of(config).items():
            yield name, key, decl


def test_every_option_declared_once():
    """Every field of every catalogue config is declared with option(), with a one-line doc,
    under the scheme's own name."""
    for name, (config, _) in SCHEMES.items():
        fields = dataclasses.fields(config)
        for f in fields:
            decl = option_of(f)
            assert decl is not None, f"{name}.{f.name} is not declared with option()"
            assert f.default == decl.default and decl.doc and "\n" not in decl.doc
        if fields:
            assert config.SCHEME == name
        if primary(name):
            assert primary(name) in {f.name for f in fields}


def test_declaration_drives_parse_check_and_spec():
    """Each option's default formats to spec text that parses back to it; each bound refuses
    the value just past it with the declared rule; full specs round-trip."""
    for name, key, decl in _declared():
        decl.check(name, key, decl.default)
        assert decl.parse(name, key, decl.format(decl.default)) == decl.default, (name, key)
        for bound, step, is_open in ((decl.lo, -1, decl.lo_open), (decl.hi, 1, decl.hi_open)):
            if bound is None:
                continue
            bad = bound if is_open else bound + step * (1 if decl.kind == "integer" else 1e-6)
            with pytest.raises(ValueError, match=re.escape(f"{name}: {key} must be {decl.rule()}, got ")):
                decl.check(name, key, bad)
        if decl.kind == "choice":
            with pytest.raises(ValueError, match=re.escape(f"{name}: {key} must be {decl.rule()}, got 'x'")):
                decl.check(name, key, "x")
    for name in SCHEMES:
        scheme = make_scheme(name)
        n, opts = parse_spec(to_spec(scheme, full=True))
        assert make_scheme(n, **opts).config == scheme.config
    spec = "thc:bits=2,saturation=false,saturation_rate=0.25"
    assert to_spec(make_scheme(*parse_spec(spec)[:1], **parse_spec(spec)[1])) == spec
    assert make_scheme("topkc", ratio=1).config.ratio == 1.0 and to_spec(make_scheme("topkc", 1)) == "topkc:ratio=1.0"


def test_harder_matches_the_wire():
    """An option's declared ``harder`` is the way that sends no more bytes on large tensors."""
    declared = {(name, key) for name, key, decl in _declared() if decl.harder is not None}
    assert declared == set(HARDER_PAIRS), "add a (harder, softer) spec pair for each option with harder"
    for (name, key), (hard_spec, soft_spec) in HARDER_PAIRS.items():
        decl = options_of(SCHEMES[name][0])[key]
        hard, soft = (make_scheme(*parse_spec(s)[:1], **parse_spec(s)[1]) for s in (hard_spec, soft_spec))
        a, b = getattr(hard.config, key), getattr(soft.config, key)
        assert {"down": a < b, "up": a > b}.get(decl.harder, a == decl.harder != b), (name, key)
        for shape in LARGE_SHAPES:
            for world in (2, 8):
                info = TensorInfo("k", shape, "float32", world, 0, "sum")
                # what a compressor of each sends: the routed scheme's (PowerSGD's vectors: fp16 or none)
                sizes = [sum(Routing.single(s).decide("k", info).scheme.wire(info)[:2]) for s in (hard, soft)]
                assert sizes[0] <= sizes[1], (name, key, shape, world, sizes)


def test_option_declarations_and_inferred_fields():
    with pytest.raises(TypeError, match="kind must be one of"):
        option(1, kind="int", doc="x")
    with pytest.raises(TypeError, match="harder must be None or one of"):
        option(1, kind="integer", harder="more", doc="x")
    with pytest.raises(TypeError, match="option: default must be an integer >= 1, got 0"):
        option(0, kind="integer", lo=1, doc="x")
    with pytest.raises(TypeError, match="one line"):
        option(True, kind="boolean", doc="")

    @dataclasses.dataclass(frozen=True)
    class Declared:
        SCHEME: ClassVar[str] = "demo"
        rate: Optional[float] = option(None, kind="number", lo=0.0, lo_open=True, optional=True,
                                       doc="a rate; none: measured")

        def __post_init__(self):
            validate(self)

    assert Declared(rate=2).rate == 2.0 and Declared().rate is None
    assert message(Declared, rate=0) == "demo: rate must be a number > 0 or None, got 0"
    decl = options_of(Declared)["rate"]
    assert decl.parse("demo", "rate", "none") is None and decl.format(None) == "none"
    assert message(decl.parse, "demo", "rate", "fast") == "demo: rate must be a number > 0 or None, got 'fast'"

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        flag: bool = True
        names: str = "a|b"
        limit: Optional[int] = None

    with pytest.raises(TypeError, match=r"Undeclared.flag is not declared with hvd_gradcomp.options.option"):
        options_of(Undeclared)
    with pytest.raises(TypeError, match="Undeclared.flag is not declared"):
        options_of(Undeclared())


def _options_block(text):
    match = re.search(rf"<!-- {OPTIONS_BLOCK}:start -->\n(.*?)\n<!-- {OPTIONS_BLOCK}:end -->", text, re.S)
    assert match, "the options block is missing"
    return match.group(1)


def test_docs_option_table_is_generated():
    """docs/options.md's option table is exactly describe_options(markdown=True)."""
    with open(os.path.join(ROOT, "docs", "options.md")) as f:
        table = _options_block(f.read())
    assert table == describe_options(markdown=True), (
        "docs/options.md's option table differs from the declarations; rewrite it with "
        "'python -m hvd_gradcomp --update-doc'")


def test_option_listing_command(tmp_path):
    """``python -m hvd_gradcomp --list`` lists every option; ``--update-doc`` writes the table."""
    out = subprocess.run([sys.executable, "-m", "hvd_gradcomp", "--list"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == describe_options()
    for name, key, decl in _declared():
        assert f"  {key}={decl.format(decl.default)}  [{decl.values()}" in out
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- options:start -->\nold\n<!-- options:end -->\nend\n")
    subprocess.run([sys.executable, "-m", "hvd_gradcomp", "--update-doc", str(doc)], cwd=ROOT,
                   capture_output=True, text=True, check=True)
    assert _options_block(doc.read_text()) == describe_options(markdown=True)
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("end\n")
    from hvd_gradcomp.__main__ import build_parser
    assert build_parser().parse_args(["--update-doc"]).update_doc == [os.path.join(ROOT, "docs", "options.md")]
    bad = subprocess.run([sys.executable, "-m", "hvd_gradcomp", "zstd"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown compressor 'zstd'" in bad.stderr
