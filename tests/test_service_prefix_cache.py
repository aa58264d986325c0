"""The prefix cache through the service: a real server on 127.0.0.1, the official openai SDK, a
two-turn chat; `usage.prompt_tokens_details.cached_tokens` streamed and not, the `dflash` stats'
prefill tokens, every answer equal to a `--no-prefix-cache` server's; the flags refused with
their reasons."""

from __future__ import annotations

import openai
import pytest
from service_support import make_pair

from dflash_local.cli.main import build_parser, main
from dflash_local.cli.options import serve_options


def _start(pair, *flags):
    from dflash_local.service.app import create_app
    from dflash_local.service.server import BackgroundServer
    from dflash_local.service.state import ServiceState

    args = build_parser().parse_args(["serve", "--engine", "transformers", "--dtype", "float32",
                                      *flags])
    state = ServiceState(load_options=serve_options(args))  # the real loader: load_engine
    state.load("transformers", *pair, served_name="tiny")
    server = BackgroundServer(create_app(state)).start()
    return state, server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pair = make_pair(tmp_path_factory.mktemp("pair"))
    cached, uncached = _start(pair, "--prefix-cache-mb", "64"), _start(pair, "--no-prefix-cache")
    yield cached, uncached
    for _state, server, _client in (cached, uncached):
        server.stop()


def ask(client, messages, stream: bool):
    """(reply text, usage) of one greedy completion."""
    request = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}
    if not stream:
        reply = client.chat.completions.create(**request)
        return reply.choices[0].message.content, reply.usage
    chunks = list(client.chat.completions.create(**request, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return text, chunks[-1].usage


@pytest.mark.parametrize("stream", [True, False])
def test_a_second_turn_comes_from_the_cache_and_answers_the_same(servers, stream):
    (state, _, client), (plain_state, _, plain_client) = servers
    assert plain_state.loaded.engine.prefix_cache is None
    assert state.loaded.engine.prefix_cache.budget == 64 << 20
    state.loaded.engine.prefix_cache.clear()
    talk = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Tell me about rivers ({stream})."}]
    first, usage = ask(client, talk, stream)
    assert usage.prompt_tokens_details.cached_tokens == 0  # shares nothing with any entry
    assert usage.model_extra["dflash"]["prefill_tokens"] == usage.prompt_tokens
    assert (first, 0) == _plain(plain_client, talk, stream)
    talk += [{"role": "assistant", "content": first}, {"role": "user", "content": "And lakes?"}]
    second, usage2 = ask(client, talk, stream)
    cached = usage2.prompt_tokens_details.cached_tokens
    assert cached >= usage.prompt_tokens  # at least all of turn 1's prompt
    assert usage2.model_extra["dflash"]["prefill_tokens"] == usage2.prompt_tokens - cached
    assert usage2.model_extra["dflash"]["cached_tokens"] == cached
    assert (second, 0) == _plain(plain_client, talk, stream)


def test_an_idle_worker_readies_the_next_turn_as_the_next_request_spells_it(servers):
    """After a reply, with no job queued, the worker prefills the conversation as the next
    request will tokenize it (engines/turn_warmup.py): the next turn reuses all of it, and
    still answers what a --no-prefix-cache server answers."""
    from service_support import wait_until

    from dflash_local.engines.chat_prompt import next_turn_ids

    (state, _, client), (_, _, plain_client) = servers
    engine, worker = state.loaded.engine, state.loaded.worker
    engine.prefix_cache.clear()
    ended, warmed = worker.warm_ups_ended, worker.warmed
    talk = [{"role": "user", "content": "List some birds, please."}]
    first, usage = ask(client, talk, stream=True)
    wait_until(lambda: worker.warm_ups_ended > ended)
    assert worker.warmed == warmed + 1
    history = next_turn_ids(engine.tokenizer, talk, first, engine.encode_chat(talk))
    talk += [{"role": "assistant", "content": first}, {"role": "user", "content": "And fish?"}]
    second, usage2 = ask(client, talk, stream=False)
    assert usage2.prompt_tokens_details.cached_tokens >= len(history) > usage.prompt_tokens
    assert (second, 0) == _plain(plain_client, talk, stream=False)


def _plain(client, messages, stream):
    text, usage = ask(client, messages, stream)
    return text, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefix-cache-mb", "0"], "--prefix-cache-mb must be >= 1, got 0"),
    (["--prefix-cache-mb", str(1 << 30)], "more than this machine's memory"),
    (["--prefix-cache-mb", "64", "--no-prefix-cache"], "not both"),
])
def test_bad_budgets_are_refused_before_anything_loads(flags, message, capsys):
    assert main(["serve", "--no-load", *flags]) != 0
    assert message in capsys.readouterr().err
