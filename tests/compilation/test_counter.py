"""counter.py: compilation_counter.since(before) reads what a block changed; expect() asserts it.
Nothing compiles here: the counters are moved by hand."""

import json

import pytest

from minivllm_compile import compilation_counter
from minivllm_compile.compilation.counter import CompilationCounter, CounterDelta


def test_since_lists_the_counters_that_moved_and_reads_zero_for_the_others():
    counter = CompilationCounter(num_graphs_seen=3)
    before = counter.clone()
    assert counter.since(before) == {} and counter.since(before)["num_graphs_seen"] == 0
    counter.num_graphs_seen += 1
    counter.num_inductor_compiles += 6
    moved = counter.since(before)
    assert moved == {"num_graphs_seen": 1, "num_inductor_compiles": 6}  # only what moved
    assert isinstance(moved, CounterDelta)
    assert json.loads(json.dumps(moved)) == moved  # a fresh process can send it back
    assert moved["num_aot_artifacts_loaded"] == 0  # a counter that did not move
    with pytest.raises(KeyError, match="no field 'num_inductor_compile'"):  # a typo is no zero
        moved["num_inductor_compile"]
    assert before.num_graphs_seen == 3  # the clone is untouched


def test_since_refuses_what_is_not_a_clone():
    with pytest.raises(TypeError, match=r"before = compilation_counter.clone\(\)"):
        compilation_counter.since(vars(compilation_counter))


def test_since_and_expect_read_the_same_change():
    before = compilation_counter.clone()
    with compilation_counter.expect(num_backend_compilations=2, num_graphs_seen=0):
        compilation_counter.num_backend_compilations += 2
    assert compilation_counter.since(before) == {"num_backend_compilations": 2}
    with pytest.raises(AssertionError, match="num_backend_compilations: 1 != 2"), \
            compilation_counter.expect(num_backend_compilations=2):
        compilation_counter.num_backend_compilations += 1
