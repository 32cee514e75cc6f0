"""Search parameters, with Search-and-Learn's names and defaults."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from treeserve.errors import ParamError
from treeserve.speculative_config import SpeculativeConfig

STRATEGIES = ("greedy", "majority", "best_of_n", "weighted_best_of_n", "beam", "dvts")
AGG_STRATEGIES = ("last", "min", "prod")
DEFAULT_AGG_STRATEGY = "last"  # Search-and-Learn's: for a PRM whose verdict says "right so far"
# A PRM's config.json may name the aggregation that suits its verdicts (`min` or `prod` for one that
# judges each step alone); search uses it where a request names none.
AGGREGATION_KEY = "prm_aggregation"
STEP_DELIMITER = "\n\n"

# The instruction Search-and-Learn gives Llama-3.2-Instruct: numbered "## Step k:" steps separated by
# blank lines, ending with a boxed answer.
SAL_SYSTEM_PROMPT = (
    "Solve the following math problem efficiently and clearly:\n\n"
    "- For simple problems (2 steps or fewer):\nProvide a concise solution with minimal explanation.\n\n"
    "- For complex problems (3 steps or more):\nUse this step-by-step format:\n\n"
    "## Step 1: [Concise description]\n[Brief explanation and calculations]\n\n"
    "## Step 2: [Concise description]\n[Brief explanation and calculations]\n\n...\n\n"
    "Regardless of the approach, always conclude with:\n\n"
    "Therefore, the final answer is: $\\boxed{answer}$. I hope it is correct.\n\n"
    "Where [answer] is just the final number or expression that solves the problem."
)


@dataclass(frozen=True)
class SearchConfig:
    strategy: str = "beam"
    n: int = 4                       # completions per problem (beams for beam search)
    beam_width: int = 4              # M: samples per kept beam; N // M beams survive each step
    num_iterations: int = 40         # maximum depth in steps
    lookahead: int = 0               # greedy steps rolled out past a candidate before scoring it
    temperature: float = 0.8
    top_p: float = 1.0
    max_tokens: int = 2048           # per generation call (one step, or a whole completion)
    # how a step-score list becomes one score; None: the one the verifier's config.json declares
    # (`prm_aggregation`), else `last`, named when the search is submitted (`with_aggregation`)
    agg_strategy: str | None = None
    filter_duplicates: bool = False  # beam search: drop beams whose text equals an earlier beam's
    sort_completed: bool = False     # beam search: keep the N best completed beams, not the first N
    eos_sampling_at_max_depth: bool = False  # S&L samples the last step to end-of-sequence
    system_prompt: str | None = SAL_SYSTEM_PROMPT
    seed: int = 0
    # speculative decoding of the samples (vLLM's dict; `suffix` drafts from the problem's sibling
    # sequences). Off by default: on the bundled pair it measured slower (benchmarks/spec_decode.py)
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        _require(self.strategy in STRATEGIES, "strategy", f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        self._check_counts()
        self._check_sampling()
        for name in ("filter_duplicates", "sort_completed", "eos_sampling_at_max_depth"):
            _require(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        _require(self.agg_strategy is None or self.agg_strategy in AGG_STRATEGIES, "agg_strategy",
                 f"must be one of {', '.join(AGG_STRATEGIES)} (or None: the verifier's own), got {self.agg_strategy!r}")
        _require(self.system_prompt is None or isinstance(self.system_prompt, str), "system_prompt",
                 f"must be a string or None (no system prompt), got {self.system_prompt!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))

    def _check_counts(self) -> None:
        """Whole numbers (a bool is none: True was taken as 1)."""
        for name, least in (("n", 1), ("beam_width", 1), ("num_iterations", 1), ("lookahead", 0), ("max_tokens", 1)):
            value = getattr(self, name)
            _require(_is_int(value) and value >= least, name, f"must be an integer >= {least}, got {value!r}")
        self._check_beam_width()

    def _check_beam_width(self) -> None:
        """DVTS grows n / beam_width subtrees (S&L refuses an n it does not divide, as this does); beam
        search keeps n // beam_width beams each step, as S&L's, which takes any n (this refused it)."""
        default = ", the default where none is given" if self.beam_width == 4 else ""
        if self.strategy == "dvts":
            _require(self.n % self.beam_width == 0, "beam_width",
                     f"n ({self.n}) must be a multiple of beam_width ({self.beam_width}{default})")
        if self.strategy == "beam":
            _require(self.beam_width <= self.n, "beam_width",
                     f"n ({self.n}) must be at least beam_width ({self.beam_width}{default}): "
                     "n // beam_width beams survive each step")

    def _check_sampling(self) -> None:
        """Numbers, named where they are not (a string was a TypeError from a comparison)."""
        _require(_is_number(self.temperature) and 0 <= self.temperature < float("inf"), "temperature",
                 f"must be a number >= 0 and finite, got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.seed) and -2 ** 63 <= self.seed < 2 ** 64, "seed",
                 f"must be an integer in [-2**63, 2**64) (a 64-bit seed, as SamplingParams'), got {self.seed!r}")

    @property
    def uses_verifier(self) -> bool:
        return reads_verifier(self.strategy)

    @property
    def num_candidates(self) -> int:
        """The completions a search writes: n, but greedy's one."""
        return 1 if self.strategy == "greedy" else self.n

    def replace(self, **changes) -> "SearchConfig":
        return dataclasses.replace(self, **changes)


def reads_verifier(strategy: str) -> bool:
    """Whether a strategy scores its candidates with the verifier (greedy and majority do not)."""
    return strategy not in ("greedy", "majority")


def with_aggregation(config: SearchConfig, verifier_dir: str | Path | None) -> SearchConfig:
    """`config` with its aggregation named: where it names none, the one the verifier's model directory
    declares, as `/v1/search` and `treeserve search` choose it (no verifier: `last`, which is unused)."""
    if config.agg_strategy is not None:
        return config
    declared = declared_aggregation(verifier_dir) if verifier_dir is not None else DEFAULT_AGG_STRATEGY
    return config.replace(agg_strategy=declared)


def declared_aggregation(model_dir: str | Path) -> str:
    """The aggregation a verifier's model directory names in its config.json, else `last`."""
    config = Path(model_dir) / "config.json"
    declared = json.loads(config.read_text()) if config.is_file() else {}
    name = declared.get(AGGREGATION_KEY, DEFAULT_AGG_STRATEGY)
    if name not in AGG_STRATEGIES:
        raise ValueError(f"{config}: unknown {AGGREGATION_KEY} {name!r}; known: {', '.join(AGG_STRATEGIES)}")
    return name


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ParamError(name, message)
