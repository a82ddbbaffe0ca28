"""Triton's interpreter (TRITON_INTERPRET=1) without three of its per-call costs, for CPU runs.

On a GPU nothing here runs: kernels compile, and helpers are inlined.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

logger = logging.getLogger(__name__)


def skip_nested_patches() -> bool:
    """Under TRITON_INTERPRET=1, make helper calls inside a launch skip re-patching.

    Each launch patches `triton.language` for the kernel, and each call of a `@triton.jit`
    helper inside it patches it again with a scan of the whole module; our kernels call helpers
    in their inner loops, and Triton's own (tl.max, tl.sum) are calls too.

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
    # Kernels and helpers reach triton.language as `tl` or as `tl.core` (Triton's own helpers,
    # such as tl.max, do): each launch patches both, and restores both at its end.
    languages = SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    launching = [False]  # the interpreter runs one launch at a time, start to end

    class LaunchScope:
        """The launch's patches: restoring them also ends the launch."""

        def __init__(self, scope: object) -> None:
            self.scope = scope

        def restore(self) -> None:
            launching[0] = False
            self.scope.restore()  # type: ignore[attr-defined]

    def patch(fn: object) -> object:
        if launching[0]:
            return scope_type()  # a helper inside the launch: patched already
        scope = LaunchScope(patch_lang(languages))  # a launch: its GridExecutor restores it
        launching[0] = True
        return scope

    patch.skips_nested = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch
    return True


def cache_dtype_lookups() -> bool:
    """Under TRITON_INTERPRET=1, look Triton's dtypes up in a table built once, because the
    interpreter's own lookup builds its dict anew on each call (each cast, splat and masked
    load).

    Returns whether it is in place, as `skip_nested_patches` does.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime import interpreter

    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        logger.debug("Triton's interpreter has no _get_np_dtype: its lookups stay as shipped")
        return False
    if getattr(lookup, "cached", False):
        return True
    by_name: dict[str, object] = {}  # a scalar dtype's name is what its equality compares

    def get_np_dtype(tt_dtype: object) -> object:
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return lookup(tt_dtype)
        found = by_name.get(tt_dtype.name)  # type: ignore[attr-defined]
        if found is None:
            found = by_name[tt_dtype.name] = lookup(tt_dtype)  # type: ignore[attr-defined]
        return found

    get_np_dtype.cached = True  # type: ignore[attr-defined]
    get_np_dtype.__wrapped__ = lookup  # type: ignore[attr-defined]
    interpreter._get_np_dtype = get_np_dtype
    return True


def skip_dead_overflow_checks() -> bool:
    """Under TRITON_INTERPRET=1 without Triton's debug mode, stop the interpreter computing
    integer-overflow checks that nothing reads: each int32 add, sub and mul is redone in int64
    and compared with int32's bounds, and then the assert that would read the comparison is
    dropped, as it is outside debug mode (compiled for a GPU, the same checks are dead code).

    Returns whether it is in place; with debug on, the checks stay, and assert.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or options.debug:
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)  # type: ignore[union-attr]
    return True
