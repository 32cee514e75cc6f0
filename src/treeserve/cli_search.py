"""`treeserve search` and `treeserve eval`: test-time search from the command line."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from treeserve.arg_types import at_least_one, given, json_object, model_arg
from treeserve.errors import ParamError
from treeserve.lifecycle import heap_frozen_while_it_runs
from treeserve.model.registry import DEFAULT_GENERATOR, DEFAULT_VERIFIER
from treeserve.runtime.scorer import given_question


def add_search_parsers(sub) -> None:
    search = sub.add_parser("search", help="solve one question with a generator and a verifier")
    _add_search_args(search)
    search.add_argument("-n", "--n", type=int, default=16,
                        help="candidates per problem: best-of-N's samples, the candidates scored at each step of "
                        "beam and dvts")
    search.add_argument("question", type=_question)
    search.set_defaults(func=cmd_search)
    evaluate = sub.add_parser("eval", help="accuracy of search strategies on a MATH-format dataset")
    _add_search_args(evaluate)
    evaluate.add_argument("--dataset", required=True, help="JSONL with problem and answer fields (e.g. MATH-500)")
    evaluate.add_argument("-n", "--n", default=[4], type=_sizes,
                          help="comma-separated N values, e.g. 4,16,64 (default: 4)")
    evaluate.add_argument("--limit", type=at_least_one, help="only the first LIMIT problems")
    evaluate.add_argument("--out", type=Path, required=True)
    evaluate.add_argument("--reference", action="store_true",
                          help="run Search-and-Learn's original execution instead of treeserve's")
    evaluate.set_defaults(func=cmd_eval)


def _question(text: str) -> str:
    """search's check of the question, as argparse's error (before any model loads)."""
    try:
        return given_question(text)
    except ParamError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def _recipe(text: str) -> str:
    """--recipe, named by argparse (an unknown one was "recipes: prm: unknown recipe", the Runtime's names;
    an empty one, the verifier's own recipe without a word)."""
    from treeserve.runtime.prm_recipes import RECIPES

    if text not in RECIPES:
        what = "is empty ('')" if not text.strip() else f"unknown recipe {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; known: {', '.join(RECIPES)} (or leave the flag out for the "
                                         "verifier's own)")
    return text


