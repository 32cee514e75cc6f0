"""The tool router's task (bundled as `builtin:arith-router`, tools mode's router under `treeserve
chat`; trained by scripts/train_arith.py's `router` stage): given tools mode's tools in a Hermes-style prompt and the user's message, write one call in
Hermes' format: `sympy` with the user's expression or equation copied exactly (evaluate, solve,
simplify, integrate), `weather`/`wikipedia` with the place or subject where those tools are offered,
and `answer_directly` for the arithmetic task's own problems and for anything else.

The calls are written as the server's grammar for a required tool choice forces them (compact JSON,
the schema's key order), so the grammar never has to fight the model.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from treeserve.tasks.arithmetic import GRID_MAX_OPERATIONS, GRID_OPERATORS, random_grid_problem

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
# Hermes' layout (system turn with the tools as JSON lines inside <tools>, calls as JSON inside
# <tool_call> tags), in treeserve's own words; an assistant turn's calls are rendered the same way
# (arguments given as an object, as the server passes them, in the compact JSON the model writes).
CHAT_TEMPLATE = (
    "{{ bos_token }}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{% if tools %}\n\n# Tools\n\nCall one of these functions: write <tool_call>, a new line, "
    "{\"name\": ..., \"arguments\": {...}}, a new line and </tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{% endif %}<|im_end|>\n"
    "{% for message in messages %}{% if message['role'] != 'system' %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    "{% set arguments = call['function']['arguments'] %}"
    "{\"name\":{{ call['function']['name'] | tojson }},\"arguments\":"
    "{{ arguments if arguments is string else arguments | tojson(separators=(',', ':')) }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The router tokenizer's words, so that an expression is the same tokens in the message and in the
# call: a digit alone, an operator with the spaces around it (`17 * 23 + 5` has no bare space
# tokens, which made copies drift from one space to the next), a parenthesis alone, a word, a run of
# other punctuation, a run of spaces.
PIECES = r"[0-9]| ?(?:\*\*|[-+*/=^]) ?|[()]|[A-Za-z_]+|[^\sA-Za-z0-9()*+/=^-]+|\s+"
VARIABLES = "xyzatn"
EVALUATE = ["What is {e}?", "what is {e}?", "What's {e}?", "what's {e}", "Compute {e}.", "compute {e}",
            "Calculate {e}", "calculate {e}?", "Evaluate {e}.", "evaluate {e}", "How much is {e}?", "{e} = ?", "{e}",
            "Please work out {e}.", "what does {e} equal?"]
SOLVE = ["Solve {q}", "solve {q}", "Solve {q}.", "Find {v} if {q}.", "What is {v} when {q}?", "solve {q} please",
         "Solve the equation {q}"]
SOLVE_FOR = ["Solve {q} for {v}.", "solve {q} for {v}", "Find {v} such that {q}"]
SIMPLIFY = ["Simplify {e}", "simplify {e}.", "Can you simplify {e}?", "Simplify the expression {e}"]
INTEGRATE = ["Integrate {e}", "integrate {e}", "What is the integral of {e}?", "Find the integral of {e}."]
INTEGRATE_FOR = ["Integrate {e} with respect to {v}", "integrate {e} d{v}"]
WEATHER = ["What's the weather in {p}?", "weather in {p}", "Is it raining in {p}?", "How warm is it in {p} today?"]
WIKIPEDIA = ["Tell me about {s}.", "Who was {s}?", "What is {s}?", "Look up {s} on Wikipedia", "Summarize the "
             "article on {s}"]
PLACES = ["Paris", "Tokyo", "New York", "Lagos", "Lima", "Berlin", "Sydney", "Cairo", "Oslo", "Mumbai", "Quito"]
SUBJECTS = ["Alan Turing", "the Moon", "photosynthesis", "Ada Lovelace", "the Roman Empire", "jazz", "volcanoes",
            "Marie Curie", "the printing press", "black holes"]
CHAT = ["Hello!", "hi", "Who are you?", "Tell me a joke.", "What can you do?", "Thanks!", "Good morning",
        "How are you?", "What is your name?", "Write a short poem about the sea.", "What is the capital of France?",
        "Why is the sky blue?", "Can you help me?", "What is a prime number?"]


@dataclass(frozen=True)
class RouterExample:
    question: str
    name: str
    arguments: dict

    @property
    def target(self) -> str:
        """The call as the server's grammar writes it (compact JSON, keys in the schema's order)."""
        return f"{OPEN}\n{json.dumps({'name': self.name, 'arguments': self.arguments}, separators=(',', ':'))}\n{CLOSE}"


def _number(rng: random.Random) -> str:
    return str(rng.choice([rng.randint(1, 9), rng.randint(10, 99), rng.randint(100, 999), rng.randint(1, 9999)]))


def _spaced(rng: random.Random, op: str, tight: bool) -> str:
    return op if tight else f" {op} "


def arithmetic_expression(rng: random.Random, depth: int = 0, tight: bool | None = None) -> str:
    """Integers with + - * / ** and parentheses, spaced around operators or not (as users write)."""
    tight = rng.random() < 0.3 if tight is None else tight
    if depth >= 2 or rng.random() < 0.35 * (depth + 1):
        return _number(rng)
    op = rng.choice(["+", "-", "*", "*", "/", "**"])
    left = arithmetic_expression(rng, depth + 1, tight)
    right = str(rng.randint(2, 12)) if op == "**" else arithmetic_expression(rng, depth + 1, tight)
    if op in "*/" and rng.random() < 0.4:
        left = f"({left})" if not left.isdigit() else left
    return f"{left}{_spaced(rng, op, tight)}{right}"


def _term(rng: random.Random, v: str) -> str:
    coefficient = rng.randint(1, 12)
    power = rng.choice(["", "", f"**{rng.randint(2, 3)}"])
    return f"{v}{power}" if coefficient == 1 else f"{coefficient}*{v}{power}"


def polynomial(rng: random.Random, v: str, terms: int | None = None) -> str:
    parts = [_term(rng, v) for _ in range(terms or rng.randint(1, 3))]
    if rng.random() < 0.7:
        parts.append(str(rng.randint(1, 30)))
    text = parts[0]
    for part in parts[1:]:
        text += rng.choice([" + ", " - "]) + part
    return text


def equation(rng: random.Random, v: str) -> str:
    left = polynomial(rng, v, rng.randint(1, 2))
    right = str(rng.randint(0, 50)) if rng.random() < 0.7 else polynomial(rng, v, 1)
    return f"{left} = {right}"


def symbolic_expression(rng: random.Random, v: str) -> str:
    return rng.choice([
        polynomial(rng, v), f"({v}**2 - {rng.randint(1, 9) ** 2})/({v} - {rng.randint(1, 9)})",
        f"sin({v})**2 + cos({v})**2", f"{rng.choice(['sin', 'cos', 'exp', 'log', 'sqrt'])}({_term(rng, v)})",
        f"{_term(rng, v)}*{rng.choice(['sin', 'cos', 'exp'])}({v})", f"({v} + {rng.randint(1, 9)})**{rng.randint(2, 4)}",
        f"1/({v} + {rng.randint(1, 9)})"])


def router_example(rng: random.Random, tools: tuple[str, ...]) -> RouterExample:
    """One message and its call, given the names of the HTTP tools offered (weather, wikipedia)."""
    kind = rng.choices(["evaluate", "solve", "simplify", "integrate", "task", "chat", "weather", "wikipedia"],
                       weights=[6, 3, 2, 2, 3, 2, 1, 1])[0]
    v = rng.choice(VARIABLES)
    if kind == "evaluate":
        e = arithmetic_expression(rng)
        return RouterExample(rng.choice(EVALUATE).format(e=e), "sympy", {"operation": "evaluate", "expression": e})
    if kind == "solve":
        q = equation(rng, v)
        if rng.random() < 0.3:
            return RouterExample(rng.choice(SOLVE_FOR).format(q=q, v=v), "sympy",
                                 {"operation": "solve", "expression": q, "variable": v})
        return RouterExample(rng.choice(SOLVE).format(q=q, v=v), "sympy", {"operation": "solve", "expression": q})
    if kind in ("simplify", "integrate"):
        e = symbolic_expression(rng, v)
        if kind == "integrate" and rng.random() < 0.3:
            return RouterExample(rng.choice(INTEGRATE_FOR).format(e=e, v=v), "sympy",
                                 {"operation": "integrate", "expression": e, "variable": v})
        templates = SIMPLIFY if kind == "simplify" else INTEGRATE
        return RouterExample(rng.choice(templates).format(e=e), "sympy", {"operation": kind, "expression": e})
    if kind == "weather" and "weather" in tools:
        p = rng.choice(PLACES)
        return RouterExample(rng.choice(WEATHER).format(p=p), "weather", {"location": p})
    if kind == "wikipedia" and "wikipedia" in tools:
        s = rng.choice(SUBJECTS)
        return RouterExample(rng.choice(WIKIPEDIA).format(s=s), "wikipedia", {"query": s})
    if kind == "task":
        problem = random_grid_problem(rng, rng.randint(1, GRID_MAX_OPERATIONS), rng.choice(GRID_OPERATORS))
        return RouterExample(problem.text, "answer_directly", {})
    if kind == "weather":  # offered no weather tool: nothing to call
        return RouterExample(rng.choice(WEATHER).format(p=rng.choice(PLACES)), "answer_directly", {})
    if kind == "wikipedia":
        return RouterExample(rng.choice(WIKIPEDIA).format(s=rng.choice(SUBJECTS)), "answer_directly", {})
    return RouterExample(rng.choice(CHAT), "answer_directly", {})


def tool_names(rng: random.Random) -> tuple[str, ...]:
    """Which HTTP tools a gateway offers (none in `treeserve chat`'s default)."""
    return tuple(name for name in ("weather", "wikipedia") if rng.random() < 0.2)
