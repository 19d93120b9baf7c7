"""How `moe-serve --help` shows defaults."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" suffix, left off where it would mislead or say nothing.

    A switch has no value to default: `--external-workers` (store_false) would read "(default: True)",
    the value of the setting it turns off. A default of None means "not set", which the flag's help
    already explains (e.g. "default: a free one").
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0 or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)
