"""Fit or refuse on chat completions and Responses, as agents meet it on a small local context:
a max_tokens past the room the prompt leaves is lowered to that room (as on /v1/messages, and as
llama.cpp, Ollama and LM Studio do; opencode's compaction looped on a refusal), and a prompt that
leaves no room is refused in the words each API's clients match to compact.

make_pair's tiny target: a 1024-token context, one token per byte of text.
"""

from __future__ import annotations

import logging

import openai
import pytest
from service_support import LONG_PROMPT

CONTEXT = 1024
ASKED = 5000  # any agent's default, far past the tiny context


@pytest.mark.parametrize("stream", [False, True])
def test_chat_lowers_max_tokens_to_the_room_left(gpt, caplog, stream):
    with caplog.at_level(logging.INFO, logger="dflash_local.service"):
        reply = gpt.chat.completions.create(
            model="tiny", max_tokens=ASKED, stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
            messages=[{"role": "user", "content": LONG_PROMPT}])
        if stream:
            chunks = list(reply)
            usage = chunks[-1].usage
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        else:
            usage, finish = reply.usage, reply.choices[0].finish_reason
    room = CONTEXT - usage.prompt_tokens
    assert (finish, usage.completion_tokens) == ("length", room)
    assert f"max_tokens {ASKED} lowered to the {room} tokens left" in caplog.text


def test_responses_lowers_max_output_tokens_to_the_room_left(gpt):
    response = gpt.responses.create(model="tiny", max_output_tokens=ASKED, input=LONG_PROMPT)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == CONTEXT - response.usage.input_tokens


def test_chat_refuses_a_prompt_that_leaves_no_room_in_openais_words(gpt):
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(model="tiny", max_tokens=8,
                                    messages=[{"role": "user", "content": "x" * CONTEXT}])
    error = refused.value.response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # litellm (ContextWindowExceededError) and the agents' overflow checks match these words
    assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. "
                                       f"However, your messages resulted in ")
    assert error["message"].endswith(" tokens. Please reduce the length of the messages.")


def test_responses_refuses_a_prompt_that_leaves_no_room_in_openais_words(gpt):
    with pytest.raises(openai.BadRequestError) as refused:
        gpt.responses.create(model="tiny", max_output_tokens=8, input="x" * CONTEXT)
    error = refused.value.response.json()["error"]
    assert error["code"] == "context_length_exceeded"  # what Codex reads
    assert error["message"].startswith("Your input exceeds the context window of this model (")
    assert f" tokens > {CONTEXT - 1} maximum). Please adjust" in error["message"]
