"""--help that shows each option's default, as a user deciding what to pass needs to know."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help where it has a default worth showing: not None or
    an empty list (those help texts say what happens), and not where the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is argparse.SUPPRESS or default == []
                or isinstance(default, bool) or not action.option_strings):
            return text
        return f"{text} (default: {default})" if text else f"(default: {default})"
