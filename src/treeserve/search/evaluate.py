"""The eval harness: strategies x N over a MATH-format dataset, per-problem JSONL, summary, plot."""
from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from treeserve import jsonl
from treeserve.errors import ParamError
from treeserve.search.config import SearchConfig, reads_verifier
from treeserve.search.grading import grade, majority_vote, naive_best, pass_at_k, weighted_vote
from treeserve.search.tree import SearchResult

Runner = Callable[[list[str], SearchConfig, Callable], list[SearchResult]]


def load_dataset(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first `limit` (default: all) problems of a JSONL file, each row an object with `problem`
    and `answer`; ParamError naming the file and line of the first bad row, or an empty file."""
    if limit is not None and limit < 1:
        raise ParamError("limit", f"must be at least 1, got {limit}")
    try:
        text = Path(path).read_text()
    except OSError as exc:  # (the message names the setting, not only the file)
        raise ParamError("dataset", f"cannot read {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in jsonl.split(text):
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ParamError("dataset", f"{path} line {number} is not JSON ({exc})") from None
        missing = [k for k in ("problem", "answer") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ParamError("dataset", f"{path} line {number}: a row needs the fields problem and answer "
                                        f"(missing {', '.join(missing)})")
        if not isinstance(row["problem"], str) or not row["problem"].strip():
            raise ParamError("dataset", f"{path} line {number}: problem must be a non-empty string, "
                                        f"got {row['problem']!r}")
        rows.append(row)
        if len(rows) == limit:
            break
    if not rows:
        raise ParamError("dataset", f"{path} has no problems")
    return rows


def predictions_by_n(result: SearchResult) -> dict[str, str | None]:
    """S&L's naive / weighted / majority predictions from the first n completions, n = 1, 2, 4, ...
    Majority only where the strategy reads no verifier (greedy, majority): naive and weighted rank by
    verifier scores, and such a search has none (its `agg_scores` are null, as /v1/search says)."""
    preds: dict[str, str | None] = {}
    total, scored = len(result.completions), reads_verifier(result.strategy)
    for n in [2 ** i for i in range(int(math.log2(total)) + 1)] + ([total] if total & (total - 1) else []):
        answers, scores = result.answers[:n], result.agg_scores[:n]
        if scored:
            preds[f"naive@{n}"] = naive_best(answers, scores)
            preds[f"weighted@{n}"] = weighted_vote(answers, scores)
        preds[f"maj@{n}"] = majority_vote(answers)
    return preds


def evaluate(rows: list[dict], config: SearchConfig, run: Runner, out_dir: Path) -> dict:
    """Runs one (strategy, N) over the rows; writes its JSONL and returns its summary. Each record is
    appended to the JSONL as its problem finishes (a killed process keeps them; the file is then
    rewritten in the dataset's order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict | None] = [None] * len(rows)
    bar = tqdm(total=len(rows), desc=f"{config.strategy} n={config.n}", unit="problem")
    path = out_dir / f"{config.strategy}_n{config.n}.jsonl"
    start, progress = time.perf_counter(), path.open("w")

    def on_result(index: int, result: SearchResult) -> None:
        records[index] = _record(rows[index], result)
        progress.write(json.dumps(records[index]) + "\n")
        progress.flush()
        bar.update(1)

    try:
        run([r["problem"] for r in rows], config, on_result)
    except BaseException as exc:  # a signal's exit, Ctrl-C, a problem that failed: what finished is kept
        cause = _naming_the_row(exc, rows) if isinstance(exc, ValueError) else exc
        finished = [r for r in records if r is not None]
        summary = _summary(config, finished, time.perf_counter() - start) | {"interrupted": True}
        if isinstance(exc, Exception):
            summary["error"] = str(cause)
        raise Interrupted(summary, cause) from exc
    finally:  # the bar ends its line, so an error is printed on a line of its own
        bar.close()
        progress.close()
        _write_records(path, [r for r in records if r is not None])
    return _summary(config, records, time.perf_counter() - start)


class Interrupted(Exception):
    """A run stopped part way (a signal, or an error such as a problem too long for the model):
    `summary` is its finished problems', `cause` what stopped it (to raise again once the report of
    what finished is written)."""

    def __init__(self, summary: dict, cause: BaseException):
        super().__init__(f"interrupted after {summary['num_problems']} problem(s)")
        self.summary, self.cause = summary, cause


def _write_records(path: Path, records: list[dict]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _naming_the_row(exc: ValueError, rows: list[dict]) -> ValueError:
    """The error of one problem, naming its row (the run stops at it)."""
    index = getattr(exc, "problem_index", None)
    if index is None:
        return exc
    name = f" ({rows[index]['unique_id']})" if rows[index].get("unique_id") else ""
    return ParamError("dataset", f"problem {index + 1}{name} of the dataset: {exc}")


def _record(row: dict, result: SearchResult) -> dict:
    preds = predictions_by_n(result)
    graded = {key: grade(pred, row["answer"]) for key, pred in preds.items()}
    correct = [grade(a, row["answer"]) for a in result.answers]
    return {"unique_id": row.get("unique_id"), "level": row.get("level"), "answer": row["answer"],
            "pred": result.pred, "correct": grade(result.pred, row["answer"]), "num_correct": sum(correct),
            "preds": preds, "graded": graded} | {k: v for k, v in asdict(result).items() if k != "problem"} \
        | {"agg_scores": result.reported_agg_scores}


def _summary(config: SearchConfig, records: list[dict], seconds: float) -> dict:
    count = len(records)
    by_level: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        by_level[str(r["level"])].append(r["correct"])
    n = config.num_candidates
    keys = records[0]["graded"].keys() if records else []
    return {"strategy": config.strategy, "n": config.n, "accuracy": sum(r["correct"] for r in records) / max(count, 1),
            "num_problems": count, "seconds": seconds,
            "accuracy_by_level": {lvl: sum(v) / len(v) for lvl, v in sorted(by_level.items())},
            "accuracy_by_prediction": {k: sum(r["graded"][k] for r in records) / count for k in keys},
            "pass@k": {k: sum(pass_at_k(n, min(r["num_correct"], n), k) for r in records) / max(count, 1)
                       for k in sorted({1, n}) if k <= n},
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "verifier_tokens": sum(r["verifier_tokens"] for r in records),
            "config": asdict(config) | {"agg_strategy": _aggregation_used(config, records)}}


def _aggregation_used(config: SearchConfig, records: list[dict]) -> str | None:
    """The aggregation the search folded step scores with: the config's, or where it names none, the
    one the runner chose (the verifier's declared one), which each record holds (the summary said null);
    None for a strategy that reads no verifier, as its records say (`eval` names the verifier's for
    every strategy, and majority's summary recorded `min` beside records of null)."""
    if not config.uses_verifier:
        return None
    used = {r["agg_strategy"] for r in records if r.get("agg_strategy") is not None}
    return config.agg_strategy or (used.pop() if len(used) == 1 else None)


def write_report(summaries: list[dict], out_dir: Path) -> list[Path]:
    """summary.json (one run: its summary; several: {"runs": [...]}), summary.md and accuracy.png."""
    single = summaries[0] if len(summaries) == 1 else {"runs": summaries}
    (out_dir / "summary.json").write_text(json.dumps(single, indent=2))
    lines = ["| strategy | N | accuracy | problems | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {s['strategy']} | {s['n']} | {s['accuracy']:.1%} | {s['num_problems']}"
              f"{' (interrupted)' if s.get('interrupted') else ''} | {s['seconds']:.1f} |" for s in summaries]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return [out_dir / "summary.json", out_dir / "summary.md", _plot(summaries, out_dir / "accuracy.png")]


def _plot(summaries: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    by_strategy: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in summaries:
        by_strategy[s["strategy"]].append((s["n"], 100 * s["accuracy"]))
    for strategy, points in by_strategy.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (generations per problem)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy against test-time compute")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
