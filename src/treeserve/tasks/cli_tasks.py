"""`treeserve tasks export`: the arithmetic task as MATH-500-shaped JSONL."""
from __future__ import annotations

import json
from pathlib import Path

from treeserve.errors import ParamError
from treeserve.tasks.arithmetic import LEVELS, SPLITS, generate


def add_tasks_parsers(sub) -> None:
    tasks = sub.add_parser("tasks", help="the built-in synthetic arithmetic task")
    actions = tasks.add_subparsers(dest="tasks_command", required=True, metavar="{export}")
    export = actions.add_parser("export", help="write problems of one split as JSONL (MATH-500's field names)")
    export.add_argument("--split", choices=list(SPLITS), default="test")
    export.add_argument("-n", "--n", type=int, default=500, help="problems to write")
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--levels", default=",".join(map(str, LEVELS)), help="comma-separated levels, cycled")
    export.add_argument("--out", type=Path, required=True)
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    if args.n < 1:
        raise ParamError("n", f"must be >= 1, got {args.n}")
    try:
        levels = tuple(int(level) for level in args.levels.split(",") if level)
    except ValueError:
        raise ParamError("levels", f"expected comma-separated level numbers, got {args.levels!r}") from None
    problems = generate(args.split, args.n, args.seed, levels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for problem in problems:
            f.write(json.dumps(problem.row()) + "\n")
    print(f"wrote {len(problems)} {args.split} problems to {args.out}")
    return 0
