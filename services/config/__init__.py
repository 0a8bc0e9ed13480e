"""Frozen configuration dataclasses, validated on construction.

One dataclass per concern; a service builds the ones it needs from its command line and
passes them down whole. Nothing here reads the environment. A field that is a command-line
flag is declared with `services.flags.flag` (type, default and help once); the services'
parsers are built from these declarations.
"""

from services.config.common import (
    API_KEY_ENV,
    DEFAULT_MODEL,
    HOST,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    ROUTINGS,
    RUNNERS,
    SCHEDULER_PORT,
    TASKS,
    TOKEN_ENV,
    TOOL_CALL_PARSERS,
    WORKER_PORT,
    GiB,
    Runner,
    format_bytes,
    parse_bytes,
    resolve_runner,
)
from services.config.engine import (
    KV_CACHE_DTYPES,
    SCHEDULER_CACHE_FIELDS,
    SPECULATIVE_METHODS,
    CacheConfig,
    HubConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from services.config.gateway import GatewayConfig, RequestLimits, SecurityConfig

__all__ = [
    "API_KEY_ENV", "DEFAULT_MODEL", "HOST", "KV_CACHE_DTYPES", "QUANTIZATIONS",
    "QUANTIZATION_GROUP_SIZES", "REASONING_PARSERS", "ROUTINGS", "RUNNERS", "SCHEDULER_CACHE_FIELDS",
    "SCHEDULER_PORT", "SPECULATIVE_METHODS", "TASKS", "TOKEN_ENV", "TOOL_CALL_PARSERS",
    "WORKER_PORT", "CacheConfig", "GatewayConfig", "GiB", "HubConfig", "ModelConfig",
    "ParallelConfig", "RequestLimits", "Runner", "SchedulerConfig", "SecurityConfig",
    "SpeculativeConfig", "WorkerConfig", "format_bytes", "parse_bytes", "resolve_runner",
]  # fmt: skip
