"""Errors the ``efla`` command line turns into one line and an exit status.

``UsageError``: the command cannot run as given (an option, a path or a file's content is wrong);
exit status 2. ``CheckpointError``: a checkpoint to resume from is damaged or unsafe; exit status 2
(the run did not start). ``RunFailure``: the work started and could not finish; exit status 1.
``NonFiniteValues``: an op's or a layer's input holds NaN or Inf (a ``ValueError``; training catches
it by type to skip or stop at a non-finite step). ``RunWarning``: something a user should know about
a run that goes on; the library warns (``warnings.warn``), the command line prints it as one line.
"""

from __future__ import annotations

__all__ = ["UsageError", "RunFailure", "CheckpointError", "NonFiniteValues", "RunWarning"]


class UsageError(ValueError):
    """The command cannot run as given; the message names the option or file (and line) at fault."""


class RunFailure(RuntimeError):
    """The work started and failed; what was finished is kept."""


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupted (or none can be resumed from)."""


class NonFiniteValues(ValueError):
    """An input holds NaN or Inf; the message names it and counts the values."""


class RunWarning(UserWarning):
    """Something the user should know about a run that goes on (a lock taken over, text repaired)."""
