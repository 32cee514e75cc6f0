"""The chat's SymPy tool: evaluate, simplify, solve or integrate an expression a model wrote.

A model's text is untrusted, and SymPy's own parser (`sympify`, `parse_expr`) runs `eval` on it.
Here the text is parsed by Python's `ast` and only arithmetic, named symbols and a list of maths
functions are turned into SymPy objects; anything else is refused with a message naming it. The
work runs in a separate process with a time limit (`SympyWorker`), since some inputs keep SymPy
busy for minutes (or take gigabytes: the process has a memory ceiling); a process that overruns is
killed and the next call starts a fresh one."""
from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import itertools
import json
import os
import re
import resource
import select
import subprocess
import sys
import threading

OPERATIONS = ("evaluate", "simplify", "solve", "integrate")
MAX_LENGTH = 500
MAX_NODES = 200
MAX_EXPONENT = 10_000
MAX_RESULT_CHARS = 4000
MAX_DIGITS = 100_000  # of an integer shown (Python's default stops at 4,300)
MEMORY_LIMIT = 2 << 30  # bytes of address space the worker may map
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,15}$")


class ToolInputError(ValueError):
    pass


def _functions():
    import sympy as sp
    return {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "asin": sp.asin, "acos": sp.acos, "atan": sp.atan,
            "sinh": sp.sinh, "cosh": sp.cosh, "tanh": sp.tanh, "exp": sp.exp, "log": sp.log, "ln": sp.log,
            "sqrt": sp.sqrt, "abs": sp.Abs, "Abs": sp.Abs, "factorial": sp.factorial, "floor": sp.floor,
            "ceiling": sp.ceiling, "gcd": sp.gcd, "lcm": sp.lcm, "binomial": sp.binomial, "Mod": sp.Mod}


def _constants():
    import sympy as sp
    return {"pi": sp.pi, "e": sp.E, "E": sp.E, "I": sp.I, "oo": sp.oo, "inf": sp.oo}


def parse(text: str):
    """A SymPy expression (or Eq, for 'a = b') from untrusted text."""
    import sympy as sp
    if not isinstance(text, str) or not text.strip():
        raise ToolInputError("expression: empty")
    if len(text) > MAX_LENGTH:
        raise ToolInputError(f"expression: longer than {MAX_LENGTH} characters")
    text = text.replace("^", "**").replace("\u2212", "-").replace("\u00d7", "*").replace("\u00f7", "/")
    sides = re.split(r"(?<![=<>!])=(?!=)", text.replace("==", "="))
    if len(sides) > 2:
        raise ToolInputError("expression: more than one '='")
    parsed = [_convert_text(side) for side in sides]
    return sp.Eq(*parsed) if len(parsed) == 2 else parsed[0]


