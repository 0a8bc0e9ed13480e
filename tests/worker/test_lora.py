"""Issue 23, multi-LoRA (acceptance 3): a tiny random Llama + PEFT adapters made here with
`peft`; Tessera's greedy output with each adapter equals HF PeftModel's in float32, token for
token, also in one batch mixing two adapters and the base and with fewer slots than adapters
(LRU eviction); the segment GEMMs equal a per-token loop; bad adapters fail their request
only, with a clear error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.types import SamplingParams
from tessera import LLM, LoRARequest
from tests.lora_fixtures import build_tiny_llama, make_adapter, peft_greedy
from worker_service.lora.layers import LoRABatch, LoRALinear, LoRAPart, apply_segments_reference

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    [(37 * i + 11 * k + 5) % 4000 + 20 for i in range(n)]
    for k, n in enumerate((5, 17, 40, 9, 64, 23, 33, 12))
]


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(root / "base", default_model_dir)
    return {
        "base": base,
        # every projection, rank 8
        "a": make_adapter(base, root / "a", seed=1, rank=8, alpha=16),
        # some projections, rank 16, rsLoRA scaling
        "b": make_adapter(
            base,
            root / "b",
            seed=2,
            rank=16,
            alpha=8,
            use_rslora=True,
            targets=["q_proj", "v_proj", "down_proj", "gate_proj"],
        ),
    }


@pytest.fixture(scope="module")
def references(lora_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    base = lora_dirs["base"]
    return {
        name: peft_greedy(base, None if name == "base" else lora_dirs[name], PROMPTS, NEW_TOKENS)
        for name in ("base", "a", "b")
    }


def _requests(lora_dirs: dict[str, Path]) -> dict[str, LoRARequest | None]:
    return {
        "base": None,
        "a": LoRARequest("a", 1, str(lora_dirs["a"])),
        "b": LoRARequest("b", 2, str(lora_dirs["b"])),
    }


def _llm(base: Path, max_loras: int) -> LLM:
    return LLM(
        str(base),
        dtype="float32",
        kv_cache_memory="64MiB",
        max_num_seqs=16,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=16,
    )


@pytest.fixture(scope="module")
def llm(lora_dirs: dict[str, Path]) -> Iterator[LLM]:
    engine = _llm(lora_dirs["base"], max_loras=2)
    yield engine
    engine.shutdown()


def _tokens(outputs: list) -> list[list[int]]:
    for o in outputs:
        assert not o.outputs[0].error, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_change_the_output(references: dict[str, list[list[int]]]) -> None:
    assert references["a"] != references["base"] and references["b"] != references["base"]
    assert references["a"] != references["b"]


@pytest.mark.parametrize("name", ["base", "a", "b"])
def test_each_adapter_matches_hf_peft(
    llm: LLM, lora_dirs: dict[str, Path], references: dict[str, list[list[int]]], name: str
) -> None:
    got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=_requests(lora_dirs)[name]))
    assert got == references[name]


def _mixed(
    lora_dirs: dict[str, Path],
) -> tuple[list[list[int]], list[LoRARequest | None], list[str]]:
    names = ["a", "b", "base"] * 8  # every prompt under each of the three, in one batch
    requests = _requests(lora_dirs)
    prompts = [PROMPTS[i // 3] for i in range(len(names))]
    return prompts, [requests[n] for n in names], names


def test_one_batch_mixing_two_adapters_and_the_base(
    llm: LLM, lora_dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    prompts, loras, names = _mixed(lora_dirs)
    got = _tokens(llm.generate(prompts, GREEDY, lora_request=loras))
    expected = [references[n][i // 3] for i, n in enumerate(names)]
    assert got == expected


def test_one_slot_for_two_adapters_evicts_and_stays_exact(
    lora_dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> None:
    engine = _llm(lora_dirs["base"], max_loras=1)  # the scheduler runs one adapter at a time
    try:
        prompts, loras, names = _mixed(lora_dirs)
        got = _tokens(engine.generate(prompts, GREEDY, lora_request=loras))
        assert got == [references[n][i // 3] for i, n in enumerate(names)]
        manager = engine.worker.runner.lora
        assert manager is not None and len(manager.slot_of) == 1
    finally:
        engine.shutdown()


def _bad_adapter(root: Path, name: str, **config: object) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **config}
        )
    )
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_bad_adapters_fail_only_their_request(
    llm: LLM,
    lora_dirs: dict[str, Path],
    references: dict[str, list[list[int]]],
    tmp_path: Path,
) -> None:
    cases = {
        "missing": (tmp_path / "nope", "is not a directory"),
        "dora": (_bad_adapter(tmp_path, "dora", use_dora=True), "DoRA"),
        "rank": (_bad_adapter(tmp_path, "rank", r=64), "rank 64 > max_lora_rank 16"),
        "save": (_bad_adapter(tmp_path, "save", modules_to_save=["lm_head"]), "modules_to_save"),
        "target": (_bad_adapter(tmp_path, "target", target_modules=["embed_tokens"]), "targets"),
    }
    loras = [LoRARequest(n, 10 + i, str(p)) for i, (n, (p, _)) in enumerate(cases.items())]
    outputs = llm.generate([PROMPTS[0]] * (len(loras) + 1), GREEDY, lora_request=[*loras, None])
    for out, (_, message) in zip(outputs, cases.values(), strict=False):
        assert out.outputs[0].finish_reason == "error"
        assert message in out.outputs[0].error
    assert outputs[-1].outputs[0].token_ids == references["base"][0]


def test_lora_off_refuses_a_lora_request(
    default_model_dir: Path, lora_dirs: dict[str, Path]
) -> None:
    engine = LLM(str(lora_dirs["base"]), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)
    try:
        with pytest.raises(ValueError, match="prompt 0: LoRA adapters are not enabled"):
            engine.generate(PROMPTS[0], GREEDY, lora_request=_requests(lora_dirs)["a"])
    finally:
        engine.shutdown()


def test_segment_gemms_equal_a_per_token_loop() -> None:
    """Merged q/k/v parts, ranks 8/4/2 padded to 8, one slot without k: the segment GEMMs equal
    `B_part (A_part x)` token by token, computed from the adapters' own tensors."""
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=False)
    parts = [LoRAPart("q_proj", 0, 16), LoRAPart("k_proj", 16, 28), LoRAPart("v_proj", 28, 40)]
    batch = LoRABatch()
    layer = LoRALinear(base, parts, 24, 3, 8, batch, torch.float32, torch.device("cpu"))
    adapters: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []
    for slot, rank in enumerate((8, 4, 2)):
        pairs = [(torch.randn(rank, 24), torch.randn(p.out_end - p.out_start, rank)) for p in parts]
        adapters.append([pairs[0], None if slot == 1 else pairs[1], pairs[2]])
        layer.set_slot(slot, adapters[-1])
    slot_of_token = [2, 2, -1, 0, 0, 0, 1, -1, -1, 1, 1, 0, 2]
    segments, start = [], 0
    for i in range(1, len(slot_of_token) + 1):
        if i == len(slot_of_token) or slot_of_token[i] != slot_of_token[start]:
            if slot_of_token[start] >= 0:
                segments.append((slot_of_token[start], start, i))
            start = i
    batch.segments = segments
    x = torch.randn(len(slot_of_token), 24)
    expected = torch.zeros(len(slot_of_token), 40)
    for i, slot in enumerate(slot_of_token):
        for part, pair in zip(parts, adapters[slot] if slot >= 0 else [None] * 3, strict=True):
            if pair is not None:
                expected[i, part.out_start : part.out_end] = pair[1] @ (pair[0] @ x[i])
    with torch.inference_mode():
        got = layer(x) - base(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(apply_segments_reference(x, layer, slot_of_token), expected)
        assert got[2].abs().max() == 0 and got[7:9].abs().max() == 0  # base tokens untouched
        assert expected[6:].abs().sum() > 0
        bf16 = LoRALinear(base.to(torch.bfloat16), parts, 24, 3, 8, batch, torch.float32,
                          torch.device("cpu"))  # fmt: skip
        bf16.lora_a.copy_(layer.lora_a)
        bf16.lora_b.copy_(layer.lora_b)
        bf16.targeted = layer.targeted
        xb = x.to(torch.bfloat16)
        got_bf16 = bf16(xb).float() - base(xb).float()  # float32 delta, rounded into bf16
        torch.testing.assert_close(got_bf16, expected, rtol=2e-2, atol=5e-2)
