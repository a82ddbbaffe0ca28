"""The one exception a user sees when several tasks of the engine, or of a batch, fail."""

from __future__ import annotations

from collections.abc import Iterator

from loomllm.errors import EngineDeadError


def simplest(eg: BaseExceptionGroup, each: str = "requests") -> BaseException:
    """The engine's death first; else the error every leaf shares (a lone one, or one that
    failed all of `each` alike, which a note counts); else the group itself."""
    leaves = list(_leaves(eg))
    for leaf in leaves:
        if isinstance(leaf, EngineDeadError):
            return leaf
    first = leaves[0]
    if any(type(e) is not type(first) or str(e) != str(first) for e in leaves[1:]):
        return eg
    if len(leaves) > 1:
        first.add_note(f"({len(leaves)} {each} failed with this same error)")
    return first


def _leaves(eg: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in eg.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
