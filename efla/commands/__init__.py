"""Subcommands of ``efla`` that live in their own modules.

Each module here defines ``add_parser(subparsers)`` that adds its subcommand(s) and sets
``func`` (a function taking the parsed args and returning an exit code).
"""
