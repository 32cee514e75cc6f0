"""`Scheduler.schedule`'s seconds per model on the founding study's CPU replica (#59): the host's
cost of scheduling the shared arena's 4-token PRM pages against the static split's 16-token ones.
Each configuration of `gpu.py --founding-replica --splits 0.3` (static gen=0.3, shared) runs a
warm-up, then one timed run; it prints the run's counters (tokens, hits, thrash, preemptions: they
must not change between two versions of the code) and the seconds `schedule` took per model.

    PYTHONPATH=src python benchmarks/founding_schedule.py --out /tmp/fs
    PYTHONPATH=src python benchmarks/founding_schedule.py --out /tmp/fs --only shared --profile

Compare two versions by running this alternately on each (a `git worktree` of the other): this
host's noise is ~10%.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # noqa: E402
import gpu_founding  # noqa: E402
from treeserve.engine import scheduler  # noqa: E402

totals: dict[str, float] = {}


def timed_schedule(self):
    start = time.perf_counter()
    try:
        return _schedule(self)
    finally:
        totals[self.owner] = totals.get(self.owner, 0.0) + time.perf_counter() - start


_schedule = scheduler.Scheduler.schedule


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the replica's models are made")
    parser.add_argument("--only", default=None, help="one configuration: 'static gen=0.3' or 'shared'")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed run and print its top functions")
    own = parser.parse_args(argv)
    args = gpu.parse_args(["--device", "cpu", "--founding-replica", "--sections", "founding_search", "--splits", "0.3",
                           "--founding-block-size", "0", "--founding-ceiling", "0", "--out", str(own.out)])
    args.results = {}
    configurations = gpu_founding.configurations(args.splits, 0, 0)
    if own.only is not None and own.only not in [label for label, _ in configurations]:
        parser.error(f"--only {own.only!r}: the configurations are " + ", ".join(repr(label) for label, _ in configurations))
    gen_dir, prm_dir = gpu.model_dirs(args, own.out / "models")
    gpu_founding.fixed_length_steps()
    vocab = gpu.model_shapes(args)[0][0]["vocab_size"]
    problems = gpu_founding.questions(args.search_problems, vocab, seed=1, smoke=False)
    loaded = gpu_founding.load_models(args, {"gen": gen_dir, "prm": prm_dir})
    scheduler.Scheduler.schedule = timed_schedule
    for label, options in configurations:
        if own.only and label != own.only:
            continue
        runtime = gpu_founding.build_runtime(args, loaded, options)
        gpu_founding.run_one(args, runtime, "warm", problems[:2], 2)
        totals.clear()
        profile = cProfile.Profile() if own.profile else None
        if profile:
            profile.enable()
        gpu_founding.run_one(args, runtime, label, problems, args.search_depth)
        if profile:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        print(f"schedule seconds, {label}:", {owner: round(s, 3) for owner, s in sorted(totals.items())}, flush=True)
        runtime.close()


if __name__ == "__main__":
    main()
