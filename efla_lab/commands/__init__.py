"""The lab's subcommands of ``efla``, registered under the ``efla.commands`` entry points: each module
defines ``add_parser(subparsers)``, as the library's commands do."""
