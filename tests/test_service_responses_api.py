"""POST /v1/responses end to end: the real server on a tiny random pair, driven by the official
`openai` SDK's responses.create / responses.stream; every reply checked against
/v1/chat/completions on the same conversation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from service_support import EOS_PROMPT, LONG_PROMPT, assert_openai_error, serve_module

from dflash_local.service.openai_responses_schemas import ResponsesRequest

SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from serve_module(tmp_path_factory)


@pytest.fixture(scope="module")
def server(service):
    return service[1]


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(gpt, prompt: str, max_tokens: int) -> str:
    reply = gpt.chat.completions.create(
        model="tiny", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])
    return reply.choices[0].message.content


def test_a_response_is_the_chat_reply_in_responses_shape(gpt):
    response = gpt.responses.create(model="tiny", instructions=SYSTEM, input=EOS_PROMPT,
                                    max_output_tokens=64)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat_text(gpt, EOS_PROMPT, 64)
    usage = response.usage
    assert 0 < usage.output_tokens < 64
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.model_extra["dflash"]["engine"] == "transformers"


def test_max_output_tokens_makes_it_incomplete(gpt):
    response = gpt.responses.create(model="tiny", instructions=SYSTEM, input=LONG_PROMPT,
                                    max_output_tokens=16)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16
    assert response.output_text == chat_text(gpt, LONG_PROMPT, 16)


def test_message_items_read_like_the_string_input(gpt):
    as_string = gpt.responses.create(model="tiny", instructions=SYSTEM, input=LONG_PROMPT,
                                     max_output_tokens=12)
    as_items = gpt.responses.create(model="tiny", max_output_tokens=12, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Tell me a "}, {"type": "input_text", "text": "long story."}]}])
    assert as_items.output_text == as_string.output_text


def test_streaming_sends_the_responses_events_in_order(gpt):
    whole = gpt.responses.create(model="tiny", instructions=SYSTEM, input=EOS_PROMPT, max_output_tokens=64)
    with gpt.responses.stream(model="tiny", instructions=SYSTEM, input=EOS_PROMPT,
                              max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta", "response.in_progress"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_every_round_streams_its_dflash_statistics(gpt):
    # the raw events (the stream helper rebuilds its events without our extra field)
    events = list(gpt.responses.create(model="tiny", instructions=SYSTEM, input=LONG_PROMPT,
                                       max_output_tokens=24, stream=True))
    rounds = [e.model_extra["dflash"] for e in events if e.model_extra and "dflash" in e.model_extra]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    assert sum(len(r["token_ids"]) for r in rounds) == 24
    assert events[-1].response.usage.model_extra["dflash"]["rounds"] == len(rounds) - 1


def test_a_cut_stream_ends_with_response_incomplete(gpt):
    events = list(gpt.responses.create(model="tiny", input=LONG_PROMPT, max_output_tokens=10, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output[0].content[0].text == text


def test_speculative_equals_plain(gpt):
    spec = gpt.responses.create(model="tiny", input=LONG_PROMPT, max_output_tokens=32,
                                extra_body={"speculative": True})
    plain = gpt.responses.create(model="tiny", input=LONG_PROMPT, max_output_tokens=32,
                                 extra_body={"speculative": False})
    assert spec.output_text == plain.output_text
    assert spec.usage.model_extra["dflash"]["block_size"] == 8
    assert plain.usage.model_extra["dflash"]["block_size"] == 1


OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": OBJECT}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
BAD = {
    "previous_response_id": ({"previous_response_id": "resp_1"}, ["previous_response_id"]),
    "store true": ({"store": True}, ["store"]),
    "a built-in tool": ({"tools": [{"type": "computer_use_preview"}]}, ["tools.0.type", "computer_use_preview"]),
    "a namespace tool clashing with a function": (
        {"tools": [TOOL, {"type": "namespace", "name": "weather", "description": "", "tools": [TOOL]}]},
        ["tools.1.tools.0.name", "'get_weather' is also the name of tools.0"]),
    "a custom tool with an unparsable regex": (
        {"tools": [{"type": "custom", "name": "digits", "format": {
            "type": "grammar", "syntax": "regex", "definition": "[0-9"}}]},
        ["tools.0.format.definition", "invalid regex", "[0-9"]),
    "a custom tool with a Lark grammar without start": (
        {"tools": [{"type": "custom", "name": "patch", "format": {
            "type": "grammar", "syntax": "lark", "definition": 'patch: "x"'}}]},
        ["tools.0.format.definition", "invalid Lark grammar", "no start rule"]),
    "an unknown reasoning effort": ({"reasoning": {"effort": "turbo"}}, ["reasoning.effort", "turbo"]),
    "a function tool without a name": ({"tools": [{**TOOL, "name": ""}]},
                                       ["tools.0: a function tool needs a name"]),
    "a schema that is not an object": ({"tools": [{**TOOL, "parameters": {"type": "array"}}]},
                                       ["tools.0.parameters", "object"]),
    "tool_choice naming an unknown function": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
                                               ["tool_choice.name", "nope"]),
    "an output answering no call": ({"input": [{"type": "function_call_output", "call_id": "call_9",
                                                "output": "sunny"}]}, ["input.0.call_id", "call_9"]),
    "an output without its call id": ({"input": [CALL, {"type": "function_call_output", "output": "sunny"}]},
                                      ["input.1", "call_id"]),
    "arguments that are not JSON": ({"input": [{**CALL, "arguments": "{city"}]}, ["input.0", "arguments"]),
    "tools for a template without them": ({"tools": [TOOL]}, ["tools", "no tool support"]),
    "an empty input": ({"input": []}, ["input"]),
    "an image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                      ["input.0", "content"]),
    "top_logprobs": ({"top_logprobs": 3}, ["top_logprobs", "chat/completions"]),
    "logprobs in include": ({"include": ["message.output_text.logprobs"]}, ["logprobs"]),
    "a json_schema text format": ({"text": {"format": {"type": "json_schema"}}}, ["text.format"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_a_400_naming_the_field(server, case):
    fields, words = BAD[case]
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, **fields}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    error = assert_openai_error(response, 400, "invalid_request")
    for word in words:
        assert word in error["message"], (word, error)


def test_function_items_become_the_templates_tool_calls_and_tool_messages():
    body = ResponsesRequest.model_validate({
        "model": "tiny", "instructions": "Use tools.", "tools": [TOOL], "tool_choice": "required",
        "input": [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "reasoning", "id": "rs_1", "summary": []}, CALL,
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]})
    assert body.template_messages() == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    assert body.job_tools() == ({"type": "function", "function": {
        "name": "get_weather", "parameters": OBJECT, "description": "Weather in a city"}},)
    assert body.job_tool_choice() == "required"


def test_replies_and_events_validate_as_the_sdks_types(server):
    # the SDK builds its objects without validation: validate strictly, every required field
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    for body in ({"model": "tiny", "input": EOS_PROMPT, "max_output_tokens": 64},
                 {"model": "tiny", "input": LONG_PROMPT, "max_output_tokens": 8, "tool_choice": "none"}):
        Response.model_validate(httpx.post(server.url + "/v1/responses", json=body, timeout=60).json())
        with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True},
                          timeout=60) as response:
            events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                      if line.startswith("data: ")]
        adapter = TypeAdapter(ResponseStreamEvent)
        assert [adapter.validate_python(e).type for e in events] == [e["type"] for e in events]


def test_an_error_after_the_stream_began_is_an_error_event():
    from openai.types.responses import ResponseErrorEvent

    from dflash_local.service.openai_responses import ResponsesEncoder

    encoder = ResponsesEncoder("resp_1", "tiny", ResponsesRequest.model_validate({"input": "Hi"}))
    sent = encoder.failed(503, "the generation was cancelled", "cancelled").decode()
    name, data = sent.strip().split("\n")
    assert name == "event: error"
    error = ResponseErrorEvent.model_validate(json.loads(data.removeprefix("data: ")))
    assert error.code == "cancelled" and error.message == "the generation was cancelled"


def test_built_in_tools_left_out_and_a_summary_asked_for_are_noted(gpt):
    # what Codex sends by default: the model is not offered the built-ins, the response says so
    plain = gpt.responses.create(model="tiny", instructions=SYSTEM, input=EOS_PROMPT, max_output_tokens=16)
    codex = {"tools": [{"type": "web_search", "external_web_access": False}, {"type": "tool_search"},
                       {"type": "web_search_2025_08_26"}],
             "reasoning": {"summary": "auto"}}
    noted = gpt.responses.create(model="tiny", instructions=SYSTEM, input=EOS_PROMPT,
                                 max_output_tokens=16, **codex)
    with gpt.responses.stream(model="tiny", instructions=SYSTEM, input=EOS_PROMPT,
                              max_output_tokens=16, **codex) as stream:
        streamed = next(e for e in stream if e.type == "response.completed").response
    assert noted.output_text == streamed.output_text == plain.output_text
    assert noted.usage.input_tokens == plain.usage.input_tokens
    notes = noted.model_extra["dflash_notes"]
    assert notes == streamed.model_extra["dflash_notes"] and plain.model_extra["dflash_notes"] == []
    assert [note.split(":")[0] for note in notes] == ["tools.0", "tools.1", "tools.2", "reasoning.summary 'auto'"]
    assert "'web_search' left out" in notes[0] and "'tool_search' left out" in notes[1]


def test_reasoning_effort_is_the_templates_thinking_switch(gpt):
    def thinking(effort):
        return ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": effort}}).thinking()

    assert [thinking(effort) for effort in ("none", "minimal", "low", "medium", "high", "xhigh")] == \
        [False, False, True, True, True, True]
    assert ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"summary": "auto"}}).thinking() is None
    # the tiny target's template has no switch: the effort is accepted, and noted
    response = gpt.responses.create(model="tiny", input=EOS_PROMPT, max_output_tokens=4,
                                    reasoning={"effort": "high"})
    assert response.model_extra["dflash_notes"] == [
        "reasoning.effort 'high': the target's chat template has no thinking switch; the effort changes nothing"]


def test_without_max_output_tokens_the_reply_may_fill_the_context(service):
    from dflash_local.service.openai_responses import job_request

    state, _server = service
    loaded = state.require_model(None)
    request = job_request(ResponsesRequest.model_validate({"input": "Hi"}), loaded)
    # OpenAI's default is the model's limit; the worker caps it to the room the prompt leaves
    assert request.params.max_tokens == loaded.engine.capabilities.max_context
    assert not request.max_tokens_given


def test_custom_tool_calls_go_back_into_the_template_as_calls():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Fix it."},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"},
        {"type": "function_call", "call_id": "call_2", "name": "read", "namespace": "fs", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "text"}]})
    assert body.template_messages() == [
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Done!"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "text"}]


def test_a_custom_or_namespaced_call_is_encoded_as_codex_reads_it():
    # the worker's pieces of two calls, encoded streamed and whole, validated as the SDK's types
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from dflash_local.events import StepEvent
    from dflash_local.service.job_items import Chunk, ToolCallDelta
    from dflash_local.service.jobs import Reply
    from dflash_local.service.openai_responses import ResponsesEncoder

    body = ResponsesRequest.model_validate({"input": "Hi", "tools": [
        {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "fs", "description": "Files.", "tools": [TOOL]}]})
    pieces = [(ToolCallDelta(0, "call_a", "apply_patch", '{"input": "*** Begin'),),
              (ToolCallDelta(0, arguments=' Patch"}'),),
              (ToolCallDelta(1, "call_b", "get_weather", '{"city": "Paris"}'),)]
    chunks = [Chunk("", StepEvent((index,), round_index=index), "tool_calls" if index == 2 else None, deltas)
              for index, deltas in enumerate(pieces)]
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "dflash": {},
             "prompt_tokens_details": {"cached_tokens": 0}}
    streamer = ResponsesEncoder("resp_1", "tiny", body)
    sent = b"".join(streamer.chunk(chunk) for chunk in chunks) + streamer.finished(usage)
    events = [TypeAdapter(ResponseStreamEvent).validate_json(line.removeprefix(b"data: "))
              for line in sent.split(b"\n") if line.startswith(b"data: ")]
    reply = Reply()
    for chunk in chunks:
        reply.add(chunk)
    whole = Response.model_validate(ResponsesEncoder("resp_1", "tiny", body).body(reply, usage))
    for output in (events[-1].response.output, whole.output):
        custom, function = output
        assert (custom.type, custom.name, custom.input, custom.call_id) == \
            ("custom_tool_call", "apply_patch", "*** Begin Patch", "call_a")
        assert (function.type, function.name, function.namespace) == ("function_call", "get_weather", "fs")
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == \
        "*** Begin Patch"
