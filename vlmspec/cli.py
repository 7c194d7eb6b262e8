"""The ``vlmspec`` command: generate, demo, serve, profile, simulate.

Every subcommand is a thin layer over the library; ``vlmspec COMMAND --help`` lists its options.
This module assembles the parser and runs the command; the subcommands live in :mod:`vlmspec.commands`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vlmspec.commands.export import add_export
from vlmspec.commands.generate import add_demo, add_generate
from vlmspec.commands.options import DRAFTER_HELP, TARGET_HELP
from vlmspec.commands.serve import add_serve
from vlmspec.commands.sps import add_profile, add_simulate


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"vlmspec {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlmspec",
        description="Lossless speculative decoding for Qwen-VL models.",
        epilog=f"--target: {TARGET_HELP}. --drafter: {DRAFTER_HELP}. Try: vlmspec demo",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate(commands)
    add_demo(commands)
    add_serve(commands)
    add_profile(commands)
    add_simulate(commands)
    add_export(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
