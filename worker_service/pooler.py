"""Pooling of embedding requests across prefill chunks (vLLM's Pooler, chunk by chunk).

An embedding request is prefill only. Each step it computes a chunk of its prompt, and
what its pooling needs is kept on its RequestState: the running float32 sum and count
(MEAN), the running maximum (MAX), the first row (CLS); LAST reads the final row of the
last chunk. When the chunk reaches the end of the prompt the vector is finished:
truncated to `dimensions` (Matryoshka), L2-normalized when asked, sent back as
little-endian float32 bytes. Its rows are taken out of the step's sampling rows, so no
logits are computed for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.pooling import PoolerConfig
from services.step_types import PooledOutput
from worker_service.input_batch import RequestState, StepBatch


class Pooler:
    """Pools the embedding requests of a step; the model's pooling comes from `config`."""

    def __init__(self, config: PoolerConfig | None) -> None:
        self.config = config  # None: the worker runs the generate runner

    def check(self, state: RequestState) -> None:
        """ValueError for an embedding request this worker cannot pool."""
        if self.config is None:
            raise ValueError(
                "this model runs the generate runner; embeddings need --runner pooling"
            )
        dims = state.pooling.dimensions if state.pooling is not None else None
        if dims is not None and self.config.hidden_size and dims > self.config.hidden_size:
            raise ValueError(f"dimensions ({dims}) exceed the hidden size")

    def run(self, step: StepBatch, hidden: torch.Tensor) -> list[PooledOutput]:
        """Fold this step's rows into each embedding request's pool; the finished vectors.
        Drops the embedding rows from `step.sample_reqs` / `step.logits_indices`."""
        assert self.config is not None
        outputs = []
        start = 0
        for state, n in zip(step.states, step.meta.query_lens_cpu, strict=True):
            if state.pooling is not None:
                rows = hidden[start : start + n]  # [n, hidden]
                if self._fold(state, rows):
                    outputs.append(PooledOutput(state.req_id, self._finish(state)))
            start += n
        self._drop_from_sampling(step)
        return outputs

    def _fold(self, state: RequestState, rows: torch.Tensor) -> bool:
        """Add `rows` (positions num_computed.. of the prompt) to the pool; True at the end."""
        kind, n = self.config.pooling_type if self.config else "LAST", rows.shape[0]
        last = state.num_computed + n >= state.num_tokens
        if kind == "MEAN":
            total = rows.float().sum(0)  # [hidden]
            state.pooled = total if state.pooled is None else state.pooled + total
        elif kind == "MAX":
            peak = rows.float().amax(0)  # [hidden]
            state.pooled = peak if state.pooled is None else torch.maximum(state.pooled, peak)
        elif kind == "CLS" and state.num_computed == 0:
            state.pooled = rows[0].float().clone()
        elif kind == "LAST" and last:
            state.pooled = rows[-1].float()
        return last

    def _finish(self, state: RequestState) -> bytes:
        assert self.config is not None and state.pooling is not None
        vector = state.pooled  # [hidden] float32
        if self.config.pooling_type == "MEAN":
            vector = vector / state.num_tokens
        params = state.pooling
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, p=2, dim=0)
        state.pooled = None
        out: bytes = vector.to("cpu", torch.float32).numpy().astype("<f4").tobytes()
        return out

    @staticmethod
    def _drop_from_sampling(step: StepBatch) -> None:
        keep = [j for j, i in enumerate(step.sample_reqs) if step.states[i].pooling is None]
        if len(keep) == len(step.sample_reqs):
            return
        if step.logits_indices is not None and keep:
            index = torch.tensor(keep, device=step.logits_indices.device)
            step.logits_indices = step.logits_indices.index_select(0, index)
        else:
            step.logits_indices = None
        step.sample_reqs = [step.sample_reqs[j] for j in keep]
