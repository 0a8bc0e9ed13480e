"""Remote image fetching does not trust DNS (issue 25, finding 3): a stub resolver stands for
DNS, real HTTP(S) servers on loopback for the image hosts. Names resolving inward are refused
before any connection; a name pinned to its checked address keeps its Host header, SNI and
certificate name; one deadline bounds the whole fetch; no redirects, proxies or bypasses."""

from __future__ import annotations

import asyncio
import http.server
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.tiny_vlm import png_bytes, sample_image
from gateway.errors import InvalidRequest
from gateway.fetch import MediaFetcher, is_global_unicast, resolve

PNG = png_bytes(sample_image(9))
LOOPBACK = ("127.0.0.0/8", "::1/128")
PUBLIC = "192.88.99.7"  # a global address; only ever handed to a mock transport


class StubDNS:
    """A resolver that answers every name with `addresses` and records the questions."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append((host, port))
        return self.addresses


class NoConnect(httpx.AsyncBaseTransport):
    """A transport that records what would have been sent and sends nothing."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(PNG))


def fetch(fetcher: MediaFetcher, url: str) -> bytes:
    return asyncio.run(fetcher.fetch(url))


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    hosts: list[str] = []

    def do_GET(self) -> None:
        type(self).hosts.append(self.headers["Host"])
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/no-length":  # else the body ends when the connection closes
            self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(server: http.server.ThreadingHTTPServer) -> Iterator[int]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def image_port() -> Iterator[int]:
    _ImageHandler.hosts = []
    yield from _serve(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler))


INWARD = [
    "127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fd00::1", "fe80::1%2", "fec0::1",
    "ff0e::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::7f00:1", "2002:a00:1::",
    "64:ff9b::a9fe:a9fe",
]  # fmt: skip


@pytest.mark.parametrize("address", INWARD)
def test_a_name_resolving_inward_is_refused_before_connecting(address: str) -> None:
    dns, transport = StubDNS(address), NoConnect()
    fetcher = MediaFetcher(("example.com",), resolver=dns, transport=transport)
    with pytest.raises(InvalidRequest, match="does not resolve to public addresses"):
        fetch(fetcher, "http://images.example.com/cat.png")
    assert dns.asked == [("images.example.com", 80)]
    assert transport.requests == []  # refused before any connection


def test_one_inward_record_among_public_ones_is_refused() -> None:
    transport = NoConnect()
    fetcher = MediaFetcher(
        ("example.com",), resolver=StubDNS(PUBLIC, "10.0.0.7"), transport=transport
    )
    with pytest.raises(InvalidRequest, match="public addresses"):
        fetch(fetcher, "https://example.com/cat.png")
    assert transport.requests == []


def test_the_request_goes_to_the_checked_address_with_the_name_kept() -> None:
    transport = NoConnect()
    fetcher = MediaFetcher(("example.com",), resolver=StubDNS(PUBLIC), transport=transport)
    assert fetch(fetcher, "https://img.example.com:8443/a/cat.png?x=1") == PNG
    (request,) = transport.requests
    assert request.url == httpx.URL(f"https://{PUBLIC}:8443/a/cat.png?x=1")
    assert request.headers["Host"] == "img.example.com:8443"
    assert request.extensions["sni_hostname"] == "img.example.com"
    assert request.headers["Accept-Encoding"] == "identity"


def test_allowed_networks_let_a_private_address_through() -> None:
    transport = NoConnect()  # 10.x is never dialled: the mock answers
    fetcher = MediaFetcher(
        ("example.com",), ("10.0.0.0/8",), resolver=StubDNS("10.1.2.3"), transport=transport
    )
    assert fetch(fetcher, "http://example.com/cat.png") == PNG
    assert transport.requests[0].url.host == "10.1.2.3"
    other = MediaFetcher(("example.com",), ("10.0.0.0/8",), resolver=StubDNS("169.254.169.254"))
    with pytest.raises(InvalidRequest, match="public addresses"):
        fetch(other, "http://example.com/cat.png")


