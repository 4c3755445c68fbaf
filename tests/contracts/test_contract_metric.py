import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.contracts import NORM_RANGES, SITES, Metric

idents = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)


@settings(deadline=None)
@given(obj=idents, norm=st.sampled_from(sorted(NORM_RANGES)), site=st.sampled_from(sorted(SITES)))
def test_parse_format_roundtrip(obj, norm, site):
    m = Metric(obj=obj, norm=norm, site=site)
    assert str(m) == f"{obj}:{norm}@{site}"
    assert Metric.parse(str(m)) == m
    assert hash(Metric.parse(str(m))) == hash(m)


def test_example_from_the_spec():
    m = Metric.parse("kv_entry:l2@write")
    assert (m.obj, m.norm, m.site) == ("kv_entry", "l2", "write")
    assert m == Metric(obj="kv_entry", norm="l2", site="write")
    assert str(m) == "kv_entry:l2@write"
    assert Metric.coerce("kv_entry:l2@write") == m and Metric.coerce(m) is m


@pytest.mark.parametrize(
    "other", ["kv_cache:l2@write", "kv_entry:linf@write", "kv_entry:l2@consume", "kv_entry:rel_witness@write"]
)
def test_equality_needs_object_norm_and_site(other):
    assert Metric.parse("kv_entry:l2@write") != Metric.parse(other)


@pytest.mark.parametrize(
    "text",
    [
        "kv_entry:l2",
        "kv_entry@write",
        "kv_entry:l3@write",
        "kv_entry:l2@decode",
        "KV:l2@write",
        "",
        " kv:l2@write",
        "kv_entry:l2@write:x",
    ],
)
def test_malformed_text_is_rejected(text):
    with pytest.raises(ValueError, match="text|norm|site|obj"):
        Metric.parse(text)


def test_bad_parts_name_the_argument():
    with pytest.raises(ValueError, match="norm"):
        Metric("kv_entry", "l7", "write")
    with pytest.raises(ValueError, match="site"):
        Metric("kv_entry", "l2", "kernel")
    with pytest.raises(ValueError, match="obj"):
        Metric("Kv", "l2", "write")
    with pytest.raises(ValueError, match="text"):
        Metric.parse(3)  # type: ignore[arg-type]


def test_physical_ranges():
    assert Metric.parse("attn_dist:tv@consume").physical_range == (0.0, 1.0)
    lo, hi = Metric.parse("kv_entry:l2@write").physical_range
    assert lo == 0.0 and hi == float("inf")
    lo, hi = Metric.parse("gate:log@offline").physical_range
    assert lo == float("-inf") and hi == float("inf")
