"""The ``optladder`` command line: ``optladder demo`` and ``optladder plan``."""

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
    demo.add_argument("--rung", type=str.lower, choices=RUNGS, help="pin a rung")
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
        help="free bytes of one target device, e.g. 80GiB (default: probed; the device must "
        "then be present)",
    )
    plan.add_argument(
        "--world-size", type=int, default=1, help="ranks sharing the state (default 1)"
    )
    plan.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="param dtype (default float32; --model: the factory's own)",
    )
    plan.add_argument(
        "--rung", type=str.lower, choices=RUNGS, help="pin a rung, past the memory gate"
    )
    plan.add_argument(
        "--policy-fraction", type=float, help="the memory gate's fraction, in (0, 1] (default 0.25)"
    )
    plan.add_argument(
        "--proactive-min-params",
        help="params from which bf16 is chosen where it is fused (default 50,000,000)",
    )
    plan.add_argument("--json", action="store_true", help="print the decision as JSON only")


def _run_plan(args: argparse.Namespace) -> int:
    from optladder.plan import make_plan, parse_count, print_plan
    from optladder.policies import Policy

    try:
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
        result = make_plan(
            params=args.params,
            model_config=args.model_config,
            model=args.model,
            device=args.device,
            free_memory=args.free_memory,
            world_size=args.world_size,
            dtype=args.dtype,
            policy=Policy.model_validate(fields),
            rung=args.rung,
        )
    except (ValueError, ImportError) as exc:
        print(f"optladder plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(result.decision.model_dump_json(indent=2))
    else:
        print_plan(result)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input)."""
    args = _parser().parse_args(argv)
    if args.command == "plan":
        return _run_plan(args)
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
