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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from services.config import SpeculativeConfig, WorkerConfig
from services.pooling import read_pooler_config
from services.step_types import (
    KVCacheSpec,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SampledLogprobs,
    SchedulerOutput,
    WorkerTimings,
)
from services.types import TokenLogprobs
from worker_service import kv_cache
from worker_service.attention import get_attention_backend
from worker_service.batch_invariant import make_batch_invariant
from worker_service.cpu_kernels import KernelChoice, choose_kernels, read_cpu_info
from worker_service.draft_model import DraftModelProposer
from worker_service.input_batch import InputBatch, RequestState, StepBatch
from worker_service.loader import load_model
from worker_service.lora.manager import LoRAManager
from worker_service.models import cpu_ops, fused_decode
from worker_service.models.context import forward_context
from worker_service.models.quant_int4 import quantize_at_load
from worker_service.multimodal import MultiModalInputs
from worker_service.parallel import TPGroup
from worker_service.pooler import Pooler
from worker_service.prequantized import check_quantization
from worker_service.rejection_sampler import rejection_sample
from worker_service.sampler import Sampler
from worker_service.sampling_batch import build_sampling_batch, to_token_logprobs
from worker_service.spec_decode import NgramProposer, can_speculate
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
        self.tp.expert_parallel = config.parallel.enable_expert_parallel
        check_quantization(model_dir, config.model.quantization)  # vs an AWQ / GPTQ checkpoint
        self.model = load_model(model_dir, self.dtype, device, self.backend, self.tp)
        model_cfg = config.model
        if done := quantize_at_load(
            self.model, model_cfg.quantization, model_cfg.quantization_group_size
        ):
            log.info("weights: %s (weight-only)", done)
        if self.dtype == torch.bfloat16 and device.type == "cpu":
            self._use_cpu_kernels(choose_kernels(config.model, read_cpu_info()))
        if config.model.deterministic:
            make_batch_invariant(self.model, self.backend, device)
        arch = self.model.config
        self.max_model_len = min(
            config.model.max_model_len or arch.max_positions, arch.max_positions
        )
        self.block_size = config.cache.block_size
        self.spec = kv_cache.make_spec(
            arch,
            self.block_size,
            self.dtype,
            self.model.shard.num_kv_heads,
            config.cache.cache_dtype,
        )
        self.input_batch = InputBatch(
            config.max_num_seqs,
            self.max_model_len,
            self.block_size,
            arch.vocab_size,
            rotate_whole_sequence=self.spec.rope_recompute_length > 0,
        )
        self.sampler = Sampler(device, config.model.seed)
        self.structured = StructuredOutputs(model_dir, arch.vocab_size, arch.eos_token_ids)
        self.mm = MultiModalInputs(self.model, self.input_batch)
        pooling = config.model.runner == "pooling"
        self.pooler = Pooler(read_pooler_config(model_dir) if pooling else None)
        self.lora = self._lora_manager()
        # The model's forward, or a FusedDecode over it once the KV pools exist.
        self.forward: Callable[..., torch.Tensor] = self.model
        self.num_blocks = 0
        self.proposer, self.draft = self._proposer(config.speculative_config)

    def _proposer(
        self, spec: SpeculativeConfig | None
    ) -> tuple[NgramProposer | DraftModelProposer | None, DraftModelProposer | None]:
        """Speculative decoding: the proposer, and it again when it is a draft model."""
        if spec is None:
            return None, None
        if spec.method == "ngram":
            return NgramProposer(spec, self.max_model_len), None
        if self.tp.size > 1:
            raise ValueError("a draft model with tensor parallelism is not supported")
        arch = self.model.config
        draft = DraftModelProposer(
            spec, arch.vocab_size, self.dtype, self.device, self.backend, self.block_size,
            self.max_model_len,
        )  # fmt: skip
        return draft, draft

    @property
    def kv_spec(self) -> KVCacheSpec:
        """What one block costs on this worker: the target's pool, and the draft's."""
        return self.spec if self.draft is None else self.draft.combined(self.spec)

    def _lora_manager(self) -> LoRAManager | None:
        """Adapter slots wired into the model when LoRA is on (tensor parallel refuses it)."""
        if not self.config.lora.enable_lora:
            return None
        if self.tp.size > 1:
            raise ValueError("LoRA with tensor parallelism is not supported yet")
        return LoRAManager(self.model, self.config.lora, self.device, self.dtype)

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
        engine = getattr(self.backend, "prefill_kernel", None)  # "tiles" / "dots" / None
        prefill = f"C++ prefill kernel ({engine})" if engine else "SDPA prefill"
        log.info("kernels: %s; %s; %s", choice.describe(read_cpu_info()), attention, prefill)

    # ----------------------------------------------------------------- cache
    def initialize_cache(self, num_blocks: int) -> int:
        allocated = kv_cache.allocate(self.model, self.spec, num_blocks, self.dtype, self.device)
        if self.draft is not None:
            allocated += self.draft.allocate(num_blocks)
        self.num_blocks = num_blocks
        rows = self.config.fused_decode_rows if self.lora is None else 0  # LoRA: per layer
        self.forward = fused_decode.build(self.model, self.backend, rows) or self.model
        return allocated

    def release_cache(self) -> None:
        """Drop the KV pools (target and draft)."""
        kv_cache.release(self.model)
        self.forward = self.model
        if self.draft is not None:
            self.draft.release()
        self.num_blocks = 0

    def profile_gpu_memory(self, utilization: float) -> int:
        """GPU: run a forward at the largest batch on a throwaway pool; what remains under
        `utilization` of device memory after the peak is the KV budget."""
        tokens = self.config.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        kv_cache.allocate(self.model, self.spec, blocks, self.dtype, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        pool = blocks * self.kv_spec.bytes_per_block
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
        has_drafts = bool(so.scheduled_spec_decode_tokens) and self._set_drafts(so, errors)
        order, counts = self._schedule_order(so, errors)
        order, counts = self.mm.encode(order, counts, errors)  # vision encoders, if any
        out = ModelRunnerOutput(step_id=so.step_id, request_errors=errors)
        if not order:
            return out
        step = self.input_batch.prepare(order, counts, self.device, has_drafts)
        self.tp.send_step(step.input_ids, step.positions, step.meta)  # ranks 1..N-1 run it too
        if self.lora is not None:
            self.lora.set_step(step.states, counts)
        t1 = time.perf_counter()
        with torch.inference_mode(), forward_context(step.meta):
            embeds = self.mm.input_embeds(step)  # None without images in this step
            positions = self.mm.positions(step)  # [3, num_tokens] M-RoPE with images
            hidden = self.forward(step.input_ids, positions, embeds)  # [num_tokens, hidden]
            t2 = time.perf_counter()
            if self.input_batch.num_pooling:  # embedding requests: pooled, not sampled
                out.pooler_output = self.pooler.run(step, hidden)
            if self.draft is not None:
                self.draft.observe(step)  # the draft's KV follows the step's tokens
            rejected = self._sample_into(out, step, hidden)
            out.prompt_logprobs = self._prompt_logprobs(step, hidden)
        for state, n in zip(step.states, counts, strict=True):
            state.num_computed += n
        for state, num_rejected in rejected:  # rejected drafts: their KV is not computed
            state.num_computed -= num_rejected
        if has_drafts:
            for state in step.states:
                state.num_drafts = 0  # drafts live for one step
        self.mm.advance(step.states)
        if self.proposer is not None:
            self._propose(out, step)
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
                if new.pooling_params is not None:
                    self.pooler.check(state)
                self._attach_lora(state)
                self.structured.attach(state, new.output_token_ids)
                self.mm.add(new.request_id, new.mm_inputs, new.num_computed_tokens)
            except ValueError as exc:
                errors[new.request_id] = str(exc)
                self.input_batch.remove(new.request_id)
        for req_id, num_computed, new_block_ids in so.scheduled_cached_reqs.rows():
            try:
                self.input_batch.update(req_id, num_computed, new_block_ids)
            except ValueError as exc:
                errors[req_id] = str(exc)
        return errors

    def _set_drafts(self, so: SchedulerOutput, errors: dict[str, str]) -> bool:
        """Write the step's drafts after their requests' tokens; True when any were set."""
        any_set = False
        for draft in so.scheduled_spec_decode_tokens:
            state = self.input_batch.requests.get(draft.request_id)
            if state is None or draft.request_id in errors or not draft.token_ids:
                continue
            try:
                if not can_speculate(state.params, state.num_outputs):
                    raise ValueError(f"request {state.req_id!r} cannot verify drafts")
                self.input_batch.set_drafts(state, draft.token_ids)
                any_set = True
            except ValueError as exc:
                errors[draft.request_id] = str(exc)
                self.input_batch.remove(draft.request_id)
        return any_set

    def _propose(self, out: ModelRunnerOutput, step: StepBatch) -> None:
        """Drafts for the requests that sampled this step (speculative decoding)."""
        assert self.proposer is not None
        errors = out.request_errors
        states = [step.states[i] for i in step.sample_reqs]
        states = [s for s in states if s.req_id not in errors] if errors else states
        with torch.inference_mode():
            out.draft_token_ids = self.proposer.propose(states, self.input_batch)

    def _attach_lora(self, state: RequestState) -> None:
        """Load the request's adapter (host memory) now: a bad one fails only this request."""
        if state.lora is None:
            return
        if self.lora is None:
            raise ValueError("this worker was started without LoRA (--enable-lora)")
        self.lora.add_adapter(state.lora)

    def _schedule_order(
        self, so: SchedulerOutput, errors: dict[str, str]
    ) -> tuple[list[RequestState], list[int]]:
        """Scheduled requests, decodes first (the attention backend batches them), each
        group ordered by LoRA adapter (one contiguous token segment per adapter)."""
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
        if self.lora is None:
            items.sort(key=lambda item: item[1] != 1)
        else:
            items.sort(key=lambda item: (item[1] != 1, item[0].lora_id))
        return [s for s, _ in items], [n for _, n in items]

    def _sample_into(
        self, out: ModelRunnerOutput, step: StepBatch, hidden: torch.Tensor
    ) -> list[tuple[RequestState, int]]:
        """Sample the rows that reached the end of their token list; fill out's sampled
        columns. Returns the requests that verified drafts, with how many they rejected."""
        tokens: list[list[int]] = [[] for _ in step.req_ids]  # sampled, per request of the step
        rejected: list[tuple[RequestState, int]] = []
        if step.sample_reqs and step.logits_indices is not None:
            states = [step.states[i] for i in step.sample_reqs]
            logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
            if step.num_logits is not None:
                rejected = self._verify_into(out, step, states, logits, tokens)
            else:
                self._sample(states, logits, out, step.sample_reqs, tokens)
        out.set_sampled(step.req_ids, tokens)
        return rejected

    def _verify_into(
        self,
        out: ModelRunnerOutput,
        step: StepBatch,
        states: list[RequestState],
        logits: torch.Tensor,  # [sum(num_logits), V]
        tokens: list[list[int]],
    ) -> list[tuple[RequestState, int]]:
        """A step with drafts: plain rows sample as usual, draft rows go through the
        rejection sampler; accepted tokens are appended to the token table."""
        assert step.num_logits is not None
        ends = np.cumsum(step.num_logits)
        plain = [j for j, s in enumerate(states) if s.num_drafts == 0]
        if plain:
            rows = torch.from_numpy(ends[plain] - 1).to(self.device)
            where = [step.sample_reqs[j] for j in plain]
            self._sample(
                [states[j] for j in plain], logits.index_select(0, rows), out, where, tokens
            )
        spec = [j for j, s in enumerate(states) if s.num_drafts > 0]
        if not spec:
            return []
        rows = torch.from_numpy(
            np.concatenate([np.arange(ends[j] - step.num_logits[j], ends[j]) for j in spec])
        ).to(self.device)
        accepted = self._verify([states[j] for j in spec], logits.index_select(0, rows))
        rejected = []
        for j, accepted_tokens in zip(spec, accepted, strict=True):
            state = states[j]
            tokens[step.sample_reqs[j]] = accepted_tokens
            self.input_batch.extend_tokens(state, accepted_tokens)
            rejected.append((state, state.num_drafts + 1 - len(accepted_tokens)))
        return rejected

    def _verify(self, states: list[RequestState], logits: torch.Tensor) -> list[list[int]]:
        """logits [sum(K_i + 1), V] of requests with K_i drafts -> accepted drafts + one."""
        table = self.input_batch.token_ids
        drafts = [table[s.row, s.num_tokens : s.num_tokens + s.num_drafts].tolist() for s in states]
        rows = [s for s in states for _ in range(s.num_drafts + 1)]
        eos = self.model.config.eos_token_ids
        batch = build_sampling_batch(rows, self.input_batch, eos, self.device)
        return rejection_sample(logits, batch, drafts, self.sampler.generator)

    def _sample(
        self,
        states: list[RequestState],
        logits: torch.Tensor,  # [len(states), V]
        out: ModelRunnerOutput,
        where: list[int],  # each state's index in the step's requests
        tokens: list[list[int]],  # filled at `where`
    ) -> None:
        """One token per row of logits, appended to the token table; logprobs into `out`."""
        eos = self.model.config.eos_token_ids
        batch = build_sampling_batch(states, self.input_batch, eos, self.device)
        grammar = self.structured.bitmask(states)
        if grammar is not None:
            rows, mask = grammar
            batch.allowed = (torch.tensor(rows, device=self.device), mask.to(self.device))
        result = self.sampler(logits, batch)
        sampled = result.token_ids.tolist()
        if grammar is not None:
            out.request_errors.update(self.structured.accept(states, sampled))
        self.input_batch.append_tokens(states, sampled)
        for i, token in zip(where, sampled, strict=True):
            tokens[i] = [token]
        if result.logprobs is None:
            return
        logprobs = to_token_logprobs(result, [s.params.logprobs for s in states])
        out.sampled_logprobs.extend(
            SampledLogprobs(s.req_id, [lp])
            for s, lp in zip(states, logprobs, strict=True)
            if lp is not None
        )

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
