"""Answer extraction, equivalence grading and answer aggregation for MATH-style problems.

`extract_answer` pulls the final answer out of a solution, `grade` decides whether two answers are
mathematically equal (a cheap normalised string check first, then `math-verify`), and the vote
helpers aggregate the answers of N sampled solutions.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from fractions import Fraction

logger = logging.getLogger(__name__)

# Seconds math-verify may spend on one parse or one comparison (its own SIGALRM timeout).
VERIFY_TIMEOUT_S = 3
# Seconds the parent waits for one symbolic verdict before killing the helper process.
HARD_DEADLINE_S = 15.0
# Answers longer than this skip the symbolic check: they are not short final answers.
MAX_SYMBOLIC_CHARS = 1000

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[ \t]*([^\s${}]+)")
_ANSWER_PHRASE = re.compile(r"(?:final answer|the answer)\s+is\s*:?[ \t]*", re.IGNORECASE)
_HOPE_TAIL = re.compile(r"\.?\s*I hope it is correct.*$", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The last boxed answer in `text`, else a "the (final) answer is X" phrase, else None."""
    if not text:
        return None
    answer = _last_boxed(text)
    if answer is None:
        answer = _answer_phrase(text)
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None


def _last_boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}`, `\\boxed x` or `\\fbox{...}`."""
    for match in reversed(list(_BOX_COMMAND.finditer(text))):
        content = _box_argument(text, match.end())
        if content is not None:
            return content
    return None


def _box_argument(text: str, pos: int) -> str | None:
    """The argument of a box command whose name ends at `pos`: a brace group or one bare token."""
    rest = text[pos:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _brace_group(text, pos + len(rest) - len(stripped))
    token = _BARE_TOKEN.match(rest)
    if token is None:
        return None
    return token.group(1).rstrip(".,;")


def _brace_group(text: str, open_pos: int) -> str | None:
    """Content of the balanced `{...}` opening at `open_pos` (escaped braces skipped), or None."""
    depth = 0
    i = open_pos
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


def _answer_phrase(text: str) -> str | None:
    """The X of the last "final answer is X" / "the answer is X" phrase."""
    matches = list(_ANSWER_PHRASE.finditer(text))
    if not matches:
        return None
    line = text[matches[-1].end() :].lstrip().split("\n", 1)[0]
    tail = _HOPE_TAIL.sub("", line.strip())
    answer = _dollar_span(tail)
    if answer is None:
        answer = re.split(r"\.\s", tail, maxsplit=1)[0]
    answer = answer.strip().strip("$").strip().rstrip(".").strip()
    return answer or None


def _dollar_span(text: str) -> str | None:
    """Content of a leading `$...$` / `$$...$$` span, or None when `text` does not open with one."""
    for fence in ("$$", "$"):
        if text.startswith(fence):
            end = text.find(fence, len(fence))
            if end > 0:
                return text[len(fence) : end]
    return None


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(
    r"^(?P<value>.*\d.*?)\s*\\(?:text|textrm|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]*\}"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?\s*$"
)
_SPACING = re.compile(r"(?<!\\)\\[,!;: ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|°")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?:\.|(?![A-Za-z]))")
_ASSIGNMENT = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?=(?!=)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_CHOICE = re.compile(r"^\(([A-Z])\)$")
_INTEGER = r"-?\d+"
_NUMBER = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
_LATEX_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH_FRACTION = re.compile(rf"^({_INTEGER})/({_INTEGER})$")


def _normalize(answer: str) -> str:
    """`_normalized_text`, with plain numbers written as reduced fractions `p/q`."""
    text = _normalized_text(answer)
    value = _as_fraction(text)
    return text if value is None else str(value)


@functools.lru_cache(maxsize=65536)
def _normalized_text(answer: str) -> str:
    """A whitespace- and presentation-insensitive string form of a LaTeX answer."""
    text = _strip_math_fences(answer.strip())
    text = _drop_presentation(text)
    text = _unwrap_text(text)
    text = re.sub(r"\s+", "", text)
    text = _expand_short_arguments(text)
    text = text.rstrip(".")
    text = _drop_assignment(text)
    text = text.replace("{,}", ",")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    choice = _CHOICE.match(text)
    return choice.group(1) if choice else text


def _strip_math_fences(text: str) -> str:
    """Remove one surrounding `$...$`, `\\(...\\)` or `\\[...\\]`."""
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(opener) and text.endswith(closer) and len(text) > len(opener + closer):
            return text[len(opener) : -len(closer)].strip()
    return text


def _drop_presentation(text: str) -> str:
    """Drop sizing, spacing, degree, percent and dollar marks; unify fraction commands."""
    text = _LEFT_RIGHT.sub("", text)
    text = text.replace("\\displaystyle", "")
    text = _SPACING.sub(" ", text)
    text = _DEGREES.sub("", text)
    text = text.replace("\\%", "").replace("%", "").replace("\\$", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    unit = _TRAILING_UNIT.match(text)
    if unit:
        text = unit.group("value")
    return text


def _unwrap_text(text: str) -> str:
    """Replace `\\text{x}` style wrappers (nested too) by their content."""
    while True:
        unwrapped = _TEXT_COMMAND.sub(r"\1", text)
        if unwrapped == text:
            return text
        text = unwrapped


def _expand_short_arguments(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}` (single-character arguments)."""
    text = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", text)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)


def _drop_assignment(text: str) -> str:
    """`x=5` -> `5` when the left side is a single (possibly subscripted) letter."""
    if text.count("=") == 1 and _ASSIGNMENT.match(text):
        return text.split("=", 1)[1]
    return text


def _as_fraction(text: str) -> Fraction | None:
    """The value of a normalised integer, decimal or integer fraction; None for anything else."""
    if _NUMBER.match(text):
        return Fraction(text)
    latex = _LATEX_FRACTION.match(text)
    slash = _SLASH_FRACTION.match(text)
    if latex:
        sign, num, den = latex.groups()
        numerator, denominator = (-1 if sign else 1) * int(num), int(den)
    elif slash:
        numerator, denominator = int(slash.group(1)), int(slash.group(2))
    else:
        return None
    if denominator == 0:
        return None
    return Fraction(numerator, denominator)


@functools.lru_cache(maxsize=65536)
def canonical_form(answer: str | None) -> str:
    """A deterministic key under which equal-looking answers group together ("" for None)."""
    if answer is None:
        return ""
    return _normalize(answer if isinstance(answer, str) else str(answer))


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------


def grade(predicted: str | None, reference: str) -> bool:
    """True when `predicted` is mathematically equivalent to `reference`. Never raises."""
    if predicted is None or reference is None:
        return False
    try:
        predicted, reference = str(predicted), str(reference)
        if canonical_form(predicted) == canonical_form(reference):
            return True
        exact_predicted, exact_reference = _exact_rational(predicted), _exact_rational(reference)
        if exact_predicted is not None and exact_reference is not None:
            return exact_predicted == exact_reference
        if max(len(predicted), len(reference)) > MAX_SYMBOLIC_CHARS:
            return False
        return _symbolic_equal(predicted, reference)
    except Exception:
        logger.debug("grading failed", exc_info=True)
        return False


def _exact_rational(answer: str) -> Fraction | None:
    """The value of an integer or integer-fraction answer (no decimal point, no percent)."""
    if "%" in answer:
        return None
    text = _normalized_text(answer)
    return None if "." in text else _as_fraction(text)


@functools.lru_cache(maxsize=65536)
def _symbolic_equal(predicted: str, reference: str) -> bool:
    """math-verify equivalence, computed in a helper process that a hard deadline can kill."""
    return _VERIFIER.check(predicted, reference)


def _verify(predicted: str, reference: str, timeout_s: int | None) -> bool:
    """math-verify's verdict on two bare answers (reference as gold)."""
    import math_verify

    gold = _parse(reference, timeout_s)
    target = _parse(predicted, timeout_s)
    if not gold or not target:
        return False
    return bool(math_verify.verify(list(gold), list(target), timeout_seconds=timeout_s))


