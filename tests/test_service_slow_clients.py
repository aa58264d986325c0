"""Slow and idle clients are timed out on a real socket against the real server: headers that
never finish, a body trickled in, a connection that sends nothing, one kept alive and left idle.
A streamed reply that outlives the deadline is not cut."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from service_support import LONG_PROMPT, make_pair, torch_loader

DEADLINE_S = 0.4  # the headers' and the body's, small so each test waits under a second
GIVE_UP_S = 20.0  # no answer by then: the server holds the connection


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    target, drafter = make_pair(tmp_path_factory.mktemp("pair"))
    state = ServiceState(loader=torch_loader, hub_cache_dir=tmp_path_factory.mktemp("hub"))
    state.load("transformers", target, drafter, served_name="tiny")
    app = create_app(state, body_timeout_s=DEADLINE_S)
    with BackgroundServer(app, headers_timeout_s=DEADLINE_S) as running:
        yield running


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=GIVE_UP_S)


def trickle_until_closed(sock: socket.socket, data: bytes) -> bytes:
    """Sends `data` a byte at a time, a few per deadline, and returns what the server sent
    until it closed; fails if it never does."""
    received, started = b"", time.monotonic()
    for byte in data:
        readable, _, _ = select.select([sock], [], [], DEADLINE_S / 4)
        if readable:
            return received + read_until_closed(sock)
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return received + read_until_closed(sock)
        assert time.monotonic() - started < GIVE_UP_S, "the server never closed a trickle"
    raise AssertionError("the whole request trickled in: the server never timed it out")


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(65536):  # the socket's own timeout fails a held connection
            received += chunk
    except ConnectionResetError:
        pass
    return received


def headers(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_headers_trickled_in_get_a_408_and_a_close(server):
    with connect(server) as sock:
        answer = trickle_until_closed(sock, headers("/v1/chat/completions", 10) + b"x" * 4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_connection_that_sends_nothing_is_closed(server):
    with connect(server) as sock:
        assert read_until_closed(sock) == b""


def test_an_idle_kept_alive_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"),
                                         ("/v1/messages", "anthropic")])
def test_a_body_trickled_in_gets_a_408_in_the_apis_shape(server, path, shape):
    body = json.dumps({"model": "tiny", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Hi" * 2000}]}).encode()
    with connect(server) as sock:
        sock.sendall(headers(path, len(body)))
        answer = trickle_until_closed(sock, body)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(payload)
    if shape == "anthropic":
        assert error["type"] == "error", error
    else:
        assert error["error"]["code"] == "request_timeout", error
    assert "request body not received within" in error["error"]["message"], error


def test_many_slow_clients_are_all_closed(server):
    socks = [connect(server) for _ in range(20)]
    for sock in socks:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        assert all(read_until_closed(sock).startswith(b"HTTP/1.1 408") for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_stream_longer_than_the_deadline_is_not_cut(server):
    request = {"model": "tiny", "max_tokens": 400, "stream": True,
               "messages": [{"role": "user", "content": LONG_PROMPT}]}
    started = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=request,
                      timeout=GIVE_UP_S) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started > 2 * DEADLINE_S, "the premise: the stream outlived it"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert sum("delta" in line for line in lines) > 100
