"""What vLLM's own tests/ir/test_op.py pins about registration and dispatch, run against this
package (names adapted: `register_op`, `scratch_registry` for its `fake_vllm_ir`): the exception
types and the words its tests match, `_registration_stack`, and the two warnings. Where this
package refuses more than vLLM (a priority naming an unsupported provider), notebooks/README.md's
differences table says why, and tests/ir/test_ir_ops.py pins it."""

from __future__ import annotations

import logging

import pytest
import torch

from minivllm_compile.ir import RESERVED_PROVIDERS, IrOp, IrOpImpl, register_op

LOGGER = "minivllm_compile.ir.op"


@pytest.fixture
def custom_add_op(scratch_registry):
    @register_op(allow_inplace=True)
    def _custom_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    @_custom_add.register_impl("impl_a")
    def impl_a(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y + 10

    @_custom_add.register_impl("impl_even", supports_args=lambda x, y: x.size(1) % 2 == 0)
    def impl_even(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y + 50

    return _custom_add


@pytest.fixture
def custom_mm_op(scratch_registry):
    @register_op
    def _custom_mm(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
        tmp = x @ y
        return tmp if bias is None else tmp + bias

    return _custom_mm


def _mm(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x @ y


def test_a_duplicate_op_is_an_assertion_naming_both_places(scratch_registry):
    @register_op(name="_custom_mul")
    def first(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y

    first_line = first._registration_stack[-1]
    with pytest.raises(AssertionError, match="Op '_custom_mul' is already registered") as e:
        @register_op
        def _custom_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * y - 100

    # the place of each registration: this file, each decorator's own line
    lines = [ln for ln in str(e.value).split(";")]
    assert "test_op.py" in lines[0] and '@register_op(name="_custom_mul")' in lines[0]
    assert first_line.split(",")[1] in lines[0]  # ' line N' of the first registration
    assert "test_op.py" in lines[1] and "@register_op" in lines[1]
    assert IrOp.registry["_custom_mul"] is first
    # constructed directly, an op is not registered (vLLM's test_registration_overloads)
    assert IrOp("_custom_div", _mm).name == "_custom_div" and "_custom_div" not in IrOp.registry


def test_a_duplicate_provider_is_an_assertion_naming_both_places(custom_add_op):
    impl = custom_add_op.impls["impl_a"]
    with pytest.raises(AssertionError,
                       match="Implementation for provider impl_a already registered") as e:
        @custom_add_op.register_impl("impl_a")
        def impl_a_dup(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + y + 30

    message = str(e.value)
    assert message.count("test_op.py") == 2, message
    assert '@_custom_add.register_impl("impl_a")' in message  # the fixture's line
    assert '@custom_add_op.register_impl("impl_a")' in message  # this one
    assert custom_add_op.impls["impl_a"] is impl  # the first stays
    assert impl.supports_all_args and not custom_add_op.impls["impl_even"].supports_all_args


def test_a_reserved_provider_name_is_an_assertion(custom_add_op):
    for provider in RESERVED_PROVIDERS:
        with pytest.raises(AssertionError, match=f"Provider name {provider} is reserved"):
            @custom_add_op.register_impl(provider)
            def bad_impl(x, y):
                return x + y


def test_keyword_only_arguments_are_refused(scratch_registry):
    with pytest.raises(ValueError, match="keyword-only arguments"):
        @register_op
        def _custom_kwarg_op(x: torch.Tensor, y: torch.Tensor, *, kwarg: int = 0
                             ) -> torch.Tensor:
            return x + y + kwarg

    assert "_custom_kwarg_op" not in IrOp.registry


def test_bad_impl_registrations_with_vllms_words(custom_mm_op):
    def bad_schema(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def bad_schema_2(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None = None
                     ) -> torch.Tensor: ...

    def bad_schema_3(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...

    for fn in (bad_schema, bad_schema_2, bad_schema_3):
        with pytest.raises(ValueError, match="does not match native schema"):
            custom_mm_op.register_impl("impl_mm_bad_schema")(fn)
    for supports_args, words in (
            (True, "supports_args for provider impl_mm must be a callable"),
            (lambda x, y: True, "number of parameters"),
            (lambda x, y, *, b: True, "keyword-only parameters"),
            (lambda x, y, b: True, "does not match native parameter"),
            (lambda x, y, bias=1: True, "does not match native default")):
        with pytest.raises(ValueError, match=words):
            custom_mm_op.register_impl("impl_mm", supports_args=supports_args)(_mm)
    assert set(custom_mm_op.impls) == {"native"}


def test_names_are_validated(scratch_registry):
    @register_op
    def _valid_name_123(x: torch.Tensor) -> torch.Tensor:
        return x

    @_valid_name_123.register_impl("valid_provider_123")
    def valid_impl(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    for bad in ("InvalidName", "123invalid"):
        with pytest.raises(ValueError, match="name.*invalid"):
            register_op(name=bad)(lambda x: x)
    with pytest.raises(ValueError, match="name.*invalid"):
        _valid_name_123.register_impl("Invalid-Provider")


def test_registration_stacks_end_at_the_users_decorator(scratch_registry):
    """vLLM 0.34's test_registration_stack_traces, and the decorator's call form too (vLLM's slice
    of the stack drops that line)."""
    @register_op
    def _test_stack(x: torch.Tensor) -> torch.Tensor:
        return x

    @register_op()
    def _test_stack_called(x: torch.Tensor) -> torch.Tensor:
        return x

    @_test_stack.register_impl("test_provider")
    def test_impl(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    for op, line in ((_test_stack, "@register_op\n"), (_test_stack_called, "@register_op()\n")):
        stack = op._registration_stack
        assert "test_op.py" in "".join(stack) and stack[-1].endswith(line), stack[-1]
        assert "return decorator(f)" not in "".join(stack)
        assert op.impls["native"]._registration_stack is stack
    impl = _test_stack.impls["test_provider"]
    assert isinstance(impl, IrOpImpl)
    assert '@_test_stack.register_impl("test_provider")' in impl._registration_stack[-1]
    assert "test_op.py" in "".join(impl._registration_stack)


def test_the_native_fallback_warning_is_vllms_and_logged_once(custom_add_op, caplog):
    x1, y1 = torch.ones((2, 2), dtype=torch.int32), torch.full((2, 2), 2, dtype=torch.int32)
    x2, y2 = torch.ones((2, 3), dtype=torch.int32), torch.full((2, 3), 2, dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger=LOGGER), \
            custom_add_op.set_priority(["impl_even"]):
        # logged when the priority is set, before any dispatch
        assert len(caplog.records) == 1
        message = caplog.records[0].getMessage()
        assert "_custom_add" in message and "fallback to native" in message
        assert "priority" in message
        assert custom_add_op.get_priority() == ["impl_even", "native"]
        assert custom_add_op.dispatch(x1, y1) is custom_add_op.impls["impl_even"]
        assert custom_add_op.dispatch(x2, y2) is custom_add_op.impls["native"]
        out1, out2 = custom_add_op(x1, y1), custom_add_op(x2, y2)
    assert len(caplog.records) == 1
    assert torch.all(out1 == 1 + 2 + 50) and torch.all(out2 == 1 + 2)


def test_no_priority_means_native_with_vllms_warning(custom_add_op, caplog):
    x, y = torch.tensor([3], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    assert custom_add_op.get_priority() == []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert custom_add_op.dispatch(x, y) is custom_add_op.impls["native"]
        assert custom_add_op(x, y).item() == 3 + 4
    message = caplog.records[0].getMessage()
    assert message == "Priority not set for op _custom_add, using native implementation."


def test_tolerances_and_input_generators_with_vllms_words():
    op = IrOp("_tol_test", _mm)
    assert op.get_tolerance(torch.float32) == {"atol": 1e-5, "rtol": 1.3e-6}
    op.override_tolerance(torch.float32, atol=0.1, rtol=0.2)
    assert op.get_tolerance(torch.float32) == {"atol": 0.1, "rtol": 0.2}
    assert op.get_tolerance(torch.float16) == {"atol": 1e-3, "rtol": 1e-3}
    assert op.get_tolerance(torch.float4_e2m1fn_x2) == {"atol": 3e-1, "rtol": 3e-1}
    with pytest.raises(ValueError, match="No tolerance defined for dtype torch.complex64 in op "
                                         "'_tol_test'"):
        op.get_tolerance(torch.complex64)
    with pytest.raises(RuntimeError, match="No input generator"):
        op.generate_inputs()