@functools.lru_cache(maxsize=16384)
def _parse(answer: str, timeout_s: int | None) -> tuple:
    """math-verify's parse of a bare answer, boxed so its LaTeX extractor takes it whole."""
    import math_verify

    boxed = "\\boxed{" + _strip_math_fences(answer.strip()) + "}"
    configs = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    return tuple(math_verify.parse(boxed, extraction_config=configs, parsing_timeout=timeout_s))


# math-verify's own timeouts use SIGALRM: they only work on a main thread, and cannot interrupt a
# long C-level step (sympy expanding `10^{10^{10}}` holds the GIL for minutes). So the symbolic
# check runs in a child process, on its main thread, with those timeouts on, and the parent kills
# the child when a reply misses HARD_DEADLINE_S. This works the same from any thread.

_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('treeserve_grading_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._serve_verifier()\n"
)


def _serve_verifier() -> None:
    """Child process loop: one JSON `[predicted, reference]` per stdin line, `1`/`0` replies."""
    for line in sys.stdin:
        try:
            predicted, reference = json.loads(line)
            verdict = _verify(predicted, reference, VERIFY_TIMEOUT_S)
        except BaseException:  # noqa: BLE001 - any failure is a "not equal" verdict
            verdict = False
        sys.stdout.write("1\n" if verdict else "0\n")
        sys.stdout.flush()


