"""`ModelThread`: the one thread on which a Worker does its torch work.

OpenMP (torch's intra-op threads, and the C++ kernels' parallel loops) keeps a team of
threads for each thread that calls into it. Once a second thread has called in (the model
loaded on one thread, steps run on another), there are more OpenMP threads than cores, and
libgomp stops spinning between parallel regions: each region then pays for waking its
threads. A default-model decode step has a few hundred regions: on 2 cores batch-1 decode
took 27 ms a step that way, 12.7 ms with one thread doing everything. So every Worker of a
process loads, allocates and executes on the process's ModelThread (`model_thread()`),
whoever calls it; other torch work in the same process (a benchmark's HF reference) should
run there too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ModelThread:
    """A single worker thread that runs what it is given, in order."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._ident = self.executor.submit(threading.get_ident).result()

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on this thread (at once when called on it); waits for it."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """fn(*args, **kwargs) queued on this thread, without waiting (run at once when
        called on it: queued behind its caller it would never start)."""
        if threading.get_ident() != self._ident:
            return self.executor.submit(fn, *args, **kwargs)
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done


@functools.cache
def model_thread() -> ModelThread:
    """This process's ModelThread, started at first use."""
    return ModelThread()


class HasModelThread(Protocol):
    thread: ModelThread


S = TypeVar("S", bound=HasModelThread)


def on_model_thread(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """A method that runs on its object's `thread` (a ModelThread), whoever calls it."""

    @functools.wraps(method)
    def run(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.thread.call(method, self, *args, **kwargs)

    return run