def _sizes(text: str) -> list[int]:
    """--n of eval: comma-separated N values, each at least 1."""
    sizes = [at_least_one(n.strip()) for n in text.split(",") if n.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("expected N values such as 4,16,64")
    return sizes


def _add_search_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generator", default=DEFAULT_GENERATOR, type=model_arg, help="generator model directory or builtin:NAME")
    parser.add_argument("--verifier", default=DEFAULT_VERIFIER, type=model_arg, help="process reward model directory or builtin:NAME")
    parser.add_argument("--recipe", type=_recipe, help="how the verifier reads steps: rlhflow, math-shepherd, chat-steps, "
                        "lm-likelihood (a plain LM scoring by its own likelihood, as the bundled arith-prm), "
                        "qwen-prm or value-head (default: the one the verifier's config.json names, else its "
                        "reward head's own, else rlhflow)")
    parser.add_argument("--strategy", default="beam",
                        help="greedy, majority, best_of_n, weighted_best_of_n, beam or dvts (eval: comma-separated)")
    parser.add_argument("--beam-width", type=int,
                        help="candidates sampled from each kept beam (beam, dvts; Search-and-Learn's M): N // "
                        "beam-width beams survive each step; at most --n, and for dvts a divisor of --n (of each N "
                        "for eval) (default: 4, at most --n)")
    parser.add_argument("--num-iterations", type=int, default=40)
    parser.add_argument("--lookahead", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--agg-strategy", type=given("last, min or prod, or leave the flag out for the verifier's own"), help="last, min or prod: how step scores make one score "
                        "(default: the one the verifier's config.json names, else last)")
    parser.add_argument("--filter-duplicates", action=argparse.BooleanOptionalAction, default=False,
                        help="beam: drop a beam whose text equals an earlier beam's before the survivors are "
                        "chosen (Search-and-Learn's filter_duplicates; default: off)")
    parser.add_argument("--sort-completed", action=argparse.BooleanOptionalAction, default=False,
                        help="beam: the candidates are the N best-scored completed beams, not the first N to complete "
                        "(Search-and-Learn's sort_completed; default: off)")
    parser.add_argument("--eos-sampling-at-max-depth", action=argparse.BooleanOptionalAction, default=False,
                        help="beam, dvts: sample the last iteration's step to end-of-sequence, as "
                        "Search-and-Learn does (default: off, on with eval --reference; a beam ends at the last "
                        "iteration either way)")
    parser.add_argument("--system-prompt", help="replaces Search-and-Learn's math system prompt ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative-config", type=json_object, metavar="JSON",
                        help='speculative decoding of the samples, as vLLM\'s: \'{"method": "suffix"}\' drafts from '
                        "the problem's sibling sequences (default: off; it measured slower at N=16 on the "
                        "bundled pair)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", help="both models' weights: int8 (weight-only, made at load) or "
                        "the checkpoints' own scheme (default: as stored)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-memory-bytes", type=int)


def _beam_width(args, n: int) -> int:
    """The default (4) at most n, as /v1/search's; one given is taken as it is, by eval for each N of its
    grid too: a width over an N is refused for beam and dvts, and one that does not divide it for dvts,
    naming both, as /v1/search refuses them (eval took it at most each N without a word, so
    `--beam-width 8 --n 4,16` searched N=4 with 4 beams)."""
    return min(4, n) if args.beam_width is None else args.beam_width


def _config(args, strategy: str, n: int):
    """The search's settings, checked before any model loads (a misspelt strategy is named at once)."""
    from treeserve.model.registry import resolve_model_path
    from treeserve.search.config import SAL_SYSTEM_PROMPT, SearchConfig, declared_aggregation

    system = SAL_SYSTEM_PROMPT if args.system_prompt is None else (args.system_prompt or None)
    agg_strategy = args.agg_strategy or declared_aggregation(resolve_model_path(args.verifier))
    return SearchConfig(strategy=strategy, n=n, beam_width=_beam_width(args, n), num_iterations=args.num_iterations,
                        lookahead=args.lookahead, temperature=args.temperature, top_p=args.top_p,
                        max_tokens=args.max_tokens, agg_strategy=agg_strategy,
                        filter_duplicates=args.filter_duplicates, sort_completed=args.sort_completed,
                        eos_sampling_at_max_depth=_eos_sampling_at_max_depth(args), system_prompt=system,
                        seed=args.seed, speculative_config=args.speculative_config)


def _eos_sampling_at_max_depth(args) -> bool:
    """On where asked, and for `eval --reference`, which samples S&L's way (ReferenceRunner turns it on):
    its summary.json recorded it off for a run that sampled its last step to end-of-sequence."""
    return args.eos_sampling_at_max_depth or getattr(args, "reference", False)


def _runtime(args):
    from treeserve.runtime.runtime import Runtime

    return Runtime({"gen": args.generator, "prm": args.verifier}, recipes={"prm": args.recipe},
                   kv_cache_memory_bytes=args.kv_cache_memory_bytes, dtype=args.dtype, device=args.device,
                   max_model_len=args.max_model_len, quantization=args.quantization)


def _runner(args, rt, reference: bool = False):
    if reference:
        from treeserve.model.registry import resolve_model_path
        from treeserve.search.reference import HFStepScorer, ReferenceRunner

        prm = rt.engine("prm")
        path = str(resolve_model_path(prm.config.model))
        return ReferenceRunner(rt.engine("gen"), HFStepScorer(path, prm.tokenizer, rt.recipes["prm"],
                                                                 dtype=prm.dtype, max_len=prm.max_model_len))
    from treeserve.search.runner import SearchRunner

    return SearchRunner(rt.engine("gen"), rt.scorer("prm"))


def cmd_search(args) -> int:
    from treeserve.search.tree import REJECT_THRESHOLD

    config = _config(args, args.strategy, args.n)
    rt = _runtime(args)
    with heap_frozen_while_it_runs(), _progress_bar(config) as show:
        result = _runner(args, rt).run([args.question], config, on_progress=show)[0]
    chosen = result.completions[result.chosen]
    print(chosen)
    print(f"--- answer: {result.pred}  {_score(config, result)}  "
          f"tree size: {result.tree_size} steps, {result.completion_tokens} generated tokens, "
          f"{len(result.completions)} candidates, {result.seconds:.1f} s")
    if result.verifier_rejected_all:
        print(f"warning: the verifier rejected every candidate (best score {max(result.agg_scores):.4f} under "
              f"{REJECT_THRESHOLD}): the answer is a guess (is the question the kind the models were trained on?)",
              file=sys.stderr)
    return 0


@contextlib.contextmanager
def _progress_bar(config):
    """A search's progress on stderr as it goes (a long search on a real model takes minutes): its
    scoring rounds, the best score so far, tokens generated and tree size."""
    from tqdm import tqdm

    bar = tqdm(desc=f"{config.strategy} n={config.n}", unit=" rounds", file=sys.stderr)

    def show(progress) -> None:
        bar.n = progress.iteration
        best = "none" if progress.best_score is None else f"{progress.best_score:.4f}"
        bar.set_postfix_str(f"best score {best}, {progress.completion_tokens} tokens, tree size {progress.tree_size}")
    try:
        yield show
    finally:  # (the bar ends its line before the answer or an error is printed)
        bar.close()


def _score(config, result) -> str:
    """The chosen candidate's score, or why there is none (greedy and majority read no verifier)."""
    if not config.uses_verifier:
        return f"score: none ({config.strategy} reads no verifier)"
    return f"score: {result.agg_scores[result.chosen]:.4f}"


def cmd_eval(args) -> int:
    from treeserve.search.evaluate import Interrupted, evaluate, load_dataset

    rows = load_dataset(args.dataset, args.limit)
    sizes = args.n
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    if not strategies:
        raise ParamError("strategy", f"expected strategies such as beam,best_of_n, got {args.strategy!r}")
    configs = [_config(args, s, n) for s in strategies for n in ([1] if s == "greedy" else sizes)]
    rt = _runtime(args)
    runner = _runner(args, rt, args.reference)
    summaries = []
    try:
        with heap_frozen_while_it_runs():
            for config in configs:
                summaries.append(evaluate(rows, config, runner.run, args.out))
                print(f"{config.strategy} n={config.n}: accuracy {summaries[-1]['accuracy']:.1%} "
                      f"on {len(rows)} problems ({summaries[-1]['seconds']:.1f} s)")
    except Interrupted as stopped:  # what finished is reported, then the signal's exit status (or the error)
        summaries.append(stopped.summary)
        _report(summaries, args.out)
        raise stopped.cause from None
    _report(summaries, args.out)
    return 0


def _report(summaries: list[dict], out) -> None:
    from treeserve.search.evaluate import write_report

    for path in write_report(summaries, out):
        print(f"wrote {path}")
