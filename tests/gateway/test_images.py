"""image_url parts through the gateway (fake engine): what reaches the engine, who frees the
memory, and every bad input -> 400 in OpenAI's shape with nothing queued (acceptance 5)."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from benchmarks.tiny_vlm import build_tiny_llava, png_bytes, sample_image
from gateway.multimodal import image_hash
from gateway.tokenizer import Tokenizer
from services.tensor_handles import host_id
from tests.gateway.conftest import API_KEY, Stack, start_stack
from tests.gateway.fake_engine import MODEL_NAME

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IMAGE_TOKENS = 16  # the tiny LLaVA: (32 / 8) ** 2 patches


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_chat(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}]}


class _PngHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = png_bytes(sample_image(9))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PngHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()


@pytest.fixture(scope="module")
def vlm_stack(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Stack]:
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("llava"), default_model_dir)
    stack = start_stack(
        Tokenizer.load(model_dir),
        model=str(model_dir),
        api_key=API_KEY,
        limit_images_per_prompt=2,
        max_image_bytes=64 * 1024,
        max_image_pixels=100 * 100,
        allowed_media_domains=("127.0.0.1",),
        allowed_media_networks=("127.0.0.0/8",),  # the image server is on loopback
    )
    yield stack
    stack.stop()


@pytest.fixture
def vlm(vlm_stack: Stack) -> Iterator[httpx.Client]:
    vlm_stack.engine.reset()
    with httpx.Client(base_url=vlm_stack.base_url, headers=AUTH, timeout=30) as client:
        yield client


def _ok(client: httpx.Client, stack: Stack) -> None:
    """A good image request succeeds and reaches the engine with one image."""
    before = len(stack.engine.requests)
    r = client.post(CHAT, json=image_chat(data_url(png_bytes(sample_image(1)))))
    assert r.status_code == 200, r.text
    assert len(stack.engine.requests) == before + 1
    assert len(stack.engine.requests[-1].mm_inputs) == 1


def test_image_reaches_the_engine_as_a_handle(vlm: httpx.Client, vlm_stack: Stack) -> None:
    image = sample_image(1)
    r = vlm.post(CHAT, json=image_chat(data_url(png_bytes(image))))
    assert r.status_code == 200, r.text
    (request,) = vlm_stack.engine.requests
    (item,) = request.mm_inputs
    ids = request.prompt_token_ids[item.offset : item.offset + item.length]
    image_id = vlm_stack.gateway.serving.images.processor.image_token_id  # type: ignore[union-attr]
    assert item.length == IMAGE_TOKENS and set(ids) == {image_id}
    assert item.content_hash == image_hash(image.convert("RGB"))
    assert item.tensor is not None and item.tensor.shape == (3, 32, 32)
    assert item.tensor.inline_bytes is not None  # the fake engine reports no host: inline


def test_same_host_gets_shm_and_the_gateway_unlinks_it(vlm: httpx.Client, vlm_stack: Stack) -> None:
    vlm_stack.engine.host_id = host_id()
    vlm_stack.gateway.serving._card = None  # re-read ServerInfo with the new host_id
    try:
        two = image_chat(*(data_url(png_bytes(sample_image(s))) for s in (1, 2)))
        assert vlm.post(CHAT, json=two).status_code == 200
        items = vlm_stack.engine.requests[-1].mm_inputs
        names = [i.tensor.shared_memory.name for i in items if i.tensor and i.tensor.shared_memory]
        assert len(names) == 2
        assert items[0].offset + items[0].length <= items[1].offset
        assert not any(Path("/dev/shm", n).exists() for n in names)  # released at the end
    finally:
        vlm_stack.engine.host_id = ""
        vlm_stack.gateway.serving._card = None


def test_allowed_remote_url_is_fetched(
    vlm: httpx.Client, vlm_stack: Stack, image_server: str
) -> None:
    r = vlm.post(CHAT, json=image_chat(image_server))
    assert r.status_code == 200, r.text
    (item,) = vlm_stack.engine.requests[-1].mm_inputs
    assert item.content_hash == image_hash(sample_image(9))


def test_image_host_resolving_inward_gives_400(vlm: httpx.Client, vlm_stack: Stack) -> None:
    from gateway.fetch import MediaFetcher

    async def metadata_dns(host: str, port: int) -> list[str]:
        return ["169.254.169.254"]  # a rebinding name pointing at the cloud metadata address

    images = vlm_stack.gateway.serving.images
    assert images is not None
    saved, images.fetcher = images.fetcher, MediaFetcher(("test",), resolver=metadata_dns)
    try:
        r = vlm.post(CHAT, json=image_chat("http://metadata.test/latest/meta-data"))
    finally:
        images.fetcher = saved
    assert r.status_code == 400 and "public addresses" in r.json()["error"]["message"]
    assert vlm_stack.engine.requests == []


BAD_CASES: list[tuple[str, Any, str]] = [
    ("bad-base64", lambda: image_chat("data:image/png;base64,@@not base64@@"), "base64"),
    ("not-an-image", lambda: image_chat(data_url(b"just some text, not a PNG")), "image"),
    (
        "too-many-bytes",
        lambda: image_chat(data_url(png_bytes(sample_image(3, (99, 99))) * 3)),
        "limit",
    ),
    (
        "too-many-pixels",
        lambda: image_chat(data_url(png_bytes(Image.new("RGB", (200, 200), "red")))),
        "pixel",
    ),
    (
        "too-many-images",
        lambda: image_chat(*[data_url(png_bytes(sample_image(s))) for s in (1, 2, 3)]),
        "limit of 2",
    ),
    (
        "too-wide",
        lambda: image_chat(data_url(png_bytes(Image.new("RGB", (9000, 1), "red")))),
        "aspect ratio over the 200:1",
    ),
    (
        "too-tall",
        lambda: image_chat(data_url(png_bytes(Image.new("L", (1, 9000))))),
        "aspect ratio over the 200:1",
    ),
    ("host-not-allowed", lambda: image_chat("http://example.invalid/cat.png"), "allowed"),
    ("not-http", lambda: image_chat("file:///etc/passwd"), "data: or http"),
]


@pytest.mark.parametrize(("case", "body", "needle"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_image_gives_400_and_nothing_queued(
    vlm: httpx.Client, vlm_stack: Stack, case: str, body: Any, needle: str
) -> None:
    r = vlm.post(CHAT, json=body())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    assert vlm_stack.engine.requests == []
    _ok(vlm, vlm_stack)


def test_image_to_text_only_model_gives_400(tokenizer: Tokenizer) -> None:
    stack = start_stack(tokenizer, api_key=API_KEY)
    try:
        with httpx.Client(base_url=stack.base_url, headers=AUTH, timeout=30) as client:
            r = client.post(CHAT, json=image_chat(data_url(png_bytes(sample_image(1)))))
            assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
            assert stack.engine.requests == []
            ok = client.post(
                CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
            )
            assert ok.status_code == 200
    finally:
        stack.stop()


def test_remote_urls_off_by_default(default_model_dir: Path, tmp_path: Path) -> None:
    import asyncio

    from gateway.errors import InvalidRequest
    from gateway.media import ImageService
    from services.config import GatewayConfig

    model_dir = build_tiny_llava(tmp_path / "llava", default_model_dir)
    service = ImageService.load(GatewayConfig(model=str(model_dir)), model_dir)
    assert service is not None and service.fetcher.allowed_domains == ()
    with pytest.raises(InvalidRequest, match="remote image URLs are off"):
        asyncio.run(service.fetcher.fetch("http://127.0.0.1:1/cat.png"))
    assert service._mode(host_id()) == "shm" and service._mode("elsewhere/boot") == "inline"
    inline = ImageService.load(
        GatewayConfig(model=str(model_dir), image_transport="inline"), model_dir
    )
    assert inline is not None and inline._mode(host_id()) == "inline"


def _grpc_image_chat(data: bytes) -> Any:
    from services.pb import generate_pb2 as pb

    parts = [
        pb.ContentPart(text="What is in the picture?"),
        pb.ContentPart(image=pb.Image(data=data, mime_type="image/png")),
    ]
    return pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=parts)])


def test_grpc_chat_takes_image_parts(vlm_stack: Stack) -> None:
    import grpc

    from services.config import SecurityConfig
    from services.grpc_utils import sync_channel
    from services.pb import generate_pb2_grpc as pb_grpc

    vlm_stack.engine.reset()
    image = sample_image(7)
    security = SecurityConfig(token=API_KEY)
    with sync_channel(vlm_stack.grpc_address, security=security) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        reply = stub.Chat(_grpc_image_chat(png_bytes(image)))
        assert reply.finish_reason == "stop" and reply.usage.prompt_tokens > IMAGE_TOKENS
        (item,) = vlm_stack.engine.requests[-1].mm_inputs
        assert item.length == IMAGE_TOKENS and item.content_hash == image_hash(image)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Chat(_grpc_image_chat(b"not an image"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(vlm_stack.engine.requests) == 1  # the bad one queued nothing
        chunks = list(stub.ChatStream(_grpc_image_chat(png_bytes(image))))
        assert chunks[-1].finish_reason == "stop"


def test_text_only_gateway_does_not_import_torch() -> None:
    """torch comes in with the first image: a text-only gateway stays light."""
    import subprocess
    import sys

    code = "import sys, gateway.server, gateway.__main__; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_grpc_image_by_url_takes_the_rest_path(vlm_stack: Stack, image_server: str) -> None:
    """Image.url: an allowed http URL is fetched and a data: URL decoded, as REST does;
    data and url together (or neither) is INVALID_ARGUMENT."""
    import grpc

    from services.config import SecurityConfig
    from services.grpc_utils import sync_channel
    from services.pb import generate_pb2 as pb
    from services.pb import generate_pb2_grpc as pb_grpc

    def chat(image: Any) -> Any:
        parts = [pb.ContentPart(text="What is this?"), pb.ContentPart(image=image)]
        return pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=parts)])

    vlm_stack.engine.reset()
    with sync_channel(vlm_stack.grpc_address, security=SecurityConfig(token=API_KEY)) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        assert stub.Chat(chat(pb.Image(url=image_server))).finish_reason == "stop"
        (item,) = vlm_stack.engine.requests[-1].mm_inputs
        assert item.content_hash == image_hash(sample_image(9))
        url = data_url(png_bytes(sample_image(3)))
        assert stub.Chat(chat(pb.Image(url=url))).finish_reason == "stop"
        assert vlm_stack.engine.requests[-1].mm_inputs[0].content_hash == image_hash(
            sample_image(3)
        )
        for bad in (pb.Image(url=url, data=b"x"), pb.Image(mime_type="image/png")):
            with pytest.raises(grpc.RpcError) as info:
                stub.Chat(chat(bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "data or url" in (info.value.details() or "")
    assert len(vlm_stack.engine.requests) == 2
