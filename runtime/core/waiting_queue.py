"""The scheduler's waiting queue, by policy (choices.SCHEDULING_POLICIES): "fcfs" (arrival
order, a preempted request first again) or "priority" (vLLM's: lower `priority` first, then
earlier arrival), and the running request that policy gives up first when KV blocks run out.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from loomllm.core.request import Request


class FcfsQueue:
    """Arrival order; a preempted request goes back to the front (it came first)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def drop_finished(self) -> None:
        self._queue = deque(r for r in self._queue if not r.is_finished)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """The running request preempted first: the newest."""
        return running[-1]


class PriorityQueue:
    """Lower `priority` first, then earlier arrival, then order of intake (a request's n
    children arrive together); a preempted request takes its own place again."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        if request.queue_order is None:
            request.queue_order = next(self._counter)
        entry = (request.priority, request.arrival_time, request.queue_order, request)
        heapq.heappush(self._heap, entry)

    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def drop_finished(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[3].is_finished]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """The running request preempted first: the lowest priority, the latest arrival of
        those, the last admitted of those."""
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))


def waiting_queue(policy: str) -> FcfsQueue | PriorityQueue:
    """The queue of a policy in SCHEDULING_POLICIES (SchedulerConfig checked it)."""
    return PriorityQueue() if policy == "priority" else FcfsQueue()
