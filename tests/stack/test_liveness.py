"""The launcher's liveness rule, on a real child process: a service that has not answered yet
is starting (never killed); once it has answered, LIVENESS_MISSES misses in a row kill it."""

from __future__ import annotations

import sys

from tessera.launcher import LIVENESS_MISSES, Service


def test_misses_count_only_after_a_first_answer_and_kill_after_enough() -> None:
    answers = iter([False] * 5 + [True] + [False] * (LIVENESS_MISSES - 1) + [True] + [False] * 9)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    service = Service("sleeper", sleeper, ready=lambda: True, up=lambda: next(answers))
    service.start()
    try:
        assert service.process is not None
        outcomes = [service.check_liveness() for _ in range(5)]  # starting up: never killed
        assert outcomes == [False] * 5 and service.misses == 0
        assert not service.check_liveness() and service.answered
        outcomes = [service.check_liveness() for _ in range(LIVENESS_MISSES - 1)]
        assert not any(outcomes) and service.alive()  # one short of the limit
        assert not service.check_liveness() and service.misses == 0  # an answer resets
        outcomes = [service.check_liveness() for _ in range(LIVENESS_MISSES)]
        assert outcomes == [False] * (LIVENESS_MISSES - 1) + [True]
        assert service.process.wait(5) == -9
        assert not service.check_liveness()  # a dead process is the supervisor's business
    finally:
        service.stop(5)
