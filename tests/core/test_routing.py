"""Routing (hvd_gradcomp/routing.py) and its spec grammar (hvd_gradcomp/routing_spec.py): decisions,
canonical specs, errors; no Horovod launch (the multi-rank checks are in
tests/parallel/test_routing.py, both frameworks)."""
import pytest

from hvd_gradcomp.adapter import group_dtype
from hvd_gradcomp.base import StepBytes
from hvd_gradcomp.registry import make_scheme
from hvd_gradcomp.routing import Routing, Selector, canonical_text, format_selector, parse_routing, parse_selector
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


def test_group_dtype():
    assert group_dtype(["int32", "int32"]) is None
    assert group_dtype(["float16", "float32"]) == "float32"
    assert group_dtype(["float16", "int32"]) == "float64"
    assert group_dtype(["float32", "float64"]) == "float64"
    with pytest.raises(ValueError, match="no payload dtype holds payloads of dtypes"):
        group_dtype(["int64", "float16"])


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
        "residual_decay=1.0,ef21_momentum=1.0,min_numel=5')")
    with pytest.raises(ValueError, match="^thc: min_numel must be an integer >= 1, got 0$"):
        Compression.thc(min_numel=0)
    assert "rules" in dir(Compression)
