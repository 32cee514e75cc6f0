"""Tools mode on the bundled models, as `treeserve chat` runs it: the bundled tool router
(`builtin:arith-router`, served with the hermes tool-call parser, its call forced by the grammar of
`tool_choice: required`) sends 20 arithmetic and algebra questions to SymPy with the expression
copied exactly, and each comes back with the right result; the task's own problems and small talk
are answered directly (by the chat model)."""
from __future__ import annotations

import pytest

from chat_support import add_user, arith_backend, chat_stack
from test_chat_api import new_conversation, send, sign_in
from treeserve.cli_chat import EXAMPLES

# (question, operation, the expression as asked, SymPy's result): chosen by hand, none from training
QUESTIONS = [
    ("What is 17 * 23 + 5?", "evaluate", "17 * 23 + 5", "396"),
    ("Compute 2 ** 10 - 1.", "evaluate", "2 ** 10 - 1", "1023"),
    ("what is 144 / 12?", "evaluate", "144 / 12", "12"),
    ("Calculate (15 + 27) * 3", "evaluate", "(15 + 27) * 3", "126"),
    ("How much is 999 - 456?", "evaluate", "999 - 456", "543"),
    ("Evaluate 7 ** 3.", "evaluate", "7 ** 3", "343"),
    ("What is 81 * 47 - 1024?", "evaluate", "81 * 47 - 1024", "2783"),
    ("what's 36*25+17", "evaluate", "36*25+17", "917"),
    ("what is 123 + 456 + 789?", "evaluate", "123 + 456 + 789", "1368"),
    ("Calculate 64 / 8 + 3", "evaluate", "64 / 8 + 3", "11"),
    ("Evaluate 12 * 12 - 44.", "evaluate", "12 * 12 - 44", "100"),
    ("Solve 3*x + 4 = 19", "solve", "3*x + 4 = 19", "[5]"),
    ("solve x**2 - 5*x + 6 = 0", "solve", "x**2 - 5*x + 6 = 0", "[2, 3]"),
    ("Solve 2*y - 7 = 11 for y.", "solve", "2*y - 7 = 11", "[9]"),
    ("Find z if 4*z + 2 = 30.", "solve", "4*z + 2 = 30", "[7]"),
    ("Solve 5*n - 3 = 2*n + 9", "solve", "5*n - 3 = 2*n + 9", "[4]"),
    ("Simplify (x**2 - 9)/(x - 3)", "simplify", "(x**2 - 9)/(x - 3)", "x + 3"),
    ("simplify sin(a)**2 + cos(a)**2.", "simplify", "sin(a)**2 + cos(a)**2", "1"),
    ("Integrate 3*x**2", "integrate", "3*x**2", "x**3"),
    ("What is the integral of cos(t)?", "integrate", "cos(t)", "sin(t)"),
]
DIRECT = ["Start with 5 and work modulo 100. Step 1: * 9. Step 2: - 3. What is the result?", "Hello!"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    database = f"sqlite:///{tmp_path_factory.mktemp('router') / 'gateway.db'}"
    with arith_backend() as (backend_url, _), chat_stack(database, backend_url, router="arith-router") as stack:
        url, gateway = stack[0], stack[1]
        add_user(gateway, "ada", "correct horse battery")
        yield sign_in(url, "ada", "correct horse battery")


def test_twenty_questions_go_to_sympy_and_come_back_right(client):
    conversation = new_conversation(client, mode="tools", model="arith-gen", max_tokens=64)
    wrong = []
    for question, operation, expression, result in QUESTIONS:
        events = send(client, conversation["id"], question)
        assert next(e for e in events if e["type"] == "routing")["router"] == "arith-router"
        tool = next((e for e in events if e["type"] == "tool"), None)
        if tool is None or tool["name"] != "sympy" or not tool["ok"] or tool["result"] != result \
                or tool["input"].get("expression") != expression or tool["input"].get("operation") != operation:
            wrong.append((question, tool))
    assert not wrong, f"{len(wrong)} of {len(QUESTIONS)} not answered through SymPy rightly: {wrong}"


def test_the_tasks_own_problems_and_small_talk_are_answered_directly(client):
    conversation = new_conversation(client, mode="tools", model="arith-gen", max_tokens=64)
    for question in DIRECT:
        events = send(client, conversation["id"], question)
        assert next(e for e in events if e["type"] == "routed")["tool"] == "answer_directly", question
        assert events[-1]["message"]["content"]


def test_the_tools_example_is_one_of_them():
    example = next(e["text"] for e in EXAMPLES if e["mode"] == "tools")
    assert example in [q for q, *_ in QUESTIONS]


def test_powers_written_with_a_caret_and_the_routers_tokens_are_kept(client):
    """The bundled router saw powers only as `**` (x^2 went to SymPy as x); the chat writes `^` as
    `**` for it. Its tokens are stored with the answer, as billed (its stream is dropped early)."""
    conversation = new_conversation(client, mode="tools", model="arith-gen", max_tokens=64)
    events = send(client, conversation["id"], "solve x^2 - 4 = 0")
    tool = next(e for e in events if e["type"] == "tool")
    assert tool["name"] == "sympy" and tool["result"] == "[-2, 2]", tool
    stored = events[-1]["message"]
    assert stored["prompt_tokens"] > 0 and stored["completion_tokens"] > 0, stored


def test_only_the_bundled_router_has_its_powers_rewritten():
    from treeserve.gateway.chat.modes import router_text

    assert router_text("solve x^2 = 4", "arith-router") == "solve x**2 = 4"
    assert router_text("the matrix A^T and ^_^", "my-router") == "the matrix A^T and ^_^"  # (another reads ^ itself)


def test_the_router_sees_the_conversation_unless_configured_not_to_whatever_its_name():
    """Whether the router is shown the conversation was a rule on its name (arith-router alone): the
    bundled router served under another name was shown the history it copies arguments from, and no
    router could be served as arith-router and shown it. It is `chat.router_history` now (`treeserve
    chat` sets it false for the bundled router)."""
    from treeserve.gateway.chat.modes import Context, router_messages
    from treeserve.gateway.chat.settings import ChatSettings
    from treeserve.gateway.config import ChatConfig
    from treeserve.errors import ParamError

    history = [{"role": "user", "content": "what is 2^3?", "details": {}},
               {"role": "assistant", "content": "8", "details": {}}]
    for name in ("arith-router", "my-router"):
        for shown in (True, False):
            context = Context(None, None, ChatSettings(model="arith-gen", mode="tools"), history, "and 3^2?",
                              router_history=shown)
            sent = [m["content"] for m in router_messages(context, name, context.router_history)][1:]
            power = "**" if name == "arith-router" else "^"
            assert sent == ([f"what is 2{power}3?", "8"] if shown else []) + [f"and 3{power}2?"], (name, shown)
    assert ChatConfig().router_history is True
    with pytest.raises(ParamError, match="router_history"):
        ChatConfig(router_history="no").check({})
