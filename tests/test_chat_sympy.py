"""Tools mode's SymPy tool: what it computes, what it refuses (the model's text is untrusted: no
`eval`, no attributes, no huge powers), and its worker process (a call past the time limit is
killed and the next one works; a caller cancelled mid-call does not let the next call in early;
long results are cut)."""
from __future__ import annotations

import asyncio

import pytest

from treeserve.gateway.chat.sympy_tool import MAX_RESULT_CHARS, SympyWorker, ToolInputError, run


@pytest.mark.parametrize("operation, expression, variable, expected", [
    ("solve", "x**2 - 5*x + 6 = 0", None, "[2, 3]"),
    ("solve", "2*y + 4", "y", "[-2]"),
    ("integrate", "x*sin(x)", "x", "-x*cos(x) + sin(x)"),
    ("simplify", "(x**2 - 1)/(x - 1)", None, "x + 1"),
    ("evaluate", "2^10 - 1", None, "1023"),
    ("evaluate", "sqrt(2)", None, "sqrt(2) = 1.41421356237310"),
    ("evaluate", "1/3 + 1/6", None, "1/2"),
    ("evaluate", "factorial(5) + gcd(12, 18)", None, "126"),
])
def test_it_computes(operation, expression, variable, expected):
    assert run(operation, expression, variable) == expected


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not allowed"),
    ("__import__('os')", "'__import__' is not allowed"),
    ("x.__class__", "'Attribute' is not allowed"),
    ("(lambda: 1)()", "not allowed"),
    ("[1, 2][0]", "not allowed"),
    ("9**9**9", "larger than 10000"),
    ("gcd(1, 2, 3, 4)", "at most 3 plain arguments"),
    ("sin(*x)", "not allowed"),
    ("a = b = c", "more than one '='"),
    ("x" * 600, "longer than 500"),
    ("", "empty"),
    ("2 +", "not a formula"),
])
def test_it_refuses_what_is_not_maths(expression, reason):
    with pytest.raises(ToolInputError, match=reason):
        run("evaluate", expression)


def test_the_worker_kills_an_overrun_and_recovers():
    async def main():
        worker = SympyWorker(timeout=2)
        try:
            ok, text = await worker.call("evaluate", "factorial(factorial(20))")
            assert not ok and "longer than 2 s" in text
            assert await worker.call("solve", "x - 4", None) == (True, "[4]")
            ok, text = await worker.call("evaluate", "factorial(5000)")
            assert ok and len(text) < MAX_RESULT_CHARS + 60 and text.endswith("more characters)")
            ok, text = await worker.call("oops", "1")
            assert not ok and "operation" in text
        finally:
            worker.close()
    asyncio.run(main())


def test_a_cancelled_call_does_not_let_the_next_one_in_early():
    async def main():
        worker = SympyWorker(timeout=3)
        try:
            await worker.call("evaluate", "1")  # started
            slow = asyncio.create_task(worker.call("evaluate", "factorial(factorial(20))"))
            await asyncio.sleep(0.3)
            slow.cancel()  # (the Stop button): its thread still owns the worker until it ends
            assert await worker.call("evaluate", "2 + 2") == (True, "4")
        finally:
            worker.close()
    asyncio.run(main())
