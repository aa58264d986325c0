"""/v1/messages as Claude Code and the other Anthropic clients use it, through the real `anthropic`
SDK against the real server: system turns inside `messages`, a big tool list, `max_tokens: 32000`
against a small context, count_tokens, the model names of Claude Code's slots, keep-alive pings
during a long prefill, and every 4xx in the log with its reason.

Two targets: make_pair's, whose template renders a system turn anywhere, and agent_tiny's, which
takes tools and one system prompt at the start.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import anthropic
import httpx
import pytest
from agent_tiny import AGENT_TEMPLATE, QUESTION, SYSTEM, WEATHER_TOOL, agent_pair
from service_support import EOS_PROMPT, serve_module, start_service
from tiny_models import CHAT_TEMPLATE, make_tokenizer

from dflash_local.errors import InvalidRequestError, PromptTooLongError
from dflash_local.pairs.catalog import load_catalog
from dflash_local.service import jobs
from dflash_local.service.anthropic_messages import anthropic_context_error
from dflash_local.service.system_turns import SystemTurns, place_system_turns

CONTEXT = 1024  # both tiny targets' max_position_embeddings; one token per byte of text
REMINDER = "Answer in one line."
FUNCTION = WEATHER_TOOL["function"]
# tools in Claude Code's shape (strict schemas), as many as the tiny context leaves room for
TOOLS = [{"name": FUNCTION["name"], "description": FUNCTION["description"],
          "input_schema": FUNCTION["parameters"]}] + [
    {"name": name, "description": description, "input_schema": {
        "type": "object", "properties": {field: {"type": "string"}}, "required": [field],
        "additionalProperties": False}}
    for name, description, field in (("Bash", "Run a shell command", "command"),
                                      ("Read", "Read a file", "file_path"),
                                      ("Task", "Start a sub-agent", "prompt"))]


def claude_code_body(**extra) -> dict:
    """A first request as Claude Code 2.1 sends it: system as cached text blocks, a system turn
    inside `messages`, content blocks with cache_control, metadata, max_tokens 32000."""
    cached = {"type": "ephemeral"}
    return {"model": "claude-sonnet-4-5", "max_tokens": 32000, "metadata": {"user_id": "user_1"},
            "system": [{"type": "text", "text": SYSTEM, "cache_control": cached}],
            "tools": TOOLS,
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION,
                                                       "cache_control": cached}]},
                         {"role": "system", "content": REMINDER}],
            **extra}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """make_pair's target: its template renders a system turn wherever it stands."""
    yield from serve_module(tmp_path_factory)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """agent_tiny's target: tools, and one system prompt, first (later ones it would drop)."""
    pair = agent_pair(tmp_path_factory)
    state, server = start_service(pair.target, pair.drafter,
                                  hub_cache_dir=tmp_path_factory.mktemp("hub"))
    yield state, server
    server.stop()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_system_turn_inside_messages_stays_where_the_template_takes_it(plain):
    _state, server = plain
    turns = [{"role": "user", "content": EOS_PROMPT}, {"role": "assistant", "content": "One."},
             {"role": "system", "content": REMINDER}, {"role": "user", "content": EOS_PROMPT}]
    message = client(server).messages.create(model="tiny", max_tokens=24, messages=turns)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 24, "temperature": 0, "messages": turns}).json()
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        chat["usage"]["prompt_tokens"]


def shown(message) -> list[tuple]:
    """A reply's blocks without their ids (each tool_use gets a fresh one)."""
    return [(block.type, getattr(block, "text", None), getattr(block, "name", None),
             getattr(block, "input", None)) for block in message.content]


def test_system_turns_merge_into_the_one_system_prompt_a_template_takes(agent, caplog):
    _state, server = agent
    claude = client(server)
    body = claude_code_body(max_tokens=64)
    with caplog.at_level(logging.INFO, logger="dflash_local.service"):
        inside = claude.messages.create(**body)
    merged = claude.messages.create(**{**body, "system": SYSTEM + "\n\n" + REMINDER,
                                       "messages": body["messages"][:1]})
    assert shown(inside) == shown(merged)
    assert inside.usage.input_tokens + inside.usage.cache_read_input_tokens == \
        merged.usage.input_tokens + merged.usage.cache_read_input_tokens
    assert "system turns messages.1 merged into the leading system prompt" in caplog.text
    assert REMINDER not in caplog.text  # what was moved is named, never its text


