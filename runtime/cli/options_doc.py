"""docs/options.md's table of engine options, written from EngineConfig's fields: run
`python -m loomllm.cli.options_doc docs/options.md` (make options-doc); a test checks it."""

from __future__ import annotations

import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from loomllm.config import EngineConfig

BEGIN = "<!-- options table: written by `make options-doc` from EngineConfig -->"
END = "<!-- end of options table -->"


def options_table() -> str:
    """The table's markdown, between its two markers."""
    rows = [BEGIN, "| option | default | meaning |", "|---|---|---|"]
    rows += [_row(option) for option in fields(EngineConfig) if option.name != "model"]
    return "\n".join([*rows, END])


def _row(option: Field[Any]) -> str:
    default = option.metadata["default_text"]
    if not default:
        value = option.default
        default = f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"
    meaning = option.metadata["help"]
    see = option.metadata["see"]
    if see == "below":
        meaning += "; see below"
    elif see:  # an anchor of a section above the table, or another page
        meaning += f" ([{'above' if see.startswith('#') else see}]({see}))"
    cells = [f"`{option.name}`", default, meaning.replace("|", "\\|")]
    return "| " + " | ".join(cells) + " |"


def rewritten(text: str) -> str:
    """`text` (options.md) with its table replaced by the one the fields give."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + options_table() + text[end:]


if __name__ == "__main__":
    page = Path(sys.argv[1])
    page.write_text(rewritten(page.read_text()))
