"""The README's accuracy table and plot from `treeserve eval` output directories.

Majority vote, best-of-N and weighted best-of-N at every N come from one best-of-N run at the
largest N, as Search-and-Learn reports them: each is computed on the first N of its completions
(the same samples a smaller run would draw). Beam search and DVTS are separate runs per N.

    treeserve eval --dataset test.jsonl --strategy greedy,best_of_n --n 64 --out runs/arith/bon
    treeserve eval --dataset test.jsonl --strategy beam,dvts --n 4,16,64 --out runs/arith/tree
    python scripts/accuracy_table.py runs/arith/bon runs/arith/tree --plot docs/arith_accuracy.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SAMPLED = {"majority": "maj", "best_of_n": "naive", "weighted_best_of_n": "weighted"}
ORDER = ["majority", "best_of_n", "weighted_best_of_n", "beam", "dvts"]


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for directory in dirs:
        summary = json.loads((directory / "summary.json").read_text())
        runs += summary.get("runs", [summary])
    return runs


def accuracy_grid(runs: list[dict], sizes: list[int]) -> tuple[float | None, dict[str, dict[int, float]]]:
    greedy = next((r["accuracy"] for r in runs if r["strategy"] == "greedy"), None)
    grid: dict[str, dict[int, float]] = {name: {} for name in ORDER}
    sampled = max((r for r in runs if r["strategy"] == "best_of_n"), key=lambda r: r["n"], default=None)
    if sampled is not None:
        for name, key in SAMPLED.items():
            for n in sizes:
                if f"{key}@{n}" in sampled["accuracy_by_prediction"]:
                    grid[name][n] = sampled["accuracy_by_prediction"][f"{key}@{n}"]
    for r in runs:
        if r["strategy"] in ("beam", "dvts"):
            grid[r["strategy"]][r["n"]] = r["accuracy"]
    return greedy, grid


def markdown(greedy: float | None, grid: dict[str, dict[int, float]], sizes: list[int], problems: int) -> str:
    lines = [f"| strategy ({problems} test problems) | " + " | ".join(f"N={n}" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    if greedy is not None:
        lines.append(f"| greedy | {100 * greedy:.1f}% (N=1) |" + " |" * (len(sizes) - 1))
    for name in ORDER:
        cells = [f"{100 * grid[name][n]:.1f}%" if n in grid[name] else "—" for n in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(greedy: float | None, grid: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ORDER:
        points = sorted(grid[name].items())
        if points:
            ax.plot([n for n, _ in points], [100 * a for _, a in points], marker="o", label=name)
    if greedy is not None:
        ax.axhline(100 * greedy, color="grey", linestyle="--", label="greedy")
    ax.set(xscale="log", xlabel="N (generations per problem)", ylabel="accuracy (%)",
           title="Accuracy against test-time compute")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--sizes", default="4,16,64")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    runs = load_runs(args.dirs)
    greedy, grid = accuracy_grid(runs, sizes)
    print(markdown(greedy, grid, sizes, max(r["num_problems"] for r in runs)))
    if args.plot:
        plot(greedy, grid, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
