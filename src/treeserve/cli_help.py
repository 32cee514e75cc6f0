"""--help that shows each option's default, as a user deciding what to pass needs to know."""
from __future__ import annotations

import argparse


def _worth_showing(action: argparse.Action) -> bool:
    """Options with a default to show: not None or an empty list (their help says what happens), not
    a flag's False, not a positional argument."""
    default = action.default
    return (bool(action.option_strings) and default is not None and default is not argparse.SUPPRESS
            and default != [] and not isinstance(default, bool))


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _worth_showing(action):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """treeserve's parsers: every subcommand's --help shows its defaults (argparse makes a parser's
    subcommands of the parser's own class), options without a help text included (argparse prints
    nothing for those)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None and _worth_showing(action):
            action.help = "(default: %(default)s)"
        return action
