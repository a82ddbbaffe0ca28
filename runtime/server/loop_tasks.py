"""Count the tasks alive in the running event loop, asyncio or trio: a leak shows as growth."""

from __future__ import annotations

import sniffio


def count_loop_tasks() -> int:
    """Tasks of the current event loop (call it from inside the loop)."""
    if sniffio.current_async_library() == "trio":
        import trio

        # trio keeps no flat list: walk the tree of nurseries from the root task.
        root = trio.lowlevel.current_root_task()
        assert root is not None  # inside a running trio loop
        count, stack = 0, [root]
        while stack:
            task = stack.pop()
            count += 1
            stack.extend(t for nursery in task.child_nurseries for t in nursery.child_tasks)
        return count
    import asyncio

    return len(asyncio.all_tasks())
