"""`gpn-scale …`: a thin dispatcher. Each area registers its own sub-commands.

Every sub-command lives beside the code it drives, in a `commands` module exposing
`register(subparsers)`; those modules import torch and friends lazily so that
`gpn-scale --help` stays fast. No library module imports this one.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gpn_scale.core.config import ConfigError

# Order = order in `--help`.
COMMAND_MODULES = (
    "gpn_scale.models.commands",  # info
    "data_tools.commands",  # data …
    "gpn_scale.app.commands",  # train, demo, eval (the trainer and evaluation both)
    "gpn_scale.eval.analysis.commands",  # analyze
    "gpn_scale.eval.commands",  # generate (eval's --task / --lm-eval side)
    "gpn_scale.scaling.commands",  # sweep …, fit
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpn-scale",
        description="Train GPN / GPN+M at scale: models, data, training, sweeps, scaling fits. "
        "`gpn-scale COMMAND --help` describes each command, its options and "
        "defaults. Exit status: 0 done, 2 bad input (one line on stderr naming "
        "the setting); `train` also 3 (non-finite stop) and 75 (preempted, "
        "checkpoint saved).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:  # that area has no commands yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    train = (sys.argv[1:] if argv is None else argv)[:1] == ["train"]
    if train:  # first: a preemption signal in the start-up is the trainer's, not fatal
        from gpn_scale.train.signals import install_early, release_early

        install_early()
    try:
        return _main(argv)
    finally:
        if train:
            release_early()


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if args.command is None else 2
        return int(args.func(args) or 0)
    except ConfigError as err:
        from gpn_scale.io.storage import redact_urls

        print(f"gpn-scale: error: {redact_urls(str(err))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gpn-scale sweep plan … | head`: the reader left; so do we
        from gpn_scale.core.pipes import quiet_broken_pipe

        return quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
