"""The process's model thread (worker_service.model_thread): whoever calls a worker, its torch
work runs on one thread, so that OpenMP keeps one team of threads."""

from __future__ import annotations

import threading

import pytest

from worker_service.model_thread import ModelThread, model_thread, on_model_thread


class Probe:
    """An object with a model thread and one method that reports where it ran."""

    def __init__(self, thread: ModelThread) -> None:
        self.thread = thread

    @on_model_thread
    def where(self, tag: str) -> tuple[str, int]:
        return tag, threading.get_ident()


def test_one_model_thread_per_process_and_not_the_caller() -> None:
    thread = model_thread()
    assert model_thread() is thread
    ident = thread.call(threading.get_ident)
    assert ident != threading.get_ident()
    assert Probe(thread).where("x") == ("x", ident)  # a decorated method hops to it
    outside = threading.Thread(target=lambda: seen.append(Probe(thread).where("y")[1]))
    seen: list[int] = []
    outside.start()
    outside.join()
    assert seen == [ident]  # from any thread


def test_work_queued_from_the_thread_itself_runs_at_once() -> None:
    """A step submitted from the model thread (an engine loop running there) would wait
    behind its own caller for ever if it were queued."""
    thread = ModelThread()
    assert thread.call(lambda: thread.submit(lambda: 5).result(timeout=5)) == 5
    failed = thread.call(lambda: thread.submit(lambda: 1 // 0))
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=5)
    probe = Probe(thread)
    assert thread.call(probe.where, "nested")[1] == thread.call(threading.get_ident)
