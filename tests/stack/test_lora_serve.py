"""Multi-LoRA through `tessera serve` (issue 23, acceptance 3), driven by the openai client:
the request's `model` picks the adapter and the output equals HF PeftModel greedy (fp32);
/v1/models lists each adapter with its base as parent; adapters load and unload at runtime
while requests run (an unloaded adapter's running requests finish with it, new ones get 404,
as in vLLM); a bad adapter directory is a clear 400; two adapters never share KV blocks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from benchmarks.stack import Stack, start_stack
from tests.lora_fixtures import build_tiny_llama, make_adapter, peft_greedy

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
PROMPTS = [[(53 * i + 7 * k + 3) % 4000 + 20 for i in range(n)] for k, n in enumerate((6, 21, 40))]
LONG = [(17 * i + 5) % 4000 + 20 for i in range(80)]  # 5 full blocks of 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_tiny_llama(root / "base", default_model_dir)
    return {
        "base": base,
        "a": make_adapter(base, root / "a", seed=1, rank=8, alpha=16),
        "b": make_adapter(
            base, root / "b", seed=2, rank=16, alpha=16, targets=["q_proj", "v_proj"]
        ),
        "c": make_adapter(base, root / "c", seed=3, rank=4, alpha=4, targets=["down_proj"]),
    }


@pytest.fixture(scope="module")
def references(dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {
        name: peft_greedy(dirs["base"], None if name == "base" else dirs[name], PROMPTS, NEW_TOKENS)
        for name in ("base", "a", "b", "c")
    }


@pytest.fixture(scope="module")
def stack(dirs: dict[str, Path]) -> Iterator[Stack]:
    stack = start_stack(
        "--model", str(dirs["base"]), "--dtype", "float32", "--served-model-name", "tiny",
        "--enable-lora", "--lora-modules", f"a={dirs['a']}",
        f'{{"name": "b", "path": "{dirs["b"]}", "base_model_name": "tiny"}}',
        "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def _client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _greedy(client: Any, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> Any:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def _tokens(reply: Any) -> list[str]:
    """The choice's tokens, each decoded on its own (what completions logprobs report)."""
    return list(reply.choices[0].logprobs.tokens)


