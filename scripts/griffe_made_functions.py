"""A Griffe extension for the API reference (mkdocs.yml): functions that a module makes at import.

``efla.ops`` makes its ops with a factory (one function per rule and form, its docstring filled in
from one template), so Griffe's static analysis sees only assignments without a signature or a
docstring. For the module paths named in mkdocs.yml, this swaps each such assignment for the
function Griffe finds by importing that one module; every other module stays static, so the build
imports only what ``import efla.ops`` imports (not the GPU kernels, not the server's dependencies).
"""

from __future__ import annotations

import sys

import griffe

logger = griffe.get_logger("efla_made_functions")


class MadeFunctions(griffe.Extension):
    def __init__(self, modules: list[str]) -> None:
        self.modules = set(modules)

    def on_module_members(self, *, mod: griffe.Module, agent: griffe.Visitor, **kwargs) -> None:
        if mod.path not in self.modules:
            return
        # the checkout first, then the interpreter's own paths, where torch and the rest are installed
        checkout = mod.package.filepath.parent.parent
        inspected = griffe.inspect(
            mod.path,
            filepath=mod.filepath,
            import_paths=[checkout, *sys.path],
            docstring_parser=agent.docstring_parser,
            docstring_options=agent.docstring_options,
        )
        made = [
            name
            for name, member in mod.members.items()
            if not member.is_alias and member.is_attribute and name in inspected.members and inspected.members[name].is_function
        ]
        if not made:
            logger.warning(f"{mod.path}: no function made at import; drop it from this extension's modules in mkdocs.yml")
        for name in made:
            mod.set_member(name, inspected.members[name])
