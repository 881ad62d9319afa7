"""The error of bad input (a file, a bag, a field or a setting the user gave) and how tools report it."""
from __future__ import annotations

import sys
from typing import Any, Callable

from lightning_modules.quiet import quiet_entry_point

__all__ = ["InputError", "run_reporting_input_errors"]


class InputError(ValueError):
    """Bad input, with a one-line message naming the file, bag, field or setting and what is wrong.

    The command-line tools (``milgp-train``, ``milgp-predict``, the demo) print it as one line,
    without a traceback; in Python it is an ordinary ``ValueError``.
    """


def run_reporting_input_errors(prog: str, fn: Callable[[], Any]) -> int:
    """Run ``fn`` as the command-line tool ``prog``, with the known warnings of its dependencies
    silenced (:func:`lightning_modules.quiet.quiet_entry_point`): exit status 0, or 2 with
    ``<prog>: error: <message>`` on stderr when bad input (an :class:`InputError`: the exception
    itself or one in its chain of causes) stopped it; any other exception keeps its traceback."""
    quiet_entry_point()
    try:
        fn()
    except Exception as err:
        found: BaseException | None = err
        while found is not None and not isinstance(found, InputError):
            found = found.__cause__ or found.__context__
        if found is None:
            raise
        print(f"{prog}: error: {found}", file=sys.stderr)
        return 2
    return 0
