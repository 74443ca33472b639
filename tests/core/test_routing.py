"""Routing (hvd_gradcomp/routing.py) and its spec grammar (hvd_gradcomp/routing_spec.py): decisions,
canonical specs, errors; no Horovod launch (the multi-rank checks are in
tests/parallel/test_routing.py, both frameworks)."""
import pytest

from hvd_gradcomp.horovod_ops import group_dtype
from hvd_gradcomp.base import FALLBACK, StepBytes, TensorInfo
from hvd_gradcomp.registry import make_scheme
from hvd_gradcomp.routing import (RouteTable, Routing, Selector, canonical_text, format_selector, parse_routing,
                                  parse_selector)
from hvd_gradcomp.thc import THCConfig
from hvd_gradcomp.topkc import TopKCConfig
from tests.backends import BACKENDS

RULES = [("*.bias", "fp16"), ("*embed*", "topkc:ratio=0.05"), ("numel>=1000000", "powersgd:4")]
SPEC = "*.bias -> fp16; *embed* -> topkc:ratio=0.05; numel>=1000000 -> powersgd:rank=4; thc:min_numel=4096"


def test_decisions_follow_rules_then_min_numel_then_default():
    r = Routing.from_rules(RULES, default="thc", min_numel=4096)
    cases = {
        ("dec.bias", 10): ("fp16", "rule 0 '*.bias'"),
        ("big.bias", 5_000_000): ("fp16", "rule 0 '*.bias'"),  # rules win whatever the size
        ("embedding.weight", 100): ("topkc:ratio=0.05", "rule 1 '*embed*'"),  # even below min_numel
        ("fc.weight", 2_000_000): ("powersgd:rank=4", "rule 2 'numel>=1000000'"),
        ("fc.weight", 4095): ("fp16", "numel < min_numel=4096"),
        ("fc.weight", 4096): ("thc", "default"),
        ("Embed.weight", 5000): ("thc", "default"),  # globs are case-sensitive
    }
    for (name, numel), (text, why) in cases.items():
        route = r.decide(name, numel)
        assert (route.text, route.why) == (text, why), (name, numel)
        assert route.scheme.spec().split(":")[0] == text.split(":")[0]
    # The schemes compress whatever they get: no size threshold in their configs.
    assert r.decide("embedding.weight", 100).scheme.config == TopKCConfig(ratio=0.05)
    assert r.decide("fc.weight", 4096).scheme.config == THCConfig()
    assert r.needs_names()
    assert not Routing.from_rules([("numel<64", "none")], "thc").needs_names()


def test_size_terms_and_selector_text():
    assert parse_selector("*conv* numel>=10 numel<=99") == Selector("*conv*", 10, 100)
    assert parse_selector("numel > 9") == Selector("*", 10, None)
    assert format_selector(Selector("*conv*", 10, 100)) == "*conv* numel>=10 numel<100"
    assert format_selector(Selector()) == "*"
    r = Routing.from_spec("numel<64 -> none; numel>=64 numel<128 -> bf16; fp16")
    assert [r.decide(None, n).text for n in (1, 63, 64, 127, 128)] == ["none", "none", "bf16", "bf16", "fp16"]


def test_default_min_numel_per_scheme():
    """1024 for thc, topkc and auto (their class attribute min_numel), 1 for the others: plain
    compressors route exactly as before the routing existed."""
    for spec, threshold in (("thc", 1024), ("topkc", 1024), ("topk", 1), ("powersgd", 1), ("fp16", 1),
                            ("thc:min_numel=7", 7), ("topk:0.1,min_numel=512", 512)):
        assert Routing.from_spec(spec).min_numel == threshold, spec
    assert Routing.from_rules(RULES, default="topk").min_numel == 1
    assert Routing.from_rules(RULES).min_numel == 1024  # default thc
    # A plain thc: the threshold is the routing's, the scheme's config the default one.
    plain = Routing.from_spec("thc:min_numel=7")
    assert plain.default.config == THCConfig() and plain.spec() == "thc:min_numel=7"
    assert Routing.single(make_scheme("thc", bits=2), 512).spec() == "thc:bits=2,min_numel=512"
    assert plain.decide("x", 6).text == "fp16" and plain.decide("x", 7).text == "thc"


