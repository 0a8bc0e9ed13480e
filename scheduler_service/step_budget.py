"""The per-step token budget from a TPOT target (`--target-tpot-ms`), learned online.

A step that carries decodes delays each of them by its whole duration, so a
large prefill chunk in it stalls every running stream. With a target, the
prefill tokens a step with decodes may carry are the most whose predicted step
time stays within the target:

    step_time ~ a + b * decode_tokens + c * prefill_tokens

fitted by exponentially weighted least squares (a small ridge keeps the 3x3
system solvable while a feature does not vary) over the step times the engine
observes. The budget never falls below `MIN_PREFILL_CHUNK` (prompts always
progress), never cuts decodes (they are scheduled before the budget is set),
never exceeds `max_num_batched_tokens`, and is the cap itself for a step with
no decodes (nobody's TPOT to protect) or while the model has not learned a
positive per-prefill-token cost. Pure Python: the scheduler imports no torch.
"""

from __future__ import annotations

import logging

from services.step_types import SchedulerOutput

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 64  # prefill tokens a step with decodes may always carry
_DECAY = 0.97  # weight of the past per observation: about 30 steps of memory
_RIDGE = 1e-4  # on the scaled features, so an unvaried feature keeps a solvable system
_SCALE = (1.0, 1 / 64, 1 / 512)  # features [1, decode, prefill] brought near 1
_LOG_EVERY = 1024  # steps between two log lines of the fitted costs


class StepCostModel:
    """Exponentially weighted least squares fit of step seconds on [1, decode, prefill]."""

    def __init__(self) -> None:
        self._xtx = [[0.0] * 3 for _ in range(3)]  # decayed sum of x x^T (scaled features)
        self._xty = [0.0] * 3  # decayed sum of x * seconds
        self.coef = (0.0, 0.0, 0.0)  # seconds per (step, decode token, prefill token)
        self.num_observed = 0

    def observe(self, num_decode: int, num_prefill: int, seconds: float) -> None:
        """Fold in one step's time and refit."""
        x = [s * v for s, v in zip(_SCALE, (1.0, num_decode, num_prefill), strict=True)]
        for i in range(3):
            self._xty[i] = _DECAY * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(3):
                row[j] = _DECAY * row[j] + x[i] * x[j]
        self.num_observed += 1
        ridged = [
            [v + _RIDGE * (i == j) for j, v in enumerate(row)] for i, row in enumerate(self._xtx)
        ]
        scaled = _solve(ridged, self._xty)
        self.coef = (scaled[0] * _SCALE[0], scaled[1] * _SCALE[1], scaled[2] * _SCALE[2])

    def predict(self, num_decode: int, num_prefill: int) -> float:
        a, b, c = self.coef
        return a + b * num_decode + c * num_prefill


class StepBudget:
    """Prefill tokens allowed in a step, from a TPOT target and the learned step costs."""

    def __init__(self, target_tpot_ms: float, num_spec_tokens: int = 0) -> None:
        self.target_s = target_tpot_ms / 1000
        self.max_decode_tokens = 1 + num_spec_tokens  # a request given more is prefilling
        self.model = StepCostModel()

    @property
    def enabled(self) -> bool:
        return self.target_s > 0

    def prefill_budget(self, num_decode: int, budget_left: int) -> int:
        """The step's budget left for prefill chunks once its `num_decode` decode tokens are in."""
        if not self.enabled or num_decode == 0:
            return budget_left
        a, b, c = self.model.coef
        if c <= 0:
            return budget_left  # no prefill cost learned yet: the cap, as without a target
        # noisy step times can fit a negative part; a step never gets cheaper with more work
        fits = int((self.target_s - max(a, 0.0) - max(b, 0.0) * num_decode) / c)
        return min(budget_left, max(fits, MIN_PREFILL_CHUNK))

    def observe(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Learn from a committed step: its decode / prefill tokens and how long it took."""
        if not self.enabled or not scheduler_output.total_num_scheduled_tokens:
            return
        num_decode = num_prefill = 0
        for num_tokens in scheduler_output.num_scheduled_tokens.values():
            if num_tokens <= self.max_decode_tokens:
                num_decode += num_tokens
            else:
                num_prefill += num_tokens
        self.model.observe(num_decode, num_prefill, seconds)
        if self.model.num_observed % _LOG_EVERY == 1:
            a, b, c = (1000 * v for v in self.model.coef)
            log.info("step cost: %.1f ms + %.3f ms/decode + %.4f ms/prefill token", a, b, c)


def _solve(m: list[list[float]], y: list[float]) -> list[float]:
    """x with m x = y, m 3x3 (Cramer's rule); zeros where m is singular."""
    det = _det3(m)
    if abs(det) < 1e-18:
        return [0.0, 0.0, 0.0]
    out = []
    for k in range(3):
        mk = [[y[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]
        out.append(_det3(mk) / det)
    return out


def _det3(m: list[list[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )
