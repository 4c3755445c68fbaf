"""The eviction benchmarks that run without an answer trace build every policy they list. Since Belady joined
``evict_ruler.POLICIES`` (a factory of the answer trace), ``evict_multiturn.py`` and ``evict_needle_kept.py`` called
those factories with no argument and crashed after loading the model."""

from benchmark_scripts import load_benchmark

from kvcert.evict import EvictionPolicy

ruler = load_benchmark("evict_ruler")  # registered first: the other two import it by name


def test_every_policy_without_an_answer_trace_builds_with_no_argument():
    free = ruler.answer_free()
    assert set(free) == {name for name in ruler.POLICIES if not name.startswith("belady")}
    assert all(isinstance(make(), EvictionPolicy) for make in free.values())


def test_the_multiturn_and_needle_scripts_build_every_policy_they_run():
    multiturn = load_benchmark("evict_multiturn")
    assert all(isinstance(make(), EvictionPolicy) for make in multiturn.POLICIES.values())
    assert any(name.startswith("rmm") for name in multiturn.POLICIES)  # its own RMM, on the emitted tokens
    needle = load_benchmark("evict_needle_kept")
    assert needle.answer_free is ruler.answer_free  # the policies it iterates
