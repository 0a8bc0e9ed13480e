"""The encoder budget of one step: how many multimodal placeholder tokens (image
embeddings) the workers may encode in it, so one step never runs an unbounded number of
vision encoders. A prefill chunk that would start an image past the budget is cut just
before that image; the image waits for the next step."""

from __future__ import annotations

from scheduler_service.request import Request


def fit_encoder_budget(
    request: Request, start: int, num_new: int, budget_left: int, budget_total: int
) -> tuple[int, int]:
    """(tokens to schedule, encoder tokens they use) for the chunk [start, start + num_new).

    An item starting inside the chunk is encoded this step and costs its length; an item
    that started before `start` was encoded already. An item larger than the whole budget
    still runs when it is the first encoder work of the step (else it would never run)."""
    used = 0
    end = start + num_new
    for item in request.mm_inputs:
        if item.offset >= end:
            break
        if item.offset < start:
            continue
        fresh_step = budget_left == budget_total and used == 0
        if used + item.length > budget_left and not fresh_step:
            return item.offset - start, used
        used += item.length
    return num_new, used
