"""--otlp-traces-endpoint / --collect-detailed-traces / --log-format: declared once
(services.tracing), taken by every service, passed on by `tessera serve`; JSON log lines;
tracing off imports no OpenTelemetry; asked for without the packages, a clear error."""

from __future__ import annotations

import argparse
import io
import json
import logging
import subprocess
import sys

import pytest

from gateway.__main__ import parse_args as gateway_args
from scheduler_service.__main__ import parse_args as scheduler_args
from services import tracing
from services.log import request_id_var, setup_logging, trace_id_var
from services.tracing import ObservabilityConfig, init_tracing, observability_from_args
from tessera.cli import build_parser, build_services
from worker_service.__main__ import parse_args as worker_args

FLAGS = [
    "--otlp-traces-endpoint", "http://127.0.0.1:4317",
    "--collect-detailed-traces", "worker,model",
    "--log-format", "json",
]  # fmt: skip


def test_defaults_are_off_and_text() -> None:
    for args in (gateway_args([]), scheduler_args(["--worker", "h:1"]), worker_args([])):
        assert observability_from_args(args) == ObservabilityConfig()
    assert not ObservabilityConfig().every_step


@pytest.mark.parametrize(
    "parse",
    [gateway_args, lambda a: scheduler_args(["--worker", "h:1", *a]), worker_args],
    ids=["gateway", "scheduler", "worker"],
)
def test_every_service_takes_the_flags(parse: object) -> None:
    args = parse(FLAGS)  # type: ignore[operator]
    config = observability_from_args(args)
    assert config == ObservabilityConfig("http://127.0.0.1:4317", ("worker", "model"), "json")
    assert config.every_step


def test_tessera_serve_passes_them_to_all_three() -> None:
    args = build_parser().parse_args(["serve", *FLAGS])
    services = build_services(args, "token")
    assert [s.name for s in services] == ["worker", "scheduler", "gateway"]
    for service in services:
        parsed = {"worker": worker_args, "gateway": gateway_args}.get(service.name)
        argv = service.argv[3:]
        args = parsed(argv) if parsed else scheduler_args(argv)
        assert observability_from_args(args) == ObservabilityConfig(
            "http://127.0.0.1:4317", ("worker", "model"), "json"
        ), service.name
    plain = build_services(build_parser().parse_args(["serve"]), "token")
    assert all("--otlp-traces-endpoint" not in s.argv for s in plain)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"collect_detailed_traces": ("gpu",)}, "collect_detailed_traces"),
        ({"collect_detailed_traces": ("all",)}, "needs otlp_traces_endpoint"),
        ({"log_format": "xml"}, "log_format"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObservabilityConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_log_format_flag_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        gateway_args(["--log-format", "xml"])


def test_missing_packages_give_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    config = ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4317")
    with pytest.raises(ValueError, match=r"pip install 'tessera\[tracing\]'"):
        init_tracing("gateway", config)
    assert tracing.tracer() is None
    monkeypatch.setattr(tracing.importlib.util, "find_spec", lambda name: None)
    args = build_parser().parse_args(["serve", "--otlp-traces-endpoint", "http://x:1"])
    with pytest.raises(ValueError, match="OpenTelemetry packages"):
        build_services(args, "token")


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = (
        "import sys, gateway.server, gateway.__main__, scheduler_service.__main__, "
        "worker_service.server, services.tracing;"
        "assert services.tracing.init_tracing('gateway', services.tracing.ObservabilityConfig())"
        " is False;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


@pytest.fixture
def restore_logging() -> object:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_json_lines(restore_logging: object) -> None:
    buffer = io.StringIO()
    setup_logging("scheduler", "INFO", "json", stream=buffer)
    log = logging.getLogger("scheduler_service.test")
    log.info("before %d", 1)
    rid, tid = request_id_var.set("req-7"), trace_id_var.set("ab" * 16)
    try:
        log.warning("inside")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        request_id_var.reset(rid)
        trace_id_var.reset(tid)
    first, second, third = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert first["message"] == "before 1" and first["request_id"] == "-"
    assert "trace_id" not in first
    assert first["service"] == "scheduler" and first["level"] == "INFO"
    assert first["logger"] == "scheduler_service.test" and first["time"].endswith("+00:00")
    assert second["request_id"] == "req-7" and second["trace_id"] == "ab" * 16
    assert third["level"] == "ERROR" and "RuntimeError: boom" in third["exc_info"]


def test_text_lines_stay_as_they_were(restore_logging: object) -> None:
    buffer = io.StringIO()
    setup_logging("worker", "INFO", stream=buffer)
    token = request_id_var.set("req-8")
    try:
        logging.getLogger("w").info("hello")
    finally:
        request_id_var.reset(token)
    assert buffer.getvalue().rstrip().endswith("INFO worker [req-8] w: hello")


def test_parsers_share_one_declaration() -> None:
    p = argparse.ArgumentParser()
    tracing.add_observability_args(p)
    names = {a.dest for a in p._actions} - {"help"}
    assert names == {"otlp_traces_endpoint", "collect_detailed_traces", "log_format"}


def test_tensor_parallel_ranks_inherit_the_format(restore_logging: object) -> None:
    from services.log import current_log_format

    setup_logging("worker", "INFO", "json", stream=io.StringIO())
    assert current_log_format() == "json"
    setup_logging("worker", "INFO", "text", stream=io.StringIO())
    assert current_log_format() == "text"


def test_sigusr1_prints_every_threads_stack_and_the_service_runs_on() -> None:
    script = (
        "import os, signal, sys, threading, time\n"
        "from services.log import setup_logging\n"
        "setup_logging('probe')\n"
        "def parked_helper():\n    time.sleep(60)\n"
        "threading.Thread(target=parked_helper, daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('still running', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "still running" in done.stdout
    assert "parked_helper" in done.stderr and "Current thread" in done.stderr