@pytest.fixture(scope="module")
def texts(
    dirs: dict[str, Path], references: dict[str, list[list[int]]]
) -> dict[str, list[list[str]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["base"])
    return {
        name: [[str(tok.decode([t], skip_special_tokens=False)) for t in ids] for ids in refs]
        for name, refs in references.items()
    }


def test_models_lists_adapters_with_their_parent(stack: Stack, dirs: dict[str, Path]) -> None:
    models = {m.id: m for m in _client(stack).models.list().data}
    assert set(models) == {"tiny", "a", "b"}
    assert models["a"].parent == "tiny" and models["b"].parent == "tiny"
    assert models["a"].root == str(dirs["a"]) and models["tiny"].parent is None


@pytest.mark.parametrize("model", ["a", "b", "tiny"])
def test_model_field_picks_the_adapter(
    stack: Stack, texts: dict[str, list[list[str]]], model: str
) -> None:
    client = _client(stack)
    name = "base" if model == "tiny" else model
    for prompt, expected in zip(PROMPTS, texts[name], strict=True):
        reply = _greedy(client, model, prompt)
        assert reply.model == model
        assert _tokens(reply) == expected


def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _greedy(_client(stack), "nope", PROMPTS[0])


def test_prefix_cache_never_shared_across_adapters(stack: Stack) -> None:
    client = _client(stack)
    cached: dict[str, list[int]] = {}
    for model in ("a", "a", "b", "tiny", "b"):
        reply = _greedy(client, model, LONG, max_tokens=2)
        cached.setdefault(model, []).append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached["a"] == [0, 64]  # the second a hits a's 4 full prompt blocks
    assert cached["b"] == [0, 64] and cached["tiny"] == [0]  # b and the base start cold


def _post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/{path}", json=body, timeout=30)


def test_bad_adapter_directories_are_400(stack: Stack, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "use_dora": true}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    cases = {
        str(tmp_path / "missing"): "is not a directory",
        str(tmp_path): "DoRA",
    }
    for path, message in cases.items():
        reply = _post(stack, "load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    reply = _post(stack, "load_lora_adapter", {"lora_name": "bad"})
    assert reply.status_code == 400 and "must be provided" in reply.json()["error"]["message"]
    reply = _post(stack, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert reply.status_code == 404


def test_load_and_unload_at_runtime_under_load(
    stack: Stack, dirs: dict[str, Path], texts: dict[str, list[list[str]]]
) -> None:
    client = _client(stack)
    failures: list[str] = []
    stop = threading.Event()

    def traffic(model: str, k: int) -> None:  # requests keep flowing on other models
        while not stop.is_set():
            try:
                assert (
                    _tokens(_greedy(client, model, PROMPTS[k]))
                    == texts["base" if model == "tiny" else model][k]
                )
            except Exception as exc:
                failures.append(f"{model}: {exc!r}")

    threads = [threading.Thread(target=traffic, args=(m, k)) for k, m in enumerate(("tiny", "b"))]
    for t in threads:
        t.start()
    try:
        reply = _post(stack, "load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"])})
        assert reply.status_code == 200 and "added successfully" in reply.text
        assert (
            _post(
                stack, "load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"])}
            ).status_code
            == 400
        )
        assert "c" in {m.id for m in client.models.list().data}
        assert _tokens(_greedy(client, "c", PROMPTS[2])) == texts["c"][2]
        # unloading while c runs: the running request finishes with c, new ones get 404
        stream = client.completions.create(
            model="c", prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        got = list(next(chunks).choices[0].logprobs.tokens)
        assert _post(stack, "unload_lora_adapter", {"lora_name": "c"}).status_code == 200
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].logprobs:
                got += chunk.choices[0].logprobs.tokens
        assert got == texts["c"][1]
        with pytest.raises(openai.NotFoundError):
            _greedy(client, "c", PROMPTS[0])
        assert "c" not in {m.id for m in client.models.list().data}
        reply = _post(stack, "load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"])})
        assert reply.status_code == 200
        assert _tokens(_greedy(client, "c", PROMPTS[0])) == texts["c"][0]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]


def test_runtime_updating_is_off_by_default(dirs: dict[str, Path]) -> None:
    stack = start_stack(
        "--model", str(dirs["base"]), "--dtype", "float32", "--enable-lora",
        "--lora-modules", f"a={dirs['a']}",
    )  # fmt: skip
    try:
        reply = _post(stack, "load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"])})
        assert reply.status_code == 404
        assert "a" in {m.id for m in _client(stack).models.list().data}
    finally:
        assert stack.stop() == 0, stack.output()[-3000:]


def test_grpc_api_takes_the_adapter_in_model(stack: Stack) -> None:
    from services.grpc_utils import sync_channel
    from services.pb import generate_pb2 as pb
    from services.pb import generate_pb2_grpc as pb_grpc

    text = "The adapter says"
    rest = _client(stack).completions.create(
        model="a", prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    with sync_channel(stack.gateway_grpc_address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        models = {m.id: m.parent for m in stub.ListModels(pb.ListModelsRequest()).models}
        assert models["tiny"] == "" and models["a"] == "tiny" and models["b"] == "tiny"
        params = pb.TextSamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        reply = stub.Complete(pb.CompletionRequest(model="a", prompt=text, params=params))
        assert reply.model == "a" and reply.text == rest.choices[0].text
        base = stub.Complete(pb.CompletionRequest(model="tiny", prompt=text, params=params))
        assert base.text != reply.text
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(pb.CompletionRequest(model="nope", prompt=text, params=params))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