def _convert_text(text: str):
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolInputError(f"expression: not a formula ({exc.msg})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolInputError(f"expression: more than {MAX_NODES} parts")
    return _convert(tree.body, _functions(), _constants())


def _convert(node, functions, constants):
    import sympy as sp
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sp.Integer(node.value) if isinstance(node.value, int) else sp.Rational(repr(node.value))
    if isinstance(node, ast.Name):
        if node.id in constants:
            return constants[node.id]
        if not NAME.match(node.id) or node.id in functions:
            raise ToolInputError(f"expression: {node.id!r} is not a variable name")
        return sp.Symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _convert(node.operand, functions, constants)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _convert(node.left, functions, constants), _convert(node.right, functions, constants)
        return _binary(node.op, left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        if node.keywords or len(node.args) > 3:
            raise ToolInputError(f"expression: {node.func.id}() takes at most 3 plain arguments")
        return functions[node.func.id](*(_convert(a, functions, constants) for a in node.args))
    what = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else type(node).__name__
    raise ToolInputError(f"expression: {what!r} is not allowed (only numbers, variables, + - * / ** % and "
                         f"{', '.join(sorted(functions))})")


def _binary(op, left, right):
    import sympy as sp
    if isinstance(op, (ast.Pow, ast.BitXor)):
        if right.is_number and right.is_real and abs(right) > MAX_EXPONENT:
            raise ToolInputError(f"expression: exponent {right} is larger than {MAX_EXPONENT}")
        return sp.Pow(left, right)
    operations = {ast.Add: sp.Add, ast.Sub: lambda a, b: sp.Add(a, -b), ast.Mult: sp.Mul,
                  ast.Div: lambda a, b: sp.Mul(a, sp.Pow(b, -1)), ast.Mod: sp.Mod}
    if type(op) not in operations:
        raise ToolInputError(f"expression: the operator {type(op).__name__} is not allowed")
    return operations[type(op)](left, right)


def run(operation: str, expression: str, variable: str | None = None) -> str:
    """The operation's result as text (in this process: `SympyWorker` calls it in its own)."""
    import sympy as sp
    if operation not in OPERATIONS:
        raise ToolInputError(f"operation: one of {', '.join(OPERATIONS)}, got {operation!r}")
    parsed = parse(expression)
    if variable is not None and not NAME.match(str(variable)):
        raise ToolInputError(f"variable: {variable!r} is not a variable name")
    if operation in ("solve", "integrate"):
        symbols = sorted(parsed.free_symbols, key=str)
        target = sp.Symbol(variable) if variable else (symbols[0] if symbols else None)
        if target is None:
            raise ToolInputError(f"{operation}: the expression has no variable")
        if operation == "solve":
            return str(sp.solve(parsed, target))
        if isinstance(parsed, sp.Eq):
            raise ToolInputError("integrate: takes an expression, not an equation")
        return str(sp.integrate(parsed, target))
    if isinstance(parsed, sp.Eq):
        raise ToolInputError(f"{operation}: takes an expression, not an equation (use solve)")
    if operation == "simplify":
        return str(sp.simplify(parsed))
    value = sp.simplify(parsed)
    if value.is_number and not value.is_Integer and not value.is_Rational:
        return f"{value} = {sp.N(value, 15)}"
    return str(value)


def serve() -> None:
    """The worker process (`python -m treeserve.gateway.chat.sympy_tool`): JSON lines in, one call
    each ([id, operation, expression, variable]), answered on the original stdout as {"id", "ok",
    "text"}; anything else that writes to stdout goes to stderr. The first line says it is ready."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    with contextlib.suppress(ValueError, OSError):  # a memory ceiling: a huge result fails here, not the host
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    sys.set_int_max_str_digits(MAX_DIGITS)  # results are cut to MAX_RESULT_CHARS anyway
    importlib.import_module("sympy")  # before saying ready: the first call's time limit is the call's own
    _reply(out, None, True, "ready")
    for line in sys.stdin:
        call_id = None
        try:
            call_id, operation, expression, variable = json.loads(line)
            _reply(out, call_id, True, run(str(operation), expression, variable))
        except (ToolInputError, ValueError, TypeError) as exc:
            _reply(out, call_id, False, str(exc))
        except MemoryError:
            _reply(out, call_id, False, "the result needs more memory than the tool may use")
        except Exception as exc:  # SymPy's own refusals (NotImplementedError, ...)
            _reply(out, call_id, False, f"failed: {type(exc).__name__}: {exc}")


def _reply(out, call_id, ok: bool, text: str) -> None:
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"... ({len(text) - MAX_RESULT_CHARS} more characters)"
    out.write(json.dumps({"id": call_id, "ok": ok, "text": text}) + "\n")


class SympyWorker:
    """A process that runs SymPy calls one at a time, killed and replaced when one overruns (or
    answers out of turn). Calls queue on a thread lock, so a caller that is cancelled while its call
    runs cannot let the next one in early."""

    def __init__(self, timeout: float = 10.0, start_timeout: float = 120.0):
        self.timeout, self.start_timeout = timeout, start_timeout
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.ids = itertools.count()

    async def call(self, operation: str, expression: str, variable: str | None = None) -> tuple[bool, str]:
        """(True, result) or (False, the reason it failed)."""
        return await asyncio.to_thread(self._call, operation, expression, variable)

    def _call(self, operation, expression, variable) -> tuple[bool, str]:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            call_id = next(self.ids)
            try:
                self.process.stdin.write(json.dumps([call_id, operation, expression, variable]) + "\n")
                self.process.stdin.flush()
            except OSError:
                self._close()
                return False, "the SymPy worker process had died; try again"
            reply = self._read(self.timeout)
            if reply is None or reply.get("id") != call_id:
                self._close()
                return False, f"{operation} took longer than {self.timeout:g} s and was stopped" if reply is None \
                    else "the SymPy worker answered out of turn and was restarted; try again"
            return bool(reply.get("ok")), str(reply.get("text"))

    def _start(self) -> None:
        self._close()
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._read(self.start_timeout) is None:
            self._close()
            raise RuntimeError("the SymPy worker process did not start")

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        try:
            reply = json.loads(line) if line else None
        except ValueError:
            return None
        return reply if isinstance(reply, dict) else None

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.kill()
            process.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            for stream in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):
                    stream.close()


if __name__ == "__main__":
    serve()
