"""Errors the ``efla`` command line turns into one line and an exit status.

``UsageError``: the command cannot run as given (an option, a path or a file's content is wrong);
exit status 2. ``RunFailure``: the work started and could not finish; exit status 1.
"""

from __future__ import annotations

__all__ = ["UsageError", "RunFailure"]


class UsageError(ValueError):
    """The command cannot run as given; the message names the option or file (and line) at fault."""


class RunFailure(RuntimeError):
    """The work started and failed; what was finished is kept."""