class _VerifierProcess:
    """A lazily started math-verify child process, shared by all threads (calls serialise)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = 0
        atexit.register(self.close)

    def check(self, predicted: str, reference: str) -> bool:
        request = (json.dumps([predicted, reference]) + "\n").encode()
        with self._lock:
            proc = self._running()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = _read_line(proc.stdout.fileno(), time.monotonic() + HARD_DEADLINE_S)
            except OSError:
                reply = None
            if reply is None:  # overran the deadline or died: never reuse it
                self._kill()
                return False
            return reply.strip() == b"1"

    def close(self) -> None:
        """Stop the child process (it is restarted on the next check)."""
        with self._lock:
            self._kill()

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and (self._owner_pid != os.getpid() or self._proc.poll() is not None):
            self._proc = None  # forked parent's child, or dead
        if self._proc is None:
            if importlib.util.find_spec("math_verify") is None:
                logger.warning("math-verify is not installed: only normalised string matches grade True")
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-c", _WORKER_BOOT, os.path.abspath(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
            )
            self._owner_pid = os.getpid()
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None and self._owner_pid == os.getpid():
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One newline-terminated reply from `fd`, or None at EOF or once `deadline` passes."""
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        data += chunk
    return data


_VERIFIER = _VerifierProcess()


# ---------------------------------------------------------------------------------------------
# Metrics and aggregation
# ---------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    miss = math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    return 1.0 - miss


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer (grouped by `canonical_form`); first occurrence wins ties."""
    return weighted_vote(answers, [1.0] * len(answers))


def weighted_vote(answers: Sequence[str | None], scores: Sequence[float]) -> str | None:
    """The answer whose group has the largest summed score; first occurrence wins ties."""
    _check_lengths(answers, scores)
    totals: dict[str, float] = {}
    representative: dict[str, str] = {}
    for answer, score in zip(answers, scores):
        key = _vote_key(answer)
        if key is None:
            continue
        totals[key] = totals.get(key, 0.0) + float(score)
        representative.setdefault(key, answer)
    if not totals:
        return None
    best = max(totals, key=totals.__getitem__)  # dicts keep insertion order: first wins ties
    return representative[best]


def naive_best(answers: Sequence[str | None], scores: Sequence[float]) -> str | None:
    """The answer with the highest score (None answers skipped); first occurrence wins ties."""
    _check_lengths(answers, scores)
    best_answer, best_score = None, -math.inf
    for answer, score in zip(answers, scores):
        if _vote_key(answer) is not None and (best_answer is None or float(score) > best_score):
            best_answer, best_score = answer, float(score)
    return best_answer


def _vote_key(answer: str | None) -> str | None:
    """The grouping key of a votable answer; None for missing or empty answers."""
    if answer is None:
        return None
    key = canonical_form(answer)
    return key or None


def _check_lengths(answers: Sequence, scores: Sequence) -> None:
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
