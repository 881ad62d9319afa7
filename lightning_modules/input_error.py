"""The error of bad input (a file, a bag, a field or a setting the user gave) and how tools report it."""
from __future__ import annotations

import sys
from typing import Any, Callable

from lightning_modules.quiet import quiet_entry_point

__all__ = ["InputError", "find_input_error", "run_reporting_input_errors"]


class InputError(ValueError):
    """Bad input, with a one-line message naming the file, bag, field or setting and what is wrong.

    The command-line tools (``milgp-train``, ``milgp-predict``, the demo) print it as one line,
    without a traceback; in Python it is an ordinary ``ValueError``.
    """


def find_input_error(err: BaseException) -> InputError | None:
    """The :class:`InputError` that caused ``err`` (itself or one in its chain), if any."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, InputError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def run_reporting_input_errors(prog: str, fn: Callable[[], Any]) -> int:
    """Run ``fn`` as the command-line tool ``prog``, with the known warnings of its dependencies
    silenced (:func:`lightning_modules.quiet.quiet_entry_point`): exit status 0, or 2 with
    ``<prog>: error: <message>`` on stderr when bad input stopped it; any other exception keeps its
    traceback."""
    quiet_entry_point()
    try:
        fn()
    except Exception as err:
        found = find_input_error(err)
        if found is None:
            raise
        print(f"{prog}: error: {found}", file=sys.stderr)
        return 2
    return 0
