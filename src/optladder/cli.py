"""The ``optladder`` command line: ``optladder demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from optladder.rungs import RUNGS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optladder", description="Choose and run an AdamW optimizer rung by memory."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train an MLP on the UCI digits through choose_optimizer",
        description="Train an MLP on the UCI handwritten digits through choose_optimizer. "
        "Without options: once per rung, with a free memory that makes the policy choose "
        "it, then the OOM ladder demo (--oom).",
    )
    demo.add_argument("--rung", choices=RUNGS, help="pin a rung")
    demo.add_argument(
        "--free-memory",
        help="memory the optimizer may assume free: bytes or e.g. '2MiB' (default: probed)",
    )
    demo.add_argument("--epochs", type=int, default=12, help="passes over the data (default 12)")
    demo.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    demo.add_argument(
        "--oom",
        action="store_true",
        help="only the ladder demo: a child process under RLIMIT_AS runs out of memory for "
        "real on the fp32 rung and recovers on bf16",
    )
    demo.add_argument(
        "--steps", type=int, default=20, help="train steps of the --oom demo (default 20)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input)."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from optladder.demo import run_demo
        from optladder.oom_demo import run_oom_demo

        single = args.rung is not None or args.free_memory is not None
        if args.steps < 1 or args.epochs < 1:
            print("optladder demo: error: --steps and --epochs must be >= 1", file=sys.stderr)
            return 2
        try:
            if not args.oom:
                run_demo(
                    rung=args.rung, free_memory=args.free_memory, epochs=args.epochs, seed=args.seed
                )
            if args.oom or not single:
                print("\n== the OOM ladder: a real out-of-memory error on the CPU ==")
                return run_oom_demo(steps=args.steps)
        except (ValueError, ImportError) as exc:
            print(f"optladder demo: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
