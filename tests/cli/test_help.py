"""Every option of every sub-command of `gpn-scale` and `gpn-data` says what it does, and
what it defaults to (issue 13, item 8): a test that walks the parsers."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

import data_tools.cli
import gpn_scale.cli


def _walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", argparse.Action([], name, help=helps.get(name))
                yield from _walk(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


ACTIONS = list(_walk(gpn_scale.cli.build_parser(), "gpn-scale")) + list(
    _walk(data_tools.cli.build_parser(), "gpn-data")
)


def _name(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


@pytest.mark.parametrize("where,action", ACTIONS, ids=[f"{w}:{_name(a)}" for w, a in ACTIONS])
def test_every_option_has_a_help_text_naming_its_default(where, action):
    text = action.help
    assert text and text is not argparse.SUPPRESS and text.strip(), (
        f"`{where}` {_name(action)} has no help text"
    )
    default = action.default
    if (
        action.option_strings
        and default not in (None, False, argparse.SUPPRESS)
        and not isinstance(action, (argparse._StoreTrueAction, argparse._AppendAction))
    ):
        value = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        assert "%(default)s" in text or "default" in text.lower() or f"[{value}]" in text, (
            f"`{where}` {_name(action)}: help does not say its default ({default!r}): {text!r}"
        )


def test_the_walk_sees_every_command():
    commands = {w for w, _ in ACTIONS}
    for name in (
        "gpn-scale train",
        "gpn-scale eval",
        "gpn-scale fit",
        "gpn-scale sweep submit",
        "gpn-scale data default-corpus",
        "gpn-scale data train-tokenizer",
        "gpn-data verify",
    ):
        assert name in commands


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_page_renders_and_states_exit_codes_where_they_matter():
    pages = {
        p.prog: p.format_help()
        for root in (gpn_scale.cli.build_parser(), data_tools.cli.build_parser())
        for p in _parsers(root)
    }
    for prog in (
        "gpn-scale",
        "gpn-scale train",
        "gpn-scale eval",
        "gpn-scale fit",
        "gpn-scale data",
        "gpn-data",
        "gpn-scale data verify",
        "gpn-scale sweep",
    ):
        assert "xit" in pages[prog], f"{prog} --help does not state its exit codes"
    assert "(default: none)" in " ".join(
        pages["gpn-scale train"].split()
    ) or "(default: auto)" in " ".join(pages["gpn-scale train"].split())
