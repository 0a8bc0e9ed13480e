"""The model runner: SchedulerOutput deltas -> request state -> packed batch -> forward -> sample.

Contract (services.worker_api.WorkerProtocol.execute_model): for each scheduled
request compute tokens [num_computed, num_computed + num_scheduled) of its token
list; sample only when that reaches the end of the list; append the sampled
token to the runner's own copy. Logits are computed only for sampling rows
(and prompt positions whose logprobs were asked for).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from services.config import WorkerConfig
from services.step_types import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SampledTokens,
    SchedulerOutput,
    WorkerTimings,
)
from services.types import TokenLogprobs
from worker_service import kv_cache
from worker_service.attention import get_attention_backend
from worker_service.cpu_kernels import KernelChoice, choose_kernels, read_cpu_info
from worker_service.input_batch import InputBatch, RequestState, StepBatch
from worker_service.loader import load_model
from worker_service.models import cpu_ops
from worker_service.models.context import forward_context
from worker_service.multimodal import MultiModalInputs
from worker_service.parallel import TPGroup
from worker_service.sampler import Sampler
from worker_service.sampling_batch import build_sampling_batch, to_token_logprobs
from worker_service.structured import StructuredOutputs

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ModelRunner:
    """Owns the model, the KV pool, the per-request state and the sampler of one worker."""

    def __init__(
        self, config: WorkerConfig, model_dir: Path, device: torch.device, tp: TPGroup | None = None
    ) -> None:
        self.config, self.device = config, device
        self.tp = tp or TPGroup()  # tensor parallel: this rank's share of the model and KV
        self.dtype = DTYPES[config.model.dtype]
        self.backend = get_attention_backend(config.attention_backend, device)
        self.model = load_model(model_dir, self.dtype, device, self.backend, self.tp)
        if self.dtype == torch.bfloat16 and device.type == "cpu":
            self._use_cpu_kernels(choose_kernels(config.model, read_cpu_info()))
        arch = self.model.config
        self.max_model_len = min(
            config.model.max_model_len or arch.max_positions, arch.max_positions
        )
        self.block_size = config.cache.block_size
        self.spec = kv_cache.make_spec(
            arch, self.block_size, self.dtype, self.model.shard.num_kv_heads
        )
        self.input_batch = InputBatch(
            config.max_num_seqs, self.max_model_len, self.block_size, arch.vocab_size
        )
        self.sampler = Sampler(device, config.model.seed)
        self.structured = StructuredOutputs(model_dir, arch.vocab_size, arch.eos_token_ids)
        self.mm = MultiModalInputs(self.model, self.input_batch)
        self.num_blocks = 0

    def _use_cpu_kernels(self, choice: KernelChoice) -> None:
        """Apply the GEMM and attention choice for a bf16 model on CPU, and log it."""
        if choice.hf_exact:
            self.backend.match_hf_kernels()
        else:
            self.model.pack_linears(torch.float32 if choice.float32_gemms else torch.bfloat16)
            ops = cpu_ops.load()
            if ops is not None:
                self.model.use_cpu_ops(ops)
        kernel = getattr(self.backend, "decode_kernel", False)
        attention = "C++ paged decode kernel" if kernel else "SDPA decode"
        log.info("kernels: %s; decode attention: %s", choice.describe(read_cpu_info()), attention)

    # ----------------------------------------------------------------- cache
    def initialize_cache(self, num_blocks: int) -> int:
        allocated = kv_cache.allocate(self.model, self.spec, num_blocks, self.dtype, self.device)
        self.num_blocks = num_blocks
        return allocated

    def profile_gpu_memory(self, utilization: float) -> int:
        """GPU: run a forward at the largest batch on a throwaway pool; what remains under
        `utilization` of device memory after the peak is the KV budget."""
        tokens = self.config.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        kv_cache.allocate(self.model, self.spec, blocks, self.dtype, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        pool = blocks * self.spec.bytes_per_block
        self._dummy_forward(tokens, blocks)
        peak = torch.cuda.max_memory_allocated(self.device) - pool
        kv_cache.release(self.model)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * utilization) - peak)

    def _dummy_forward(self, tokens: int, blocks: int) -> None:
        batch = InputBatch(1, max(tokens, 1), self.block_size, self.model.config.vocab_size)
        state = batch.add(NewRequestData("profile", [0] * tokens, block_ids=list(range(blocks))))
        step = batch.prepare([state], [tokens], self.device)
        with torch.inference_mode(), forward_context(step.meta):
            hidden = self.model(step.input_ids, step.positions)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ step
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        errors = self._apply_deltas(so)
        order, counts = self._schedule_order(so, errors)
        order, counts = self.mm.encode(order, counts, errors)  # vision encoders, if any
        out = ModelRunnerOutput(step_id=so.step_id, request_errors=errors)
        if not order:
            return out
        step = self.input_batch.prepare(order, counts, self.device)
        self.tp.send_step(step.input_ids, step.positions, step.meta)  # ranks 1..N-1 run it too
        t1 = time.perf_counter()
        with torch.inference_mode(), forward_context(step.meta):
            embeds = self.mm.input_embeds(step)  # None without images in this step
            hidden = self.model(step.input_ids, step.positions, embeds)  # [num_tokens, hidden]
            t2 = time.perf_counter()
            self._sample_into(out, step, hidden)
            out.prompt_logprobs = self._prompt_logprobs(step, hidden)
        for state, n in zip(step.states, counts, strict=True):
            state.num_computed += n
        self.mm.advance(step.states)
        t3 = time.perf_counter()
        out.timings = WorkerTimings(*(1000 * d for d in (t1 - t0, t2 - t1, t3 - t2, t3 - t0)))
        return out

    def _apply_deltas(self, so: SchedulerOutput) -> dict[str, str]:
        """Drop finished/preempted requests, add new ones, apply cached deltas."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.input_batch.remove(req_id)
            self.mm.remove(req_id)
        errors: dict[str, str] = {}
        for new in so.scheduled_new_reqs:
            try:
                state = self.input_batch.add(new)
                self.structured.attach(state, new.output_token_ids)
                self.mm.add(new.request_id, new.mm_inputs, new.num_computed_tokens)
            except ValueError as exc:
                errors[new.request_id] = str(exc)
                self.input_batch.remove(new.request_id)
        for cached in so.scheduled_cached_reqs:
            try:
                self.input_batch.update(cached)
            except ValueError as exc:
                errors[cached.request_id] = str(exc)
        return errors

    def _schedule_order(
        self, so: SchedulerOutput, errors: dict[str, str]
    ) -> tuple[list[RequestState], list[int]]:
        """Scheduled requests, decodes first (the attention backend batches them)."""
        items: list[tuple[RequestState, int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            if req_id in errors:
                continue
            state = self.input_batch.requests.get(req_id)
            try:
                if state is None:
                    raise ValueError(f"request {req_id!r} is scheduled but unknown to this worker")
                self.input_batch.check_schedulable(state, n)
            except ValueError as exc:
                errors[req_id] = str(exc)
                self.input_batch.remove(req_id)
                continue
            items.append((state, n))
        items.sort(key=lambda item: item[1] != 1)
        return [s for s, _ in items], [n for _, n in items]

    def _sample_into(self, out: ModelRunnerOutput, step: StepBatch, hidden: torch.Tensor) -> None:
        """Sample the rows that reached the end of their token list; fill out.req_ids/sampled."""
        out.req_ids = step.req_ids
        out.sampled = [SampledTokens() for _ in step.req_ids]
        if not step.sample_reqs or step.logits_indices is None:
            return
        states = [step.states[i] for i in step.sample_reqs]
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        eos = self.model.config.eos_token_ids
        batch = build_sampling_batch(states, self.input_batch, eos, self.device)
        grammar = self.structured.bitmask(states)
        if grammar is not None:
            rows, mask = grammar
            batch.allowed = (torch.tensor(rows, device=self.device), mask.to(self.device))
        result = self.sampler(logits, batch)
        tokens = result.token_ids.tolist()
        if grammar is not None:
            out.request_errors.update(self.structured.accept(states, tokens))
        logprobs = to_token_logprobs(result, [s.params.logprobs for s in states])
        for i, token, lp in zip(step.sample_reqs, tokens, logprobs, strict=True):
            out.sampled[i] = SampledTokens([token], [lp] if lp is not None else [])
        self.input_batch.append_tokens(states, tokens)

    def _prompt_logprobs(self, step: StepBatch, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Logprobs of the prompt tokens this step's chunk predicts, for requests that asked."""
        results = []
        starts = step.meta.query_start_loc.tolist()
        for i, state in enumerate(step.states):
            k = state.params.prompt_logprobs
            first, end = (
                state.num_computed,
                min(state.num_computed + int(step.num_scheduled[i]), state.prompt_len - 1),
            )
            if k is None or state.resumed or end <= first:
                continue
            rows = torch.arange(starts[i], starts[i] + end - first, device=self.device)
            targets = torch.from_numpy(
                self.input_batch.token_ids[state.row, first + 1 : end + 1]
            ).to(self.device)
            entries = self._logprobs_of(hidden.index_select(0, rows), targets, k)
            results.append(PromptLogprobs(state.req_id, first + 1, entries))
        return results

    def _logprobs_of(
        self, hidden: torch.Tensor, targets: torch.Tensor, k: int
    ) -> list[TokenLogprobs]:
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)  # [n, V]
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        top_lp, top_ids = (
            logprobs.topk(k, dim=-1) if k > 0 else (chosen[:, :0], targets[:, None][:, :0])
        )
        return [
            TokenLogprobs(t, lp, r, ids, lps)
            for t, lp, r, ids, lps in zip(
                targets.tolist(),
                chosen.squeeze(1).tolist(),
                ranks,
                top_ids.tolist(),
                top_lp.tolist(),
                strict=True,
            )
        ]
