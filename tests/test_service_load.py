"""16 clients stream at once: each is served or refused with 429 and Retry-After, no stream
breaks, and every served reply is token for token what the same request gets alone (greedy)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from service_support import make_pair, start_service

CLIENTS = 16
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _state, server = start_service(*make_pair(tmp_path_factory.mktemp("pair")))
    yield server
    server.stop()


def request(index: int) -> dict:
    return {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": f"Client {index}: say something about {index * 7}."}]}


def stream(client: openai.OpenAI, index: int) -> tuple[list[int], str, str | None]:
    """(token ids, text, finish reason) of one streamed reply."""
    token_ids, text, finish = [], "", None
    for chunk in client.chat.completions.create(**request(index), stream=True):
        token_ids += chunk.model_extra["dflash"]["token_ids"]
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return token_ids, text, finish


def test_sixteen_streams_at_once(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    start = threading.Barrier(CLIENTS)

    def one(index: int):
        start.wait()
        try:
            return "served", stream(client, index)
        except openai.RateLimitError as exc:
            return "refused", (exc.response.headers.get("retry-after"), exc.body["code"])

    with ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = list(pool.map(one, range(CLIENTS)))
    served = {index: result for index, (kind, result) in enumerate(outcomes) if kind == "served"}
    refused = [result for kind, result in outcomes if kind == "refused"]
    assert len(served) + len(refused) == CLIENTS and served
    assert all(result == ("1", "queue_full") for result in refused)
    for index, (token_ids, text, finish) in served.items():
        assert finish in ("stop", "length") and token_ids, index
        assert stream(client, index) == (token_ids, text, finish), index  # alone, the same
