"""Waiting queues: first come first served, or by (priority, arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Literal, Protocol

from scheduler_service.request import Request


class RequestQueue(Protocol):
    """The waiting queue of the scheduler."""

    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""
        ...

    def prepend(self, request: Request) -> None:
        """Put a preempted request back so it is served before later arrivals."""
        ...

    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""
        ...

    def pop(self) -> Request:
        """Remove and return `peek()`."""
        ...

    def remove(self, request: Request) -> None:
        """Take out a request from anywhere (abort); O(n)."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    """Arrival order; preempted requests go to the front."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)

    def prepend(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityQueue:
    """Smallest (priority, arrival_time) first; a preempted request keeps its place by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*request.sort_key(), next(self._seq), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_queue(policy: Literal["fcfs", "priority"]) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
