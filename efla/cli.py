"""``efla <command>``: builds the parser from the modules of efla.commands and dispatches, turning every
error into one line and an exit status."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import itertools
import sys
import warnings

from efla import environment
from efla.errors import CheckpointError, RunWarning
from efla.records import command_line

# the library's commands, in the order of ``efla --help``; the lab's (``efla demo``, ``efla mad``, ...)
# follow them, found through the ``efla.commands`` entry points so that the library never imports the lab
COMMAND_MODULES = ("train", "eval", "generate", "serve", "convert")
COMMAND_ENTRY_POINTS = "efla.commands"
# what a lab command needs beyond the library, and how to install it
LAB_MODULES = ("matplotlib", "sklearn", "rich")
LAB_EXTRA_HINT = "pip install 'efla[lab]'"


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a command-line mistake in one line, ``efla <command>: <what> (see ... --help)``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class CommandParser(OneLineErrorParser):
    """The parser of ``efla`` itself: an unknown option before the subcommand is its own mistake, reported
    before the subcommand parses the rest (argparse would hand it on and report the subcommand's first
    missing option)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        unknown = [a for a in self._arguments_before_the_command(args) if a.startswith("-") and not self._knows(a)]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def _arguments_before_the_command(self, args: list[str]) -> list[str]:
        commands = {name for action in self._actions if isinstance(action, argparse._SubParsersAction) for name in action.choices}
        return list(itertools.takewhile(lambda arg: arg not in commands, args))

    def _knows(self, arg: str) -> bool:
        option = arg.split("=", 1)[0]
        return any(known.startswith(option) for known in self._option_string_actions)  # argparse takes prefixes


class SubcommandParser(OneLineErrorParser):
    """The parser of one ``efla <command>``: rejects unknown arguments before checking for missing ones, so the
    message names the subcommand (argparse alone reports a missing option first, then the unknown arguments
    as ``efla``'s)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = False  # positionals may follow options (``efla generate MODEL --json PROMPT``)
        self._parsing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._parsing:  # argparse's intermixed parsing calls this method itself
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            args = sys.argv[1:] if args is None else list(args)
            parse = super().parse_known_intermixed_args if self.intermixed else super().parse_known_args
            self._reject_unknown_arguments(parse, args)
            return parse(args, namespace)
        finally:
            self._parsing = False

    def _reject_unknown_arguments(self, parse, args: list[str]) -> None:
        with _nothing_required(self):
            _, unknown = parse(args, None)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")


@contextlib.contextmanager
def _nothing_required(parser: argparse.ArgumentParser):
    """Lets ``parser`` parse without its required arguments and groups (restored on leaving)."""
    required = [a for a in parser._actions if a.required] + [g for g in parser._mutually_exclusive_groups if g.required]
    for item in required:
        item.required = False
    try:
        yield
    finally:
        for item in required:
            item.required = True


def installed_version() -> str:
    """The version of the installed ``efla`` distribution, else ``efla.__version__`` (a source checkout)."""
    try:
        return importlib.metadata.version("efla")
    except importlib.metadata.PackageNotFoundError:
        import efla

        return getattr(efla, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="efla",
        description="Exact Flow Linear Attention: train, evaluate, generate with and serve EFLA models; the paper's experiments.",
        epilog="Errors are reported in one line; EFLA_DEBUG=1 or --debug shows the traceback.",
    )
    p.add_argument(
        "--version", action="version", version=f"efla {installed_version()}", help="print the installed efla version and exit"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"efla.commands.{name}").add_parser(sub)
    for entry_point in importlib.metadata.entry_points(group=COMMAND_ENTRY_POINTS):
        _add_installed_command(entry_point, sub)
    _record_given_options(p)
    return p


def _add_installed_command(entry_point, sub) -> None:
    """One installed command (the lab's); one that cannot load is named on stderr and left out, so the
    others, ``efla --help`` included, still run."""
    try:
        entry_point.load()(sub)
    except Exception as error:  # noqa: BLE001 - any fault of another package's command stays its own
        print(f"efla: the command {entry_point.name!r} ({entry_point.value}) cannot load: {error}", file=sys.stderr)


def _add_debug_option(parser) -> None:
    for sub in _subparsers(parser):
        sub.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the full traceback of an error (same as EFLA_DEBUG=1)",
        )


def _record_given_options(parser) -> None:
    """Each option of every subcommand adds its ``dest`` to ``args.given_options`` when it is on the command
    line, so a command can tell a value given (even equal to its default) from a default: ``--resume``
    keeps the saved settings the command line does not give, and a given value that the chosen mode
    would ignore is refused (:func:`efla.arg_checks.not_ignored`)."""
    for sub in _subparsers(parser):
        sub.set_defaults(given_options=())
        for action in sub._actions:
            if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                action.__class__ = _recording(type(action))


@functools.cache
def _recording(action_class):
    class Recording(action_class):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            if self.dest not in namespace.given_options:
                namespace.given_options = (*namespace.given_options, self.dest)

    return Recording


def _subparsers(parser) -> list:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices.values()) if actions else []


def _debug_wanted(args) -> bool:
    return bool(getattr(args, "debug", False)) or environment.get("EFLA_DEBUG")


_USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)  # UsageError is a ValueError
_RUN_FAILURES = (OSError, RuntimeError, ImportError, EOFError)


def exit_status_and_message(error: BaseException) -> tuple[int, str]:
    """Exit status (2: the command cannot run as given, 1: the work failed) and the one-line message.
    A damaged checkpoint counts as a wrong input (2): the run did not start."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, ModuleNotFoundError) and error.name in LAB_MODULES:
        return 1, f"{text} (the lab's commands need its extra: {LAB_EXTRA_HINT})"
    if isinstance(error, (*_USAGE_ERRORS, CheckpointError)):
        return 2, text
    if isinstance(error, _RUN_FAILURES):
        return 1, text
    return 1, f"{type(error).__name__}: {text} (an unexpected error; EFLA_DEBUG=1 or --debug shows the traceback)"


def _one_line_warnings(command: str, show_others):
    """``warnings.showwarning`` for a command: a ``RunWarning`` as ``efla <command>: warning: <text>``
    on stderr, every other warning as Python shows it."""

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, RunWarning):
            print(f"efla {command}: warning: {message}", file=sys.stderr)
        else:
            show_others(message, category, filename, lineno, file, line)

    return show


def main(argv=None) -> int:
    environment.reload()  # each command reads the environment as it is when the command starts
    parser = build_parser()
    _add_debug_option(parser)
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    try:
        debug = _debug_wanted(args)
    except ValueError as error:  # a mistyped EFLA_DEBUG
        print(f"efla {args.command}: {error} (EFLA_DEBUG)", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", RunWarning)
            warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
            return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"efla {args.command}: interrupted; what was finished is kept", file=sys.stderr)
        return 130
    except Exception as error:  # every error ends as one line unless a traceback is asked for
        if debug:
            raise
        status, message = exit_status_and_message(error)
        print(f"efla {args.command}: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