def test_loopback_allowed_reaches_a_real_server(
    image_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # trust_env=False: never used
    dns = StubDNS("127.0.0.1")
    fetcher = MediaFetcher(("images.test",), LOOPBACK, resolver=dns)
    assert fetch(fetcher, f"http://images.test:{image_port}/cat.png") == PNG
    assert _ImageHandler.hosts == [f"images.test:{image_port}"]
    with pytest.raises(InvalidRequest, match="HTTP 302"):  # redirects are not followed
        fetch(fetcher, f"http://images.test:{image_port}/redirect")
    assert len(_ImageHandler.hosts) == 2
    closed = MediaFetcher(("images.test",), resolver=dns)  # loopback not allowed
    with pytest.raises(InvalidRequest, match="public addresses"):
        fetch(closed, f"http://images.test:{image_port}/cat.png")
    assert len(_ImageHandler.hosts) == 2


def test_the_byte_cap_holds_on_remote_images(image_port: int) -> None:
    fetcher = MediaFetcher(("images.test",), LOOPBACK, max_bytes=100, resolver=StubDNS("127.0.0.1"))
    for path in ("/cat.png", "/no-length"):  # refused from the header, then while reading
        with pytest.raises(InvalidRequest, match="byte cap"):
            fetch(fetcher, f"http://images.test:{image_port}{path}")


class _IPv6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_an_ipv6_address_is_dialled_in_brackets() -> None:
    _ImageHandler.hosts = []
    for port in _serve(_IPv6Server(("::1", 0), _ImageHandler)):
        fetcher = MediaFetcher(("images.test",), LOOPBACK, resolver=StubDNS("::1"))
        assert fetch(fetcher, f"http://images.test:{port}/cat.png") == PNG
        assert _ImageHandler.hosts == [f"images.test:{port}"]


def _trickle(listener: socket.socket, stop: threading.Event) -> None:
    """Answer one request with a 1000-byte body sent one byte every 0.5 s."""
    conn, _ = listener.accept()
    with conn:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n")
        while not stop.wait(0.5):
            try:
                conn.sendall(b"x")
            except OSError:
                return


def test_a_trickling_server_is_cut_at_the_deadline() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    thread = threading.Thread(target=_trickle, args=(listener, stop), daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    fetcher = MediaFetcher(("images.test",), LOOPBACK, timeout_s=1.5, resolver=StubDNS("127.0.0.1"))
    start = time.monotonic()
    try:
        with pytest.raises(InvalidRequest, match=r"took over 1\.5 s"):
            fetch(fetcher, f"http://images.test:{port}/slow.png")
    finally:
        stop.set()
        listener.close()
    elapsed = time.monotonic() - start
    assert 1.4 < elapsed < 3.0, elapsed  # per-read timeouts alone would wait 500 s


def test_a_slow_resolver_counts_against_the_deadline() -> None:
    async def slow(host: str, port: int) -> Sequence[str]:
        await asyncio.sleep(30)
        return ["127.0.0.1"]

    fetcher = MediaFetcher(("images.test",), LOOPBACK, timeout_s=0.5, resolver=slow)
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"took over 0\.5 s"):
        fetch(fetcher, "http://images.test/cat.png")
    assert time.monotonic() - start < 2


BYPASSES = [
    "http://example.com@127.0.0.1/cat.png",
    "http://user:secret@example.com/cat.png",
    "http://example.com\\@127.0.0.1/cat.png",
    "http://127.0.0.1#@example.com/cat.png",
    "http://2130706433/cat.png",
    "http://0x7f.1/cat.png",
    "http://[::ffff:127.0.0.1]/cat.png",
    "http://example.com./cat.png",
    "http://evilexample.com/cat.png",
    "http://example.com.evil.net/cat.png",
    "ftp://example.com/cat.png",
    "file:///etc/passwd",
    "gopher://example.com/",
    "http:///cat.png",
]


@pytest.mark.parametrize("url", BYPASSES)
def test_allow_list_bypasses_are_refused_before_resolving(url: str) -> None:
    dns, transport = StubDNS(PUBLIC), NoConnect()
    fetcher = MediaFetcher(("example.com",), resolver=dns, transport=transport)
    with pytest.raises(InvalidRequest):
        fetch(fetcher, url)
    assert dns.asked == [] and transport.requests == []


def test_remote_urls_are_off_without_an_allow_list() -> None:
    dns = StubDNS(PUBLIC)
    with pytest.raises(InvalidRequest, match="remote image URLs are off"):
        fetch(MediaFetcher(resolver=dns), "http://example.com/cat.png")
    assert dns.asked == []


def test_a_name_that_does_not_resolve_is_a_400() -> None:
    async def nxdomain(host: str, port: int) -> Sequence[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(InvalidRequest, match="cannot resolve"):
        fetch(MediaFetcher(("example.com",), resolver=nxdomain), "http://example.com/cat.png")


def test_the_system_resolver_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def slow_getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.4)
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)

    async def main() -> tuple[list[str], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        found = await resolve("127.0.0.1", 80)
        ticker.cancel()
        return found, ticks

    found, ticks = asyncio.run(main())
    assert found == ["127.0.0.1"] and ticks >= 10


def test_address_classes() -> None:
    import ipaddress

    assert all(not is_global_unicast(ipaddress.ip_address(a.partition("%")[0])) for a in INWARD)
    assert is_global_unicast(ipaddress.ip_address(PUBLIC))
    assert is_global_unicast(ipaddress.ip_address("2a00:1450:4001::1"))


# -- TLS: the certificate is checked against the name, not the address -------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, list[str]]]:
    """An HTTPS image server on loopback with a self-signed certificate for images.test;
    yields its port, the certificate (the client's CA) and the SNI names it was sent."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "2", "-subj", "/CN=images.test",
         "-addext", "subjectAltName=DNS:images.test"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str] = []
    context.sni_callback = lambda sock, name, ctx: names.append(str(name))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    for port in _serve(server):
        yield port, cert, names


def test_https_keeps_sni_and_checks_the_certificate_name(
    tls_server: tuple[int, Path, list[str]],
) -> None:
    port, cert, names = tls_server
    verify = ssl.create_default_context(cafile=str(cert))
    dns = StubDNS("127.0.0.1")
    fetcher = MediaFetcher(("test",), LOOPBACK, resolver=dns, verify=verify)
    assert fetch(fetcher, f"https://images.test:{port}/cat.png") == PNG
    assert names[-1] == "images.test"
    with pytest.raises(InvalidRequest, match="cannot fetch the image"):  # not its name
        fetch(fetcher, f"https://other.test:{port}/cat.png")
    untrusted = MediaFetcher(("test",), LOOPBACK, resolver=dns)  # the system CAs only
    with pytest.raises(InvalidRequest, match="cannot fetch the image"):
        fetch(untrusted, f"https://images.test:{port}/cat.png")


def test_media_flags_reach_the_gateway_config() -> None:
    import argparse

    from gateway.__main__ import config_from_args, parse_args
    from services.config import GatewayConfig
    from tessera.cli import _serve_parser, build_services

    flags = ["--max-image-aspect-ratio", "50", "--allowed-media-networks", "10.0.0.0/8", "::1"]
    flags += ["--allowed-media-domains", "example.com", "--media-fetch-timeout", "3"]
    config = config_from_args(parse_args(flags))
    assert config.max_image_aspect_ratio == 50 and config.media_fetch_timeout_s == 3
    assert config.allowed_media_networks == ("10.0.0.0/8", "::1")
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    gateway_argv = build_services(parser.parse_args(["serve", *flags]), "token")[-1].argv
    served = config_from_args(parse_args(gateway_argv[3:]))  # `tessera serve` passes them on
    assert served.max_image_aspect_ratio == 50 and served.media_fetch_timeout_s == 3
    assert served.allowed_media_networks == ("10.0.0.0/8", "::1")
    with pytest.raises(ValueError, match="not a CIDR"):
        GatewayConfig(allowed_media_networks=("example.com",))
    with pytest.raises(ValueError, match="aspect"):
        GatewayConfig(max_image_aspect_ratio=0.5)
