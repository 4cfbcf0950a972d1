"""Entry point of `lmsys-bench` and `python -m lmsys.bench`: one sub-command per module of lmsys.bench."""

import argparse
import sys

from lmsys.bench import allreduce, attention, ddp, model, ncu, sweep

# Each command is a module with add_arguments(parser) and run(args) -> exit status.
COMMANDS = {"model": model, "attention": attention, "ncu": ncu, "allreduce": allreduce, "ddp": ddp}


def parser() -> argparse.ArgumentParser:
    """The command line: one sub-parser per command, described by its module's docstring."""
    top = argparse.ArgumentParser(prog="lmsys-bench", description=sys.modules["lmsys.bench"].__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        summary = " ".join(module.__doc__.split("\n\n")[0].split()).split(": ", 1)[1]
        sub = commands.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Runs one command; a usage error prints its message and returns 2."""
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except sweep.UsageError as exc:
        print(f"lmsys-bench {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
