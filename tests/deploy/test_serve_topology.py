"""`tessera serve --data-parallel-size D` and `tessera engine`: the services they start, with
flags parsed by each service's own parser (no processes are started)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from services.config import parse_bytes
from tessera.cli import build_parser, build_services, main
from tessera.data_parallel import PORT_STRIDE


def parsed(argv: list[str]) -> tuple[str, Any]:
    """(module, args parsed by that module's parser) from [python, -m, module, ...]."""
    module = argv[2]
    return module, importlib.import_module(f"{module}.__main__").parse_args(argv[3:])


def test_two_replicas_behind_one_gateway() -> None:
    args = build_parser().parse_args(
        ["serve", "--data-parallel-size", "2", "--kv-cache-memory", "1GiB",
         "--scheduler-port", "41000", "--worker-port", "42000", "--routing", "round-robin"]
    )  # fmt: skip
    services = build_services(args, "token")
    assert [s.name for s in services] == [
        "worker-0", "scheduler-0", "worker-1", "scheduler-1", "gateway"
    ]  # fmt: skip
    workers = [parsed(s.argv)[1] for s in services if s.name.startswith("worker")]
    schedulers = [parsed(s.argv)[1] for s in services if s.name.startswith("scheduler")]
    _, gateway = parsed(services[-1].argv)
    assert [w.port for w in workers] == [42000, 42000 + PORT_STRIDE]
    assert [s.port for s in schedulers] == [41000, 41000 + PORT_STRIDE]
    assert [s.worker for s in schedulers] == [[f"127.0.0.1:{w.port}"] for w in workers]
    assert all(s.host == "127.0.0.1" for s in schedulers)
    assert gateway.scheduler == [f"127.0.0.1:{s.port}" for s in schedulers]
    assert gateway.routing == "round-robin"
    assert sum(parse_bytes(w.kv_cache_memory) for w in workers) == parse_bytes("1GiB")
    assert all(s.env["TESSERA_INTERNAL_TOKEN"] == "token" for s in services)


def test_one_replica_is_unchanged() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1GiB"])
    services = build_services(args, "token")
    assert [s.name for s in services] == ["worker", "scheduler", "gateway"]
    _, worker = parsed(services[0].argv)
    _, gateway = parsed(services[2].argv)
    assert worker.kv_cache_memory == "1GiB" and worker.num_threads == 0
    assert gateway.scheduler == ["127.0.0.1:50051"] and gateway.routing == "affinity"


def test_engine_is_one_replica_listening_on_host() -> None:
    args = build_parser().parse_args(["engine", "--host", "0.0.0.0", "--scheduler-port", "50051"])
    services = build_services(args, "token")[:-1]
    assert [s.name for s in services] == ["worker", "scheduler"]
    _, scheduler = parsed(services[1].argv)
    _, worker = parsed(services[0].argv)
    assert scheduler.host == "0.0.0.0" and scheduler.port == 50051
    assert worker.host == "127.0.0.1"  # the worker stays private to its replica


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--data-parallel-size", "2", "--scheduler-port", "50051",
         "--grpc-port", str(50051 + PORT_STRIDE)],
        ["serve", "--data-parallel-size", "0"],
        ["serve", "--worker-port", "0"],  # the launcher probes the worker at its port
        ["serve", "--port", "8001", "--grpc-port", "8001"],
        ["engine", "--data-parallel-size", "2"],
    ],
)  # fmt: skip
def test_bad_topologies_exit_with_a_message(argv: list[str], capsys: Any) -> None:
    assert main(argv) == 2
    assert "tessera:" in capsys.readouterr().err


def test_speculative_config_reaches_worker_and_scheduler() -> None:
    """`--speculative-config` is checked by `tessera serve` and passed to the worker and the
    scheduler of each replica (normalized JSON); the gateway does not take it."""
    from scheduler_service.__main__ import configs
    from services.config import SpeculativeConfig
    from worker_service.__main__ import build_config

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    args = build_parser().parse_args(["serve", "--speculative-config", spec])
    worker_argv, scheduler_argv, gateway_argv = (s.argv for s in build_services(args, "token"))
    expected = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert build_config(parsed(worker_argv)[1]).speculative_config == expected
    scheduler_config, _ = configs(parsed(scheduler_argv)[1])
    assert scheduler_config.speculative_config == expected
    assert not scheduler_config.use_async_scheduling
    assert "--speculative-config" not in gateway_argv
    plain = build_services(build_parser().parse_args(["serve"]), "token")
    assert not any("--speculative-config" in s.argv for s in plain)
    bad = build_parser().parse_args(["serve", "--speculative-config", '{"method": "x"}'])
    with pytest.raises(ValueError, match="speculative method"):
        build_services(bad, "token")


@pytest.mark.parametrize("value", ["int8", "int4", "gguf", "awq", "gptq"])
def test_quantization_reaches_the_worker(value: str) -> None:
    """`tessera serve -q VALUE` is the worker's ModelConfig.quantization."""
    from worker_service.__main__ import build_config

    worker_argv = build_services(build_parser().parse_args(["serve", "-q", value]), "t")[0].argv
    assert build_config(parsed(worker_argv)[1]).model.quantization == value


def test_the_int4_group_size_reaches_the_worker() -> None:
    from worker_service.__main__ import build_config

    args = build_parser().parse_args(["serve", "-q", "int4", "--quantization-group-size", "128"])
    model = build_config(parsed(build_services(args, "t")[0].argv)[1]).model
    assert (model.quantization, model.quantization_group_size) == ("int4", 128)
    with pytest.raises(SystemExit):  # argparse: not one of 32, 64, 128
        build_parser().parse_args(["serve", "--quantization-group-size", "48"])
    bad = build_parser().parse_args(["serve", "-q", "int8", "--quantization-group-size", "64"])
    with pytest.raises(ValueError, match="int4 only"):
        build_config(parsed(build_services(bad, "t")[0].argv)[1])


@pytest.mark.parametrize("value,stored", [("int8", "int8"), ("fp8", "fp8_e4m3"), ("auto", "auto")])
def test_kv_cache_dtype_reaches_the_worker(value: str, stored: str) -> None:
    """`tessera serve --kv-cache-dtype VALUE` is the worker's CacheConfig.cache_dtype."""
    from worker_service.__main__ import build_config

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", value])
    worker_argv = build_services(args, "t")[0].argv
    assert build_config(parsed(worker_argv)[1]).cache.cache_dtype == stored
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
