"""The ``optladder`` command line: ``optladder demo`` and ``optladder plan``.

Only the standard library and :mod:`optladder.units` are imported until a command runs:
``optladder --help`` and ``--version`` never load torch, pydantic or bitsandbytes
(``bench/cli_help.py`` measures it).

Exit status (``optladder plan``; the numbers are :data:`EXIT_FITS` and friends):

- 0: the rung the plan would use passes the memory gate;
- 1: it does not (with the policy choosing: no allowed rung passes, and
  ``choose_optimizer`` would raise ``InsufficientMemoryError``);
- 2: bad input (argparse's own code for a bad command line);
- 3: no decision: the target device is not on this machine and ``--free-memory`` was not
  given; each rung's state bytes and the free memory it needs are printed, and how to
  plan for that device.

``optladder demo`` exits 0 when it ran, 2 on bad input, and the OOM demo's status else.
Either exits 141 (:data:`EXIT_BROKEN_PIPE`), quietly, when the reader of its output
closed the pipe first (``optladder plan --json | head -1``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from optladder import __version__
from optladder.dtype_names import allowed_spellings, canonical_dtype
from optladder.units import parse_bytes, parse_count

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2
EXIT_NO_DECISION = 3
EXIT_BROKEN_PIPE = 141
"""The reader of the output closed the pipe first (128 + SIGPIPE, as a shell reports it)."""

RUNG_CHOICES = ("fp32", "bf16", "8bit")
"""``optladder.rungs.RUNGS``, written out so that parsing does not import pydantic (a test
keeps the two equal)."""

SEED_MAX = 2**64 - 1
"""The largest ``--seed`` (``torch.manual_seed`` and the bf16 rung's ``seed=`` take
``[0, 2**64)``)."""

_VALUE_OPTIONS = (
    "--free-memory",
    "--params",
    "--proactive-min-params",
    "--policy-fraction",
    "--seed",
    "--epochs",
    "--steps",
    "--world-size",
)

DIGITS = tuple("0123456789.")

_PLAN_EPILOG = """\
exit status: 0 the rung fits the memory gate; 1 it does not (nothing fits: choose_optimizer
would raise InsufficientMemoryError); 2 bad input; 3 no decision (the device is not on this
machine and --free-memory was not given: the estimates are printed, and how to plan for it)
"""


def _seed(text: str) -> int:
    """argparse type of ``--seed``: a whole number in ``[0, 2**64)``."""
    allowed = f"expected a whole number from 0 to 2**64 - 1 ({SEED_MAX:,}), e.g. 0 or 1234"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: {allowed}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: {allowed}")
    return value


def _dtype(text: str) -> str:
    """argparse type of ``--dtype``: a param dtype in any accepted spelling (``bf16``)."""
    try:
        return canonical_dtype(text, "--dtype")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    """argparse type of ``--epochs``, ``--steps``, ``--world-size``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a whole number >= 1")
    return value


def _attach_negative_values(argv: list[str]) -> list[str]:
    """Join ``--free-memory -5GiB`` into ``--free-memory=-5GiB``.

    argparse reads a value that starts with ``-`` and is not a plain negative number as
    an option, and answers "expected one argument"; joined, the value reaches its parser,
    whose message says what is allowed.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if token in _VALUE_OPTIONS and following[:1] == "-" and following[1:2] in DIGITS:
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


_DEMO_EPOCHS = 12
"""``optladder demo --epochs`` when not given."""
_OOM_STEPS = 20
"""``optladder demo --steps`` (the OOM demo's train steps) when not given."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optladder", description="Choose and run an AdamW optimizer rung by memory."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train an MLP on the UCI digits through choose_optimizer",
        description="Train an MLP on the UCI handwritten digits through choose_optimizer. "
        "Without options: once per rung, with a free memory that makes the policy choose "
        "it, once more on bf16 with the forward under bf16 autocast, then the OOM ladder "
        "demo (--oom).",
    )
    demo.add_argument("--rung", type=str.lower, choices=RUNG_CHOICES, help="fix the rung")
    demo.add_argument(
        "--free-memory",
        help="memory the optimizer may assume free: bytes or e.g. '2MiB' (default: probed)",
    )
    demo.add_argument(  # default None: _run_demo tells an option given from its default
        "--epochs", type=_positive_int, help=f"passes over the data (default {_DEMO_EPOCHS})"
    )
    demo.add_argument("--seed", type=_seed, help="seed, 0 to 2**64 - 1 (default 0)")
    demo.add_argument(
        "--oom",
        action="store_true",
        help="only the ladder demo: a child process under RLIMIT_AS runs out of memory for "
        "real on the fp32 rung and recovers on bf16",
    )
    demo.add_argument(
        "--steps", type=_positive_int, help=f"train steps of the --oom demo (default {_OOM_STEPS})"
    )
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan",
        help="which rung a model's optimizer state would get on a device (nothing allocated)",
        description="Estimate every rung's optimizer state for a model on a target device and "
        "show the decision. Give exactly one of --params, --model-config, --model. With "
        "--world-size N the state is sharded: each rank holds ceil(moments / N) bytes, "
        "compared with one device's free memory. OPTLADDER_* variables act as in "
        "choose_optimizer.",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--params", help="trainable param count: 124439808, 7e9, 7B, 350M")
    plan.add_argument(
        "--model-config",
        metavar="PATH",
        help="a Hugging Face transformers config.json (or its folder), built on the meta "
        "device; or a shipped name: gpt2, llama-2-7b, mistral-7b, qwen2.5-0.5b",
    )
    plan.add_argument(
        "--model", metavar="PKG.MODULE:FACTORY", help="a callable returning an nn.Module"
    )
    plan.add_argument("--device", default="cuda", help="the target device (default cuda)")
    plan.add_argument(
        "--free-memory",
        help="free bytes of one target device, e.g. 80GiB or 80GB (default: probed; needed "
        "when the device is not on this machine)",
    )
    plan.add_argument(
        "--world-size", type=int, default=1, help="ranks sharing the state (default 1)"
    )
    plan.add_argument(
        "--dtype",
        type=_dtype,
        help=f"param dtype: {allowed_spellings()} (default: --model-config: the config's "
        "torch_dtype or dtype, else float32; --model: the factory's own; --params: float32)",
    )
    plan.add_argument(
        "--rung", type=str.lower, choices=RUNG_CHOICES, help="fix the rung, past the memory gate"
    )
    plan.add_argument(
        "--policy-fraction", type=float, help="the memory gate's fraction, in (0, 1] (default 0.25)"
    )
    plan.add_argument(
        "--proactive-min-params",
        help="params from which bf16 is chosen where it is fused (default 50,000,000)",
    )
    plan.add_argument("--json", action="store_true", help="print the decision as JSON only")