def test_canonical_specs_round_trip():
    r = Routing.from_rules(RULES, default="thc", min_numel=4096)
    assert r.spec() == SPEC
    assert Routing.from_spec(SPEC).spec() == SPEC
    assert Routing.from_spec(" *.bias->fp16 ;*embed*  ->topkc:0.05; numel>=1000000->powersgd:4;"
                             "thc:min_numel=4096 ").spec() == SPEC
    # The default may come anywhere; the canonical form puts it last.
    assert Routing.from_spec("thc:min_numel=4096; " + SPEC.rpartition(";")[0]).spec() == SPEC
    for spec in ("thc", "thc:min_numel=1", "topk:ratio=0.1,min_numel=1024", "fp16", "topkc:ratio=0.1,chunk=64",
                 "powersgd:rank=2"):
        assert Routing.from_spec(spec).spec() == spec
    assert Routing.from_rules([], "thc").spec() == "thc"
    assert parse_routing("thc").rules == ()
    # Routes recorded in checkpoints before booleans were written true/false still match.
    assert canonical_text("thc:saturation=False,bits=2") == "thc:bits=2,saturation=false"
    assert canonical_text("zip:1") == "zip:1"


def test_size_bounds_in_exponent_and_underscore_forms():
    """``numel>=1e6``, ``1E6`` and ``1_000_000`` are one size term each (not ``numel>=1`` and a
    glob ``e6``), read exactly and written back as digits."""
    for text in ("numel>=1e6", "numel>=1E6", "numel>=1_000_000", "numel >= 1e+6", "numel>=1000000"):
        assert parse_selector(text) == Selector("*", 1_000_000, None), text
    assert parse_selector("*.w numel>=2.5e5 numel<1e7") == Selector("*.w", 250_000, 10_000_000)
    assert parse_selector("numel<9999999999999999999").max_numel == 9_999_999_999_999_999_999  # exact
    r = Routing.from_spec("numel>=1e6 -> powersgd:4; fp16")
    assert r.spec() == "numel>=1000000 -> powersgd:rank=4; fp16"
    assert r.decide("w", 1_000_000).text == "powersgd:rank=4" and r.decide("w", 999_999).text == "fp16"
    assert Routing.from_rules([("numel>=1E6", "powersgd:4")], "fp16").spec() == r.spec()


@pytest.mark.parametrize("bound", ["1.5", "-1", "1e-3", "1e19", "1e999999999", "abc", "", "1__0", "_1",
                                   "1e6x", "0x10", "inf", "nan"])
def test_malformed_size_bound_raises(bound):
    with pytest.raises(ValueError) as err:
        Routing.from_spec(f"*.w numel>={bound} -> fp16; thc")
    assert str(err.value) == (f"routing: selector '*.w numel>={bound}': numel bound must be a whole number "
                              f"in [0, 1e19) (4096, 1_000_000 or 1e6), got {bound!r}")


@pytest.mark.parametrize("spec,message", [
    ("*.bias -> fp16", "routing: no default scheme in '*.bias -> fp16'; add one item without '->'"),
    ("thc; fp16", "routing: two defaults in 'thc; fp16'"),
    ("*.b -> topkc:min_numel=5; thc", "routing: rule '*.b -> topkc:min_numel=5': min_numel is the default's "
                                      "threshold; in a rule use a size term, e.g. '*.b numel>=5 -> topkc'"),
    ("a b -> fp16; thc", "routing: selector 'a b' has two globs ('a', 'b'); expected at most one"),
    ("numel<5 numel>=9 -> fp16; thc", "routing: selector 'numel<5 numel>=9' selects no size"),
    ("*.bias -> zip; thc", "unknown compressor 'zip'"),
    ("*.bias -> topkc:ratio=2; thc", "topkc: ratio must be a number in (0, 1], got 2.0"),
    ("topk:min_numel=0", "topk: min_numel must be an integer >= 1, got 0"),
    ("topk:min_numel=x", "topk: min_numel must be an integer >= 1, got 'x'"),
    ("thc:min_numel=5,min_numel=6", "thc: min_numel given twice"),
    ("", "empty compressor spec"),
])
def test_bad_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError) as err:
        Routing.from_spec(spec)
    assert message in str(err.value)


