"""How long ``optladder --help`` (and ``--version``, ``plan --help``) take, and what they import.

Each command runs in a fresh interpreter (``python -m optladder ...``, as the console
script does), ``--reps`` times; the median wall-clock seconds are printed with the
modules of note each one imported (torch, pydantic, bitsandbytes, transformers), found
with ``python -X importtime``. The target: under 0.5 s, importing none of them.

    python bench/cli_help.py            # 7 runs each
    python bench/cli_help.py --reps 15

Exit status 1 when a command is over ``--limit`` seconds or imports a module of note.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMANDS = (("--help",), ("--version",), ("plan", "--help"), ("demo", "--help"))
HEAVY = ("torch", "pydantic", "bitsandbytes", "transformers", "rich", "numpy")


def imported_modules(args: tuple[str, ...]) -> set[str]:
    """Top-level modules ``python -m optladder ARGS`` imports (from ``-X importtime``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "optladder", *args],
        capture_output=True,
        text=True,
        check=False,
        env=os.environ.copy(),
    )
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def seconds(args: tuple[str, ...], reps: int) -> tuple[float, int]:
    """Median wall-clock seconds of ``python -m optladder ARGS`` over ``reps`` fresh runs,
    and the last run's exit status."""
    times, code = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "optladder", *args], capture_output=True)
        times.append(time.perf_counter() - start)
        code = proc.returncode
    return statistics.median(times), code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="fresh runs per command (default 7)")
    parser.add_argument("--limit", type=float, default=0.5, help="seconds allowed (default 0.5)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps={args.reps} is not allowed; expected an integer >= 1")
    ok = True
    print(f"{'command':<28}{'median s':>10}{'exit':>6}  heavy modules imported")
    for command in COMMANDS:
        median, code = seconds(command, args.reps)
        heavy = sorted(imported_modules(command) & set(HEAVY))
        ok = ok and median < args.limit and not heavy and code == 0
        label = "optladder " + " ".join(command)
        print(f"{label:<28}{median:>10.3f}{code:>6}  {', '.join(heavy) or 'none'}")
    print(
        ("PASS" if ok else "FAIL")
        + f": every command exits 0 under {args.limit} s, importing none of {', '.join(HEAVY)}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
