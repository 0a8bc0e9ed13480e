"""The gateway's configs (the OpenAI REST front end, per-request limits) and the gRPC
transport security every service shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.config.common import (
    API_KEY_ENV,
    BYTES,
    HOST,
    MODEL,
    REASONING_PARSERS,
    ROUTINGS,
    SCHEDULER_PORT,
    SERVED_MODEL_NAME,
    TOKEN_ENV,
    TOOL_CALL_PARSERS,
    _is_network,
    _require,
)
from services.config.engine import HubConfig
from services.flags import flag
from services.lora_config import LoRAConfig
from services.types import MAX_LOGPROBS, MAX_N


@dataclass(frozen=True)
class RequestLimits:
    """What one generate request may ask for (REST and gRPC); over a limit: 400 /
    INVALID_ARGUMENT before any engine work, past the deadline: 408 / DEADLINE_EXCEEDED."""

    max_n: int = flag(16, f"Most choices (n) per request, at most {MAX_N}.")
    max_logprobs: int = flag(
        MAX_LOGPROBS, f"Most logprobs / top_logprobs per token, at most {MAX_LOGPROBS}."
    )
    max_request_tokens: int = flag(
        262144,
        "Most tokens one request may generate over its choices and prompts: n x max_tokens, an "
        "unset max_tokens counting as the context left after the prompt; 0: no cap.",
    )
    request_timeout_s: float = flag(
        0.0,
        "Seconds before a request is aborted (408 / DEADLINE_EXCEEDED); 0: no server deadline. "
        "A shorter `timeout` body field (REST) or call deadline (gRPC) wins.",
        name="--request-timeout",
    )

    def __post_init__(self) -> None:
        _require(1 <= self.max_n <= MAX_N, f"max_n must be in [1, {MAX_N}]")
        _require(
            0 <= self.max_logprobs <= MAX_LOGPROBS, f"max_logprobs must be in [0, {MAX_LOGPROBS}]"
        )
        _require(self.max_request_tokens >= 0, "max_request_tokens must be >= 0 (0: no cap)")
        _require(self.request_timeout_s >= 0, "request_timeout_s must be >= 0 (0: none)")

    def timeout_s(self, requested_s: float | None) -> float | None:
        """The deadline of a request that asked for `requested_s` (None: it did not): the
        shorter of that and the server's; None when neither sets one."""
        given = [t for t in (self.request_timeout_s, requested_s) if t]
        return min(given) if given else None


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI REST front end and the public gRPC text API."""

    # Address of the scheduler's EngineCore service (--scheduler, the first one given).
    scheduler_address: str = f"127.0.0.1:{SCHEDULER_PORT}"
    model: str = MODEL.field()
    # Revision and cache of a Hub id.
    hub: HubConfig = field(default_factory=HubConfig)
    served_model_name: str = SERVED_MODEL_NAME.field()
    host: str = HOST.field()
    port: int = flag(8000, "HTTP port of the OpenAI API.")
    grpc_port: int = flag(50052, "Port of the TextGeneration gRPC API; 0 disables it.")
    api_key: str = flag(
        "",
        "Bearer token clients must send on /v1, /tokenize, /detokenize and the gRPC text API; "
        f"empty: the {API_KEY_ENV} variable (which `ps` does not show), else no auth.",
    )
    max_queued_requests: int = flag(1024, "Requests in flight at once before new ones get 429.")
    cors_allow_origins: tuple[str, ...] = flag(
        (),
        "An origin CORS allows (repeat the flag); none: CORS off.",
        name="--cors-allow-origin",
        nargs="append",
    )
    max_body_bytes: int = flag(
        32 << 20,
        "Largest request body, e.g. 32MiB; also the gRPC text API's largest message.",
        **BYTES,
    )
    max_inflight_bytes: int = flag(
        256 << 20,
        "Request bytes held at once over all requests (REST and gRPC), e.g. 256MiB; past it "
        "429 / RESOURCE_EXHAUSTED. Bounds memory under concurrent large input.",
        **BYTES,
    )
    drain_timeout_s: float = flag(
        30.0, "Seconds in-flight streams may take to finish on SIGTERM.", name="--drain-timeout"
    )
    # Further EngineCore addresses (--scheduler, repeated): data-parallel engine replicas.
    extra_scheduler_addresses: tuple[str, ...] = ()
    routing: str = flag(
        "affinity",
        "How requests spread over engine replicas: affinity (prefix hash, bounded by load) or "
        "round-robin.",
        choices=ROUTINGS,
    )
    limit_images_per_prompt: int = flag(8, "Images one prompt may carry; more get 400.")
    max_image_bytes: int = flag(20 << 20, "Largest encoded image, e.g. 20MiB.", **BYTES)
    max_image_pixels: int = flag(4096 * 4096, "Largest decoded image, width * height.")
    allowed_media_domains: tuple[str, ...] = flag(
        (),
        "Hosts http(s) image URLs may come from (and their subdomains); none: remote URLs refused.",
        nargs="*",
        parse=str.lower,
    )
    media_fetch_timeout_s: float = flag(
        10.0,
        "Seconds one remote image fetch may take in all: resolving, connecting and the body.",
        name="--media-fetch-timeout",
    )
    max_image_aspect_ratio: float = flag(
        200.0,
        "Longest / shortest side an image may have (200: 200:1); more gets 400 (HF processors "
        "keep the aspect ratio when resizing, so a 400000x1 image would cost gigabytes).",
    )
    allowed_media_networks: tuple[str, ...] = flag(
        (),
        "Networks (CIDR) image hosts may resolve into though not global (loopback, private, "
        "link-local); none: only global unicast addresses are fetched.",
        nargs="*",
    )
    image_transport: Literal["auto", "shm", "inline"] = flag(
        "auto",
        "How pixels reach the worker: auto (shm when the worker reports this host, else inline "
        "bytes), or always shm / inline.",
    )
    # Per-request budgets and deadline: --max-n, --max-logprobs, --max-request-tokens,
    # --request-timeout.
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat_template: str = flag("", "A Jinja chat template file to use instead of the model's own.")
    chat_template_content_format: Literal["auto", "string", "openai"] = flag(
        "auto",
        "Message content as strings or openai lists of parts; auto: openai when the template "
        "walks a message's content parts.",
    )
    reasoning_parser: str = flag(
        "",
        "Put thinking text into reasoning_content: qwen3 or deepseek_r1; empty: off.",
        choices=("", *REASONING_PARSERS),
    )
    tool_call_parser: str = flag(
        "auto",
        "Tool-call format of tool_choice auto; auto: from the model's tokenizer.",
        choices=("auto", *TOOL_CALL_PARSERS),
    )
    # Multi-LoRA: the adapters "model" may name, runtime load/unload.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        """Every EngineCore address given (one DNS name may stand for several replicas)."""
        return (self.scheduler_address, *self.extra_scheduler_addresses)

    def __post_init__(self) -> None:
        for address in self.scheduler_addresses:
            _require(":" in address, f"scheduler_address must be host:port, not {address!r}")
        _require(self.routing in ROUTINGS, f"routing must be one of {ROUTINGS}")
        for name in ("port", "grpc_port"):
            _require(0 <= getattr(self, name) <= 65535, f"{name} must be a TCP port")
        _require(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        _require(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _require(self.max_inflight_bytes >= 1024, "max_inflight_bytes must be >= 1024")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _require(self.limit_images_per_prompt >= 1, "limit_images_per_prompt must be >= 1")
        _require(min(self.max_image_bytes, self.max_image_pixels) >= 1, "image caps must be >= 1")
        _require(self.media_fetch_timeout_s > 0, "media_fetch_timeout_s must be > 0")
        _require(self.max_image_aspect_ratio >= 1, "max_image_aspect_ratio must be >= 1")
        for network in self.allowed_media_networks:
            _require(_is_network(network), f"allowed_media_networks: {network!r} is not a CIDR")
        _require(self.image_transport in ("auto", "shm", "inline"), "unknown image_transport")
        _require(
            self.chat_template_content_format in ("auto", "string", "openai"),
            "chat_template_content_format must be auto, string or openai",
        )
        _require(
            self.tool_call_parser in ("auto", *TOOL_CALL_PARSERS),
            f"tool_call_parser must be auto or one of {TOOL_CALL_PARSERS}",
        )
        _require(
            self.reasoning_parser in ("", *REASONING_PARSERS),
            f"reasoning_parser must be one of {REASONING_PARSERS}, not {self.reasoning_parser!r}",
        )


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call a gRPC service and over what transport (the server and its clients)."""

    token: str = flag(
        "",
        "Shared token of the internal services, sent as `authorization: Bearer <token>`; "
        f"empty: the {TOKEN_ENV} variable (prefer it: `ps` shows flags), else no token check.",
        name="--internal-token",
    )
    tls_cert: str = flag(
        "",
        "PEM certificate chain of this service: its server identity and, with --tls-ca, its "
        "client identity for mutual TLS; empty: plaintext (unless --tls-ca makes a TLS client).",
    )
    tls_key: str = flag("", "PEM private key of --tls-cert.")
    tls_ca: str = flag(
        "",
        "PEM CA bundle: servers then require client certificates it signed (mutual TLS); "
        "clients verify the server's certificate with it.",
    )
    tls_server_name: str = flag(
        "",
        "Host name to check the server certificate against when it differs from the host dialled.",
    )

    def __post_init__(self) -> None:
        _require(bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key go together")
        _require(not self.tls_server_name or self.tls, "tls_server_name needs tls_ca or tls_cert")

    @property
    def tls(self) -> bool:
        """True when connections use TLS."""
        return bool(self.tls_cert or self.tls_ca)
