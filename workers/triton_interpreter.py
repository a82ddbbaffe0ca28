"""Triton's interpreter (TRITON_INTERPRET=1) without its cost per helper call: the CPU runs.

Under the interpreter, each launch patches `triton.language` for the kernel, and then each
call of a `@triton.jit` helper from inside the kernel patches it again: a scan of the whole
module with `inspect.getmembers`, about 2 ms a call. Our kernels call helpers in their inner
loops (rotation, rounding): skipping it took the fused padded-decode test from 90 s to 71 s.
Inside a launch, the launch's own patches are already in place, and a helper needs
nothing more as long as it reaches triton.language through the same module objects as the
kernel did (one that reaches `tl.core` when the kernel did not still patches, as before).
On a GPU nothing here runs: kernels compile, and helpers are inlined.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def skip_nested_patches() -> bool:
    """Under TRITON_INTERPRET=1, make helper calls inside a launch skip re-patching.

    Returns whether it is in place: False without the interpreter, or with a Triton whose
    interpreter lacks the internals this relies on (then it runs as Triton ships it).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None:
        logger.debug("Triton's interpreter has no _patch_lang: its helper calls stay as shipped")
        return False
    if getattr(patch_lang, "skips_nested", False):
        return True
    lang_modules = (tl, tl.core)
    # The language modules the running launch patched, or None between launches. The
    # interpreter runs a launch start to end on one thread, and launches never nest.
    patched: list[frozenset[int] | None] = [None]

    class LaunchScope:
        """The launch's patches: restoring them also ends the launch."""

        def __init__(self, scope: object) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched[0] = None
            self.scope.restore()  # type: ignore[attr-defined]

    def langs_of(fn: object) -> frozenset[int]:
        found = getattr(fn, "__globals__", {}).values()
        return frozenset(id(m) for m in found if any(m is lang for lang in lang_modules))

    def patch(fn: object) -> object:
        if patched[0] is None:  # a launch: its GridExecutor restores this scope at its end
            scope = LaunchScope(patch_lang(fn))
            patched[0] = langs_of(fn)
            return scope
        if langs_of(fn) <= patched[0]:
            return scope_type()  # a helper of the launch: already patched
        return patch_lang(fn)  # as shipped: the helper drops the scope, its patches stay

    patch.skips_nested = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch
    return True