def test_claude_codes_first_request_is_served_with_max_tokens_fitted(agent, caplog):
    _state, server = agent
    # streamed, as Claude Code sends it (the SDK refuses 32000 without a stream)
    with (caplog.at_level(logging.INFO, logger="dflash_local.service"),
          client(server).messages.stream(**claude_code_body()) as events):
        message = events.get_final_message()
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert message.stop_reason in ("tool_use", "end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= CONTEXT - prompt
    assert f"max_tokens 32000 lowered to the {CONTEXT - prompt} tokens left" in caplog.text


@pytest.mark.parametrize("case", ["claude code", "no system, no tools"])
def test_count_tokens_is_the_prompt_the_request_gets(agent, case):
    _state, server = agent
    claude = client(server)
    body = claude_code_body(max_tokens=16)
    if case != "claude code":
        body = {"model": "claude-haiku-4-5", "max_tokens": 16,
                "messages": [{"role": "user", "content": QUESTION}]}
    counted = claude.messages.count_tokens(**{k: v for k, v in body.items()
                                              if k not in ("max_tokens", "metadata")})
    message = claude.messages.create(**body)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert counted.input_tokens > (500 if case == "claude code" else 20)  # the tools are counted


def test_count_tokens_refuses_as_messages_does(agent):
    _state, server = agent
    response = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": "tiny", "messages": [{"role": "developer", "content": "x"}]})
    assert response.status_code == 400
    assert response.json()["type"] == "error" and "messages.0.role" in response.json()["error"]["message"]


def test_any_model_name_is_the_loaded_pair_unless_it_names_another_known_pair(plain):
    _state, server = plain
    claude = client(server)
    replies = [claude.messages.create(model=name, max_tokens=8, messages=[{"role": "user", "content": EOS_PROMPT}])
               for name in ("tiny", "claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5")]
    assert len({reply.content[0].text for reply in replies}) == 1
    other = load_catalog().pairs[0].id
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model=other, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert f"model {other!r} is not loaded" in caught.value.body["error"]["message"]
    listed = httpx.get(server.url + "/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m["aliases"], m["any_name"]) for m in listed] == [("tiny", ["tiny-target"], True)]


@pytest.mark.parametrize(("path", "body", "text_of"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": EOS_PROMPT}], "max_tokens": 8},
     lambda reply: reply["choices"][0]["message"]["content"]),
    ("/v1/responses", {"input": EOS_PROMPT, "max_output_tokens": 8},
     lambda reply: reply["output"][-1]["content"][0]["text"])])
def test_every_api_takes_any_model_name_but_another_known_pairs(plain, path, body, text_of):
    """The same rule as /v1/messages: a relative path is a name like any other (nothing is
    opened: an existing file and a missing one answer alike)."""
    _state, server = plain
    texts = set()
    for name in ("tiny", "gpt-5-codex", "gpt-4o", "tests/conftest.py", "tests/no_such_file.py"):
        reply = httpx.post(server.url + path, json={"model": name, **body}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "tiny"
        texts.add(text_of(reply.json()))
    assert len(texts) == 1
    catalog = load_catalog().pairs
    for other in (catalog[1].id, catalog[1].target.repo):
        refused = httpx.post(server.url + path, json={"model": other, **body}, timeout=60)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert f"model {other!r} is not loaded" in refused.json()["error"]["message"]


def test_a_prompt_past_the_context_is_refused_in_anthropics_words(plain):
    _state, server = plain
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(server).messages.create(model="tiny", max_tokens=8,
                                       messages=[{"role": "user", "content": "x" * CONTEXT}])
    message = caught.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(f" tokens > {CONTEXT - 1} maximum")


def test_the_anthropic_wording_of_prompt_plus_max_tokens():
    # Claude Code matches /input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)/
    error = anthropic_context_error(PromptTooLongError("x", prompt_tokens=900, max_tokens=32000,
                                                       max_context=1024))
    assert str(error) == ("input length and `max_tokens` exceed context limit: 900 + 32000 > 1024, "
                          "decrease input length or `max_tokens` and try again")


@pytest.mark.parametrize("api", ["messages", "chat"])
def test_a_long_prefill_is_kept_alive(plain, monkeypatch, api):
    state, server = plain
    monkeypatch.setattr(jobs, "KEEPALIVE_S", 0.05)
    released, stream_of = threading.Event(), state.loaded.engine.stream

    def held_prefill(prompt_ids, params):  # the prefill waits until the client has seen a keep-alive
        released.wait(60)
        yield from stream_of(prompt_ids, params)

    monkeypatch.setattr(state.loaded.engine, "stream", held_prefill)
    path = "/v1/messages" if api == "messages" else "/v1/chat/completions"
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": EOS_PROMPT}]}
    lines, current = [], None
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line == "event: ping" or line.startswith(": keep-alive"):
                if not released.is_set():  # the prefill's progress, where the API has a place for it
                    current = httpx.get(server.url + "/dflash/status", timeout=60).json()["worker"]["current"]
                released.set()
    released.set()
    assert current["phase"] == "prefill" and current["prompt_tokens"] > 0, current
    if api == "messages":
        assert lines[0] == "event: ping"
    else:
        assert re.fullmatch(rf": keep-alive prefill {current['prompt_tokens']} tokens, \d+ s", lines[0]), lines[0]
    data = [json.loads(line.removeprefix("data: ")) for line in lines
            if line.startswith("data: {")]
    if api == "messages":
        assert next(e["type"] for e in data if e["type"] != "ping") == "message_start"
        assert data[-1]["type"] == "message_stop"
    else:
        assert [line for line in lines if line][-1] == "data: [DONE]"


def test_every_4xx_is_logged_with_its_reason_on_one_line(plain, caplog):
    _state, server = plain
    with caplog.at_level(logging.WARNING, logger="dflash_local.service"):
        httpx.post(server.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 8, "messages": [{"role": "developer", "content": "secret prompt"}]})
        httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": []})
        httpx.get(server.url + "/v1/nowhere", timeout=60)
    lines = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(line.startswith("400 POST /v1/messages: ") and "messages.0.role" in line for line in lines), lines
    assert any(line.startswith("400 POST /v1/chat/completions: ") and "messages" in line for line in lines), lines
    assert any(line.startswith("404 GET /v1/nowhere: ") for line in lines), lines
    assert all("\n" not in line and "secret prompt" not in line for line in lines)


# --- where a template takes system turns ---

NO_SYSTEM_TEMPLATE = (  # Gemma 2's rules: no system role, turns alternate user / model
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.mark.parametrize(("template", "expected"), [
    (CHAT_TEMPLATE, SystemTurns.ANYWHERE), (AGENT_TEMPLATE, SystemTurns.LEADING),
    (NO_SYSTEM_TEMPLATE, SystemTurns.NONE)], ids=["chatml", "agent_tiny", "gemma2"])
def test_a_templates_system_turns_are_read_from_the_template(tmp_path, template, expected):
    tokenizer = make_tokenizer(tmp_path)
    tokenizer.chat_template = template
    assert SystemTurns.of_template(tokenizer) is expected


def test_a_system_turn_for_a_template_without_one_is_a_400_naming_it():
    sourced = [("messages.0", {"role": "user", "content": "Hi"}),
               ("messages.1", {"role": "system", "content": REMINDER})]
    with pytest.raises(InvalidRequestError, match=r"messages\.1\.role: 'system': the chat template of gemma"):
        place_system_turns(sourced, SystemTurns.NONE, "gemma")
    with pytest.raises(InvalidRequestError, match=r"^system: a system prompt: the chat template of gemma"):
        place_system_turns([("system", {"role": "system", "content": "x"}), *sourced], SystemTurns.NONE, "gemma")
    assert place_system_turns(sourced, SystemTurns.LEADING, "qwen") == [
        {"role": "system", "content": REMINDER}, {"role": "user", "content": "Hi"}]
