"""/v1/embeddings through `tessera serve --runner pooling` with the default model in float32,
driven by the official openai client: float and base64 vectors of strings and token ids
equal HF's (AutoModel last_hidden_state, last token, normalized) within
tests.hf_reference.EMBEDDING_TOLERANCE; bad input (empty, too long, wrong model, dimensions
of a non-Matryoshka model, completions of a pooling server) is OpenAI's 400 / 404; concurrent requests are batched; nothing is left
in the scheduler afterwards; the gRPC Embed RPC gives the same vectors."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch

from benchmarks.stack import Stack, start_stack
from services.grpc_utils import sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.hf_reference import assert_embeddings_close, hf_embeddings
from tests.stack.test_serve_e2e import scheduler_stats, wait_idle

pytestmark = pytest.mark.slow
TEXTS = [
    "Hello",
    "The capital of France is Paris.",
    "Paged attention stores keys and values in fixed-size blocks. " * 12,
    "embeddings",
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack("--runner", "pooling", "--dtype", "float32")
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _ids(stack: Stack, text: str) -> list[int]:
    return list(httpx.post(f"{stack.base_url}/tokenize", json={"prompt": text}).json()["tokens"])


def test_strings_float_and_base64_equal_hf(
    client: Any, stack: Stack, default_model_dir: Path
) -> None:
    reply = client.embeddings.create(model="", input=TEXTS)
    assert reply.object == "list" and [d.index for d in reply.data] == [0, 1, 2, 3]
    ids = [_ids(stack, t) for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    want = hf_embeddings(default_model_dir, ids, "LAST", True)
    assert_embeddings_close([d.embedding for d in reply.data], want)
    encoded = client.embeddings.create(model="", input=TEXTS, encoding_format="base64")
    raw = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in encoded.data]
    assert_embeddings_close([r.tolist() for r in raw], want)
    one = client.embeddings.create(model=reply.model, input=TEXTS[1], user="someone")
    assert_embeddings_close([one.data[0].embedding], want[1:2])


def test_token_ids_equal_hf(client: Any, default_model_dir: Path) -> None:
    ids = [[1, 2, 3, 4], [42] * 300, [7]]
    reply = client.embeddings.create(model="", input=ids)
    assert_embeddings_close(
        [d.embedding for d in reply.data], hf_embeddings(default_model_dir, ids, "LAST")
    )
    single = client.embeddings.create(model="", input=ids[0])
    assert_embeddings_close(
        [single.data[0].embedding], hf_embeddings(default_model_dir, ids[:1], "LAST")
    )


def _bad(client: Any, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(**{"model": "", **kwargs})
    body: Any = info.value.body
    assert body["type"] == "invalid_request_error", body
    return dict(body)


def test_bad_inputs_are_openai_400s(client: Any, stack: Stack) -> None:
    before = scheduler_stats(stack).num_finished
    assert _bad(client, input=[])["param"] == "input"
    assert _bad(client, input="")["param"] == "input"
    assert _bad(client, input=["ok", ""])["param"] == "input"
    assert _bad(client, input=[[1, 2], []])["param"] == "input"
    too_long = _bad(client, input=[[5] * 8193])
    assert too_long["param"] == "input" and "maximum context length is 8192" in too_long["message"]
    assert "matryoshka" in _bad(client, input="hi", dimensions=8)["message"]
    assert _bad(client, input="hi", encoding_format="int8")["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="no-such-model", input="hi")
    not_found: Any = info.value.body
    assert not_found["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as wrong_runner:
        client.completions.create(model="", prompt="Once upon", max_tokens=4)
    refused: Any = wrong_runner.value.body
    assert "pooling runner" in refused["message"]
    assert scheduler_stats(stack).num_finished == before  # none reached the engine


def test_concurrent_requests_are_batched(client: Any, stack: Stack) -> None:
    steps_before = scheduler_stats(stack).num_steps
    texts = [f"sentence number {i} about lighthouses and the sea" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda t: client.embeddings.create(model="", input=t), texts))
    alone = client.embeddings.create(model="", input=texts)
    for i, reply in enumerate(replies):
        assert_embeddings_close([reply.data[0].embedding], [torch.tensor(alone.data[i].embedding)])
    stats = wait_idle(stack, 10)
    assert stats.num_steps - steps_before < 16 + 1, "16 concurrent requests took 16 steps"
    assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0), stats


def test_grpc_embed_equals_rest(client: Any, stack: Stack) -> None:
    rest = client.embeddings.create(model="", input=TEXTS[:2])
    with sync_channel(stack.gateway_grpc_address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        reply = stub.Embed(pb.EmbedRequest(texts=TEXTS[:2], request_id="mine"), timeout=60)
        assert reply.id == "mine" and reply.usage.prompt_tokens == rest.usage.prompt_tokens
        got = [list(e.values) for e in reply.embeddings]
        assert_embeddings_close(got, [torch.tensor(d.embedding) for d in rest.data])
        tokens = stub.Embed(pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[1, 2, 3])]))
        assert len(tokens.embeddings[0].values) == 576
        for bad in (
            pb.EmbedRequest(),
            pb.EmbedRequest(texts=[""]),
            pb.EmbedRequest(texts=["a"], dimensions=8),
            pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[5] * 8193)]),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Embed(bad, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
