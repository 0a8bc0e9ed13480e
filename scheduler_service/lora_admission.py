"""Multi-LoRA admission (vLLM's rule): at most `max_loras` distinct adapters in the running
batch; a waiting request whose adapter would exceed it waits for a slot."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_service.request import Request


def running_loras(running: Iterable[Request]) -> set[int]:
    """The adapter ids of the running batch."""
    return {r.lora_int_id for r in running if r.lora_request is not None}


def lora_fits(request: Request, loras: set[int], max_loras: int) -> bool:
    """Whether `request` may join a batch running `loras`; when it may, its adapter is
    counted in `loras`."""
    lora_id = request.lora_int_id
    if not lora_id or lora_id in loras:
        return True
    if len(loras) >= max_loras:
        return False
    loras.add(lora_id)
    return True