def test_bad_python_rules_raise_value_error():
    with pytest.raises(ValueError, match=r"routing: rule 0 must be a \(selector, scheme spec\) pair, got '\*\.bias'"):
        Routing.from_rules(["*.bias"])
    with pytest.raises(ValueError, match="min_numel given twice"):
        Routing.from_rules(RULES, default="thc:min_numel=5", min_numel=6)
    with pytest.raises(ValueError, match="thc: min_numel must be an integer >= 1, got 0"):
        Routing.from_rules(RULES, min_numel=0)
    with pytest.raises(ValueError, match="rules match tensor names, and this tensor has none"):
        Routing.from_rules(RULES).decide(None, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rules_take_compressors_of_one_scheme(backend):
    """A compressor as a rule's scheme or the default gives its spec (a default keeps its
    min_numel); one with rules of its own, or a rule's with a min_numel, is refused."""
    C = _compression(backend)
    comp = C.rules([("*.bias", C.fp16()), ("*embed*", C.topkc(0.05)), ("numel>=1e6", "powersgd:4")],
                   default=C.thc(bits=2, min_numel=64))
    assert comp.spec == ("*.bias -> fp16; *embed* -> topkc:ratio=0.05; numel>=1000000 -> powersgd:rank=4; "
                         "thc:bits=2,min_numel=64")
    assert C.rules([("*.w", C.topkc(0.1, fp16_warmup=3))], C.fp16()).spec == \
        "*.w -> topkc:ratio=0.1,fp16_warmup=3; fp16"
    assert C.rules((r for r in [("*.w", "fp16")]), "thc").spec == "*.w -> fp16; thc"  # any iterable
    with pytest.raises(ValueError, match=r"routing: rule 0 \('\*\.b', Compressor\('\*\.x -> fp16; thc'\)\): "
                                         r"compressor '\*\.x -> fp16; thc' routes by rules of its own"):
        C.rules([("*.b", C.from_spec("*.x -> fp16; thc"))])
    with pytest.raises(ValueError, match="routing: compressor '\\*\\.x -> fp16; thc' routes by rules of its own; "
                                         "the default must be one scheme"):
        C.rules([], default=C.from_spec("*.x -> fp16; thc"))
    with pytest.raises(ValueError, match=r"compressor 'topkc:min_numel=5' has min_numel=5, the default's "
                                         r"threshold; in a rule use a size term \('numel>=5'\)"):
        C.rules([("*.b", C.topkc(min_numel=5))])


def _compression(backend):
    if backend == "torch":
        from torch_backend import Compression
    else:
        from tf_backend import Compression
    return Compression


@pytest.mark.parametrize("rules,default,message", [
    ([("*.bias", "fp16")], None, "routing: the default must be a scheme spec string ('fp16') or a compressor "
                                 "of one scheme (Compression.fp16()), got NoneType None"),
    ([("*.bias", "fp16")], 4, "routing: the default must be a scheme spec string"),
    ("*.bias -> fp16", "thc", "routing: rules must be a list of (selector, scheme spec) pairs, got str"),
    ({"*.bias": "fp16"}, "thc", "routing: rules must be a list of (selector, scheme spec) pairs, got dict"),
    (None, "thc", "routing: rules must be a list of (selector, scheme spec) pairs, got NoneType None"),
    ([(3, "fp16")], "thc", "routing: rule 0 (3, 'fp16'): the selector must be a string (a glob and/or numel "
                           "bounds) or a Selector, got int"),
    ([("*.w", "fp16"), ("*.b", None)], "thc", "routing: rule 1 ('*.b', None): the scheme must be a scheme "
                                              "spec string ('fp16') or a compressor of one scheme"),
    ([("*.b; *.w", "fp16")], "thc", "routing: rule 0 ('*.b; *.w', 'fp16'): the selector holds ';', a separator "
                                    "of the spec text (between rules); give each rule as its own"),
    ([("*.b", "fp16; *.w -> thc")], "thc", "routing: rule 0 ('*.b', 'fp16; *.w -> thc'): the scheme holds ';'"),
    ([("*.b -> fp16", "thc")], "thc", "routing: rule 0 ('*.b -> fp16', 'thc'): the selector holds '->', a "
                                      "separator of the spec text (between a selector and its scheme)"),
    ([], "fp16; *.w -> thc", "routing: the default holds ';'"),
])
def test_bad_rule_types_and_separators(rules, default, message):
    with pytest.raises(ValueError) as err:
        Routing.from_rules(rules, default)
    assert message in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rules_refuse_a_factory(backend):
    C = _compression(backend)
    with pytest.raises(ValueError) as err:
        C.rules([("*.bias", C.fp16)])
    assert str(err.value) == ("routing: rule 0 ('*.bias', Compression.fp16): the scheme must be a scheme spec "
                              "string ('fp16') or a compressor of one scheme (Compression.fp16()), got Factory "
                              "Compression.fp16; call it: Compression.fp16()")


def test_group_dtype():
    assert group_dtype(["int32", "int32"]) is None
    assert group_dtype(["float16", "float32"]) == "float32"
    assert group_dtype(["float16", "int32"]) == "float64"
    assert group_dtype(["float32", "float64"]) == "float64"
    with pytest.raises(ValueError, match="no payload dtype holds payloads of dtypes"):
        group_dtype(["int64", "float16"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_narrowed_wraps_int32_like_the_int32_all_reduce(backend):
    """A float64-widened int32 payload comes back as the int32 all-reduce would have made it:
    inside int32's range the plain cast (toward zero: Horovod's truncated Average), beyond it
    modulo 2**32 (a Sum of THC's ``subtract_own`` words)."""
    import numpy as np
    from hvd_gradcomp.grouped import narrowed
    from tests.backends import as_numpy, backend_ops, native_tensor
    ops = backend_ops(backend)
    values = np.array([0.0, 5.0, -3.5, 7.9, 2.0 ** 31 - 1, -2.0 ** 31, 2.0 ** 31 + 5, -2.0 ** 31 - 3,
                       3 * 2.0 ** 31 + 8, 2.0 ** 33], np.float64)
    got = as_numpy(narrowed(ops, native_tensor(backend, values), "int32"))
    want = [0, 5, -3, 7, 2 ** 31 - 1, -2 ** 31, -2 ** 31 + 5, 2 ** 31 - 3, -2 ** 31 + 8, 0]
    assert got.dtype == np.int32 and got.tolist() == want
    halves = as_numpy(narrowed(ops, native_tensor(backend, np.array([1.5, -2.25], np.float32)), "float16"))
    assert halves.dtype == np.float16 and halves.tolist() == [1.5, -2.25]


def test_step_bytes_total_counts_sparse():
    b = StepBytes(100, 20, 1, 300, 2)
    assert b.total == 420 and (b.payload, b.side, b.side_collectives) == (100, 20, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compression_rules_factory(backend):
    if backend == "torch":
        from torch_backend import Compression
    else:
        from tf_backend import Compression
    comp = Compression.rules(RULES, default="thc", min_numel=4096)
    assert comp.spec == SPEC and Compression.from_spec(SPEC).spec == SPEC
    assert comp.scheme.name == "thc" and comp.routing.min_numel == 4096
    assert Compression.topk(0.1, min_numel=100).spec == "topk:ratio=0.1,min_numel=100"
    thc = Compression.thc(min_numel=100)
    assert (thc.routing.min_numel, thc.spec, thc.scheme.config) == (100, "thc:min_numel=100", THCConfig())
    assert Compression.thc().routing.min_numel == Compression.topkc().routing.min_numel == 1024
    assert Compression.thc(2, min_numel=512).spec == "thc:bits=2,min_numel=512"
    assert repr(Compression.topkc(min_numel=5)).endswith(
        "('topkc:ratio=0.01,chunk=256,error_feedback=true,payload_dtype=float16,selection=previous,"
        "residual_decay=1.0,ef21_momentum=1.0,max_age=0,min_numel=5')")
    with pytest.raises(ValueError, match="^thc: min_numel must be an integer >= 1, got 0$"):
        Compression.thc(min_numel=0)
    assert "rules" in dir(Compression)


def _info(shape, key="t"):
    return TensorInfo(key, tuple(shape), "float32", 1, 0)


def test_a_tensor_the_scheme_does_not_accept_goes_to_its_fallback():
    """PowerSGD accepts the matrices rank r shrinks; the routing sends the rest to fp16 (none:dtype=float32
    with uncompressed_dtype=float32), from a rule as from the default; sizes-only questions
    (an int) do not ask."""
    r = Routing.from_spec("*.w -> powersgd:4; powersgd:1")
    matrix, vector, square = _info((64, 48)), _info((100,)), _info((3, 3))
    assert r.decide("a.w", matrix).text == "powersgd:rank=4"
    route = r.decide("a.w", vector)
    assert (route.index, route.text, route.refused) == (2, "fp16", "powersgd:rank=4")
    assert route.why == "rule 0 '*.w': powersgd does not accept float32[100]"
    assert r.decide("b", square).text == "fp16" and r.decide("b", matrix).text == "powersgd"
    assert r.decide("b", 9).text == "powersgd"  # no shape: sizes only
    wide = Routing.from_spec("powersgd:uncompressed_dtype=float32")
    assert wide.decide("b", vector).text == "none:dtype=float32" and wide.decide("b", matrix).text == "powersgd:uncompressed_dtype=float32"
    assert {s.name for s in wide.schemes()} == {"powersgd", "fp16", "none"}
    # The warm-up wrapper asks its scheme, and keeps its min_numel.
    warm = Routing.from_spec("powersgd:fp16_warmup=3")
    assert warm.decide("b", vector).text == "fp16" and warm.decide("b", matrix).text == "powersgd:fp16_warmup=3"
    assert Routing.from_spec("thc:fp16_warmup=3").min_numel == 1024
    assert make_scheme("powersgd", 4, fp16_warmup=3).accepts(vector) is False
    # Every other scheme accepts every tensor.
    for name in ("none", "fp16", "bf16", "topk", "topkc", "thc", "auto"):
        assert make_scheme(name).accepts(vector), name


def test_a_fallback_that_refuses_the_tensor_too_gives_way_to_fp16():
    """A scheme whose own fallback refuses the tensor as well (here PowerSGD, for a vector):
    the routing sends it to FALLBACK, which takes every tensor."""
    from hvd_gradcomp.cast import Fp16Scheme

    class MatricesOnly(Fp16Scheme):
        fallback_spec = "powersgd:rank=4"

        def accepts(self, info):
            return len(info.shape) == 2

    r = Routing.single(MatricesOnly())
    vector, matrix = _info((100,)), _info((64, 48))
    route = r.decide("v", vector)
    assert (route.text, route.scheme.name, route.refused) == (FALLBACK, FALLBACK, "fp16")
    assert r.decide("m", matrix).scheme.name == "fp16" and isinstance(r.decide("m", matrix).scheme, MatricesOnly)
    assert {s.name for s in r.schemes()} == {"fp16", "powersgd"}


def test_routing_defaults_are_declared_on_the_classes():
    """min_numel and the first positional option come from the scheme and config classes."""
    from hvd_gradcomp.auto import AutoScheme
    from hvd_gradcomp.registry import SCHEMES, primary
    from hvd_gradcomp.thc import THCScheme
    from hvd_gradcomp.topkc import TopKCScheme
    assert THCScheme.min_numel == TopKCScheme.min_numel == AutoScheme.min_numel == 1024
    assert {name: cls.min_numel for name, (_, cls) in SCHEMES.items() if cls.min_numel != 1} == \
        {"thc": 1024, "topkc": 1024, "sparseloco": 1024, "auto": 1024}
    assert {name: primary(name) for name in SCHEMES if primary(name)} == \
        {"topk": "ratio", "topkc": "ratio", "thc": "bits", "powersgd": "rank", "sparseloco": "ratio"}
    assert primary("fp16") is None and make_scheme("thc", 2).config.bits == 2
    assert Routing.from_spec("auto").min_numel == 1024 and Routing.from_spec("auto").decide("x", 1023).text == FALLBACK


def test_route_table_decides_once_and_checks_ranks_and_checkpoints():
    table = RouteTable(Routing.from_spec("*.bias -> fp16; powersgd"))
    route = table.of("fc.w", "fc.w", None, _info((64, 48)))
    assert table.of("fc.w", "other", None, _info((1,))) is route  # decided once per key
    table.load({"fc.w": "powersgd", "b": "powersgd", "c.bias": "fp16"})
    # A checkpoint that routed a vector to the scheme that now refuses it still loads.
    assert table.of("b", "b", None, _info((10,))).text == "fp16"
    assert table.texts() == {"fc.w": "powersgd", "b": "fp16", "c.bias": "fp16"}
    with pytest.raises(ValueError, match="tensor 'x' was routed to 'thc' in the checkpoint, and this "
                                         "compressor routes it to 'powersgd' \\(default\\)"):
        table.load({"x": "thc"})
        table.of("x", "x", None, _info((64, 48)))
    with pytest.raises(ValueError, match="routed to 'fp16' in the checkpoint"):
        table.load({"fc.w": "fp16"})
    # route(): one decision per parameter, pinned; the ranks' tables compared.
    items = [("l.bias", (8,), "float32", "pin0"), ("l.w", (64, 48), "float32", "pin1"),
             ("steps", (1,), "int64", None)]
    seen = []

    def gather(mine):
        seen.append(mine)
        return [mine, mine]
    assert table.route(items, gather) == [("l.bias", "fp16"), ("l.w", "powersgd"), ("steps", None)]
    assert seen[0][0] == ("l.bias", "fp16", "rule 0 '*.bias'")
    assert table.of("grad_1", "renamed", "pin1", _info((64, 48))).text == "powersgd"  # by pin
    with pytest.raises(ValueError, match="was not given to route"):
        table.of("grad_9", "v", "pin9", _info((64, 48)))
    other = [("l.bias", "fp16", "rule 0"), ("l_1.w", "fp16", "default: powersgd does not accept")]
    with pytest.raises(ValueError, match=r"the ranks route parameter 1 differently \(rank 0: 'l.w' -> "
                                         r"powersgd \(default\); rank 1: 'l_1.w' -> fp16"):
        table.route(items[:2], lambda mine: [mine, other])
    with pytest.raises(ValueError, match="route\\(\\) got 2 parameters on rank 0 and 1 on rank 1"):
        table.route(items[:2], lambda mine: [mine, mine[:1]])


def test_auto_never_runs_nor_chooses_a_candidate_that_refuses_the_tensor():
    """On a vector, powersgd (which refuses it) is pruned from every window and never the
    start, whatever its bytes; decide() never picks a candidate of infinite wire bytes."""
    import math
    from hvd_gradcomp.auto import Link, decide, start_choice
    link = Link(1e6, 0.0)  # a slow link: compression would pay
    auto = make_scheme("auto", candidates="fp16|powersgd:4|topkc:0.1", bandwidth_gbit=0.001)
    vector, matrix = _info((100000,), "v"), _info((1000, 1000), "m")
    assert auto._fits(vector) == [True, False, True] and auto._fits(matrix) == [True, True, True]
    assert auto._wires(vector)[1] == math.inf and 1 in auto._hopeless(vector)
    assert start_choice([2000, math.inf, 300], [2_000_000, 10, 20_000], 2, link, 0, 0.1) == 2
    assert start_choice([2000, math.inf], [2_000_000, 10], 2, link, 0, 0.1) == 0
    choice, predicted, _ = decide([1.0, 0.0, 1.0], [0.0, 0.1, 0.5], [200_000, math.inf, 20_000], 2, link,
                                  None, 0, 0.95, 0.1)
    assert choice == 2 and predicted[1] == math.inf
    # World size 1 (no link time at all): still never chosen.
    assert decide([1.0, 0.0], [0.0, 0.0], [200_000, math.inf], 1, link, None, 0, 0.95, 0.1)[0] == 0


def _core_imports(added=None):
    """``{module: modules of hvd_gradcomp it imports}`` for every module of hvd_gradcomp, read
    from the source: every ``import``/``from ... import`` anywhere in the file, a lazy one
    inside a function included (it is still a circle, only a later one), relative ones
    resolved, ``from . import x`` as the submodule ``x``. Edges to the root package itself are
    left out: Python runs ``hvd_gradcomp/__init__.py`` before any of its submodules, whoever
    imports them. ``added``: ``{module: source text}`` read as if appended to that module."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    paths = {}
    for path in (root / "hvd_gradcomp").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text() + (added or {}).get(name, ""))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths]
                found.update(subs or [target])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in paths and m not in (name, "hvd_gradcomp")}
    return graph


def _circles(graph):
    """The import circles of ``graph``: each strongly connected set of two or more modules,
    sorted (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            circle = []
            while not circle or circle[-1] != v:
                circle.append(stack.pop())
                on.discard(circle[-1])
            if len(circle) > 1:
                out.append(sorted(circle))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """base.py, the options and auto's decisions import neither the catalogue nor the routing;
    auto imports no catalogue at all (the registry builds its candidates and hands them over,
    as the warm-up gets its inner scheme; issue 33); and hvd_gradcomp's modules import each
    other without any circle, lazy imports inside functions counted."""
    graph = _core_imports()
    catalogue = {"hvd_gradcomp.registry", "hvd_gradcomp.routing", "hvd_gradcomp.routing_spec"}
    for name in ("hvd_gradcomp.base", "hvd_gradcomp.options", "hvd_gradcomp.auto.decisions"):
        assert not graph[name] & catalogue, (name, graph[name] & catalogue)
    for name in (n for n in graph if n == "hvd_gradcomp.auto" or n.startswith("hvd_gradcomp.auto.")):
        assert not graph[name] & catalogue, (name, graph[name] & catalogue)
    assert "hvd_gradcomp.auto" in graph["hvd_gradcomp.registry"]  # the edge the check is about
    assert _circles(graph) == []


def test_the_circle_check_sees_lazy_and_relative_imports():
    """The check above sees the circle issue 33 removed, written as it was: a lazy relative
    import of the registry inside a method of auto's scheme module."""
    lazy = "\n\ndef _lazy():\n    from ..registry import make_scheme  # noqa\n    return make_scheme\n"
    graph = _core_imports({"hvd_gradcomp.auto.scheme": lazy})
    assert "hvd_gradcomp.registry" in graph["hvd_gradcomp.auto.scheme"]
    assert ["hvd_gradcomp.auto", "hvd_gradcomp.auto.scheme", "hvd_gradcomp.registry"] in _circles(graph)
    package = _core_imports({"hvd_gradcomp.auto": "\nfrom .. import registry\n"})
    assert _circles(package) == [["hvd_gradcomp.auto", "hvd_gradcomp.registry"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_runs_windows_on_a_vector_without_the_refusing_candidate(backend):
    """auto's windows on a vector measure fp16 and topkc only, and decide among them."""
    import numpy as np
    from tests.backends import backend_tensor, one_rank_ops, scheme_steps
    ops = one_rank_ops(backend)
    auto = make_scheme("auto", candidates="fp16|powersgd:4|topkc:0.5", bandwidth_gbit=0.001, warmup=2,
                       every=2, step_penalty=0.0).bind(ops)
    grads = [backend_tensor(backend, np.random.default_rng(t).standard_normal(4096)) for t in range(6)]
    log = scheme_steps(ops, auto, grads, TensorInfo("v", (4096,), "float32", 1, 0, "sum"))
    assert all(np.isfinite(np.asarray(ops.to_host(step["out"]))).all() for step in log)
    assert auto.history and all(d.spec != "powersgd:4" for d in auto.history)
    assert all(d.predicted_ms[1] == float("inf") for d in auto.history)
