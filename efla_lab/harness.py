"""The lab's run services: the library's (:mod:`efla.records`) plus figures (matplotlib) and tables
rendered both to the console (rich) and to Markdown, so the two never disagree."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from efla.records import (
    Provenance,
    atomic_save_torch,
    atomic_write,
    atomic_write_csv,
    atomic_write_json,
    command_line,
    default_device,
    progress_factory,
    read_records,
    recorded,
    versions,
    write_records,
)

__all__ = [
    "Provenance",
    "Table",
    "atomic_save_figure",
    "atomic_save_torch",
    "atomic_write",
    "atomic_write_csv",
    "atomic_write_json",
    "command_line",
    "default_device",
    "files_section",
    "progress_factory",
    "read_records",
    "recorded",
    "versions",
    "write_records",
]


def atomic_save_figure(fig, path: str, dpi: int = 110) -> None:
    """Saves a matplotlib figure atomically and closes it."""
    import matplotlib.pyplot as plt

    root, ext = os.path.splitext(path)
    tmp = f"{root}.{os.getpid()}.tmp{ext}"
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def files_section(names: list[str]) -> list[str]:
    """The Markdown lines a summary ends with: the files its run wrote beside it, by name, and each
    figure among them shown, so that the summary names every file of its directory."""
    figures = [name for name in names if name.endswith(".png")]
    lines = ["", "Files: " + ", ".join(f"`{name}`" for name in names) + "."]
    return lines + [line for name in figures for line in ("", f"![{os.path.splitext(name)[0]}]({name})")]


@dataclass
class Table:
    """Rows of cells under a title; ``right`` names the columns aligned right on the console.

    Cells may carry rich markup (``[red]...[/red]``); Markdown gets the plain text.
    """

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    right: set[int] = field(default_factory=set)
    bold_rows: set[int] = field(default_factory=set)

    def add_row(self, *cells, bold: bool = False) -> None:
        if bold:
            self.bold_rows.add(len(self.rows))
        self.rows.append([str(c) for c in cells])

    def rich(self):
        from rich.table import Table as RichTable  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

        table = RichTable(title=self.title)
        for i, name in enumerate(self.columns):
            table.add_column(name, justify="right" if i in self.right else "left")
        for i, row in enumerate(self.rows):
            table.add_row(*row, style="bold" if i in self.bold_rows else None)
        return table

    def markdown(self) -> list[str]:
        """The table's lines in Markdown (no title: the caller writes the heading it wants)."""
        from rich.text import Text  # noqa: PLC0415 (lazy: the command line's helpers answer before torch loads)

        def plain(cell: str) -> str:
            return Text.from_markup(cell).plain.replace("|", "\\|")

        lines = ["| " + " | ".join(plain(c) for c in self.columns) + " |", "| " + " | ".join("---" for _ in self.columns) + " |"]
        for i, row in enumerate(self.rows):
            cells = [plain(c) for c in row]
            if i in self.bold_rows:
                cells = [f"**{c}**" if c else c for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
        return lines
