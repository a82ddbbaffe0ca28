"""The models a server may serve: those named at its start, on the command line (`NAME=MODEL`)
or in a TOML models file, each with its engine options, and the names clients send for them."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loomllm.config import EngineConfig

ENGINE_OPTIONS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model a server may load: `name` is what clients send, `model` what Engine loads."""

    name: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    # Named at the server's start (loaded then, and the server fails with it for good);
    # else found later (a hub model in the HF cache) and loaded on demand.
    at_start: bool = True
    # Its LoRA adapters, each served under its own name: name -> PEFT checkpoint folder.
    loras: dict[str, str] = field(default_factory=dict)


def parse_model_arg(arg: str) -> tuple[str | None, str]:
    """`NAME=MODEL` -> (NAME, MODEL); a bare MODEL -> (None, MODEL).

    An `=` counts only before the first `/`: a path or hub id may hold one further on.
    """
    name, sep, model = arg.partition("=")
    if not sep or "/" in name:
        return None, arg
    if not name or not model:
        raise ValueError(f"a served model is MODEL or NAME=MODEL, got {arg!r}")
    return name, model


def read_models_file(path: Path, defaults: dict[str, Any]) -> list[ModelEntry]:
    """The models of a TOML file, in its order, each a table under `models`:

        [models.smol]
        model = "HuggingFaceTB/SmolLM2-135M-Instruct"
        dtype = "float32"          # any Engine option; the command line's are the defaults

    Raises ValueError naming the file and the entry for anything it cannot use.
    """
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the models file {path}: {exc}") from None
    tables = document.get("models")
    unknown = set(document) - {"models"}
    if unknown or not isinstance(tables, dict) or not tables:
        raise ValueError(
            f"{path}: expected [models.NAME] tables and nothing else"
            + (f", got {sorted(unknown)}" if unknown else "")
        )
    served = []
    for name, table in tables.items():
        if not isinstance(table, dict) or not isinstance(table.get("model"), str):
            raise ValueError(f'{path}: [models.{name}] needs model = "..." (a path or hub id)')
        options = {key: value for key, value in table.items() if key not in ("model", "loras")}
        bad = sorted(set(options) - ENGINE_OPTIONS)
        if bad:
            raise ValueError(f"{path}: [models.{name}] has unknown engine options {bad}")
        loras = table.get("loras", {})
        if not isinstance(loras, dict) or not all(isinstance(v, str) for v in loras.values()):
            raise ValueError(f'{path}: [models.{name}] loras must be a table of name = "path"')
        served.append(ModelEntry(name, table["model"], {**defaults, **options}, True, loras))
    return served


def check_names(models: list[ModelEntry]) -> None:
    """ValueError when two models (or LoRA adapters) share a name, a name ends in Ollama's
    `:latest` tag, or a model with adapters runs without enable_lora."""
    seen: set[str] = set()
    for entry in models:
        for name in [entry.name, *entry.loras]:
            if name in seen:
                raise ValueError(f"two served models are named {name!r}")
            if name.endswith(":latest"):
                raise ValueError(f"a served model's name may not end in ':latest': {name!r}")
            seen.add(name)
        if entry.loras and not entry.options.get("enable_lora"):
            raise ValueError(
                f"model {entry.name!r} has LoRA adapters ({', '.join(entry.loras)}): serve it "
                "with --enable-lora"
            )