def _plan_policy_fields(args: argparse.Namespace) -> dict[str, float | int]:
    """The ``Policy`` fields the options set; checked here, before torch is imported, so
    that a bad value is answered at once.

    Raises:
        ValueError: naming the option, its value and what is allowed.
    """
    if args.params is not None:
        parse_count(args.params, "--params")
    if args.free_memory is not None:
        parse_bytes(args.free_memory, "--free-memory")
    fields: dict[str, float | int] = {}
    if args.policy_fraction is not None:
        if not 0.0 < args.policy_fraction <= 1.0:
            raise ValueError(
                f"--policy-fraction={args.policy_fraction!r} is not allowed; "
                "expected a fraction in (0, 1]"
            )
        fields["memory_fraction"] = args.policy_fraction
    if args.proactive_min_params is not None:
        fields["proactive_bf16_min_params"] = parse_count(
            args.proactive_min_params, "--proactive-min-params", minimum=0
        )
    return fields


def _run_plan(args: argparse.Namespace) -> int:
    try:
        fields = _plan_policy_fields(args)
    except ValueError as exc:
        print(f"optladder plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from optladder.plan import FreeMemoryUnknownError, Plan, make_plan, print_plan  # torch
    from optladder.policies import Policy

    def plan(free_memory: str | None) -> Plan:
        return make_plan(
            params=args.params,
            model_config=args.model_config,
            model=args.model,
            device=args.device,
            free_memory=free_memory,
            world_size=args.world_size,
            dtype=args.dtype,
            policy=Policy.model_validate(fields),
            rung=args.rung,
        )

    try:
        try:
            result = plan(args.free_memory)
        except FreeMemoryUnknownError as exc:
            if not args.json:  # the estimates need no free memory: show them
                print_plan(plan("0"), decided=False)
            print(f"optladder plan: no decision: {exc}", file=sys.stderr)
            return EXIT_NO_DECISION
    except (ValueError, ImportError) as exc:
        print(f"optladder plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    decision = result.decision
    if args.json:
        print(decision.model_dump_json(indent=2))
    else:
        print_plan(result)
    return EXIT_FITS if decision.fits else EXIT_DOES_NOT_FIT


def _ignored_demo_option(args: argparse.Namespace) -> str | None:
    """The error for an option the chosen demo would ignore, or None: ``--oom`` runs only
    the OOM child (its own model, rung, memory cap and steps); ``--rung`` or
    ``--free-memory`` run only the digits run, which takes no ``--steps``."""
    given = {
        "--rung": args.rung,
        "--free-memory": args.free_memory,
        "--epochs": args.epochs,
        "--seed": args.seed,
    }
    if args.oom:
        for option, value in given.items():
            if value is not None:
                return (
                    f"{option} has no effect with --oom (the OOM demo's child trains its own "
                    "model from the policy's rung under a memory cap; --steps sets its length); "
                    f"drop {option}, or --oom to run the digits demo"
                )
    elif args.steps is not None:
        for option in ("--rung", "--free-memory"):
            if given[option] is not None:
                return (
                    f"--steps has no effect with {option} (one digits run, whose length is "
                    "--epochs; --steps is the --oom demo's); drop --steps"
                )
    return None


def _run_demo(args: argparse.Namespace) -> int:
    ignored = _ignored_demo_option(args)
    if ignored is not None:
        print(f"optladder demo: error: {ignored}", file=sys.stderr)
        return EXIT_BAD_INPUT
    epochs = _DEMO_EPOCHS if args.epochs is None else args.epochs
    seed = 0 if args.seed is None else args.seed
    steps = _OOM_STEPS if args.steps is None else args.steps
    single = args.rung is not None or args.free_memory is not None
    try:
        free = None if args.free_memory is None else parse_bytes(args.free_memory, "--free-memory")
        from optladder.demo import run_demo  # torch: only now
        from optladder.oom_demo import run_oom_demo

        if not args.oom:
            run_demo(rung=args.rung, free_memory=free, epochs=epochs, seed=seed)
        if args.oom or not single:
            print("\n== the OOM ladder: a real out-of-memory error on the CPU ==")
            return run_oom_demo(steps=steps)
    except (ValueError, ImportError) as exc:
        print(f"optladder demo: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (module docstring: 0, 1, 2, 3).

    Args:
        argv: the arguments after the program name; None means ``sys.argv[1:]``.
    """
    given = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(_attach_negative_values(given))
    try:
        code = _run_plan(args) if args.command == "plan" else _run_demo(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader closed the pipe (`optladder plan --json | head -1`): stop quietly, as
        # Python's documentation recommends (stdout to devnull, or the flush at exit
        # raises again), with a shell's status for a process ended by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    raise SystemExit(main())
