"""`gpn-data …`: the same commands as `gpn-scale data …`."""

from __future__ import annotations

import argparse
import sys

from data_tools.commands import add_data_commands
from gpn_scale.data.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpn-data",
        description="Text -> tokens -> packed windows -> MDS shards (+ metadata, verify); "
        "local directories or s3://bucket/prefix. Exit status: 0 done, 2 bad "
        "input or bad data (one line on stderr), 130 interrupted.",
    )
    add_data_commands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except DataError as err:
        from gpn_scale.io.storage import redact_urls

        print(f"gpn-data: error: {redact_urls(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpn-data: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gpn-data inspect … | head`
        from gpn_scale.core.pipes import quiet_broken_pipe

        return quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
