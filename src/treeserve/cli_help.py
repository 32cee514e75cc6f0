"""--help that shows each option's default, as a user deciding what to pass needs to know."""
from __future__ import annotations

import argparse
import difflib


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

    def parse_args(self, args=None, namespace=None):
        """An argument no parser took is reported by the subcommand it was given to, with that
        subcommand's usage and the option it most resembles: argparse reports it from the top parser
        (`treeserve: error: unrecognized arguments: --modle`, under `treeserve`'s usage)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = _chosen_subcommand(self, parsed)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}{_suggestion(chosen, extras)}")
        return parsed


def _chosen_subcommand(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that `parsed` went through (`treeserve gateway keys create`'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _chosen_subcommand(chosen, parsed)
    return parser


def _suggestion(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """"; did you mean --model?" for the first unknown option close to one of the parser's."""
    options = [name for action in parser._actions for name in action.option_strings]
    for extra in extras:
        if extra.startswith("-"):
            close = difflib.get_close_matches(extra.partition("=")[0], options, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""
