"""The Python clients people point at a local server, each streaming one reply from the embedded
pair served on 127.0.0.1 (tests/client_harness.py; the clients live in scripts/setup_clients.sh's
venv and run as subprocesses). Greedy and speculative, every reply equals the service's plain
decoding of the same conversation, whichever API the client speaks: the three APIs render one
prompt, and speculation is lossless. Some clients send their own model names (openai-agents'
default, pydantic-ai's gpt-4o, Claude's): any name but another known pair's is the loaded pair.

Skipped without the clients' venv (CI runs them with DFLASH_CI_CLIENTS=1).
"""

from __future__ import annotations

import json

import httpx
import pytest
from client_harness import API_KEY, requires_clients

pytestmark = requires_clients

PROMPT = "Name three colours of the rainbow."
COMPLETION_PROMPT = "The three primary colours are"  # /v1/completions: the text as it is
COMPLETION_TOKENS = 24
# past the reply's natural end (62 tokens): openai-agents takes a reply cut at max_tokens for a
# failed turn, as it would from the real API
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def plain_text(py_clients) -> str:
    return py_clients.plain_reply([{"role": "user", "content": PROMPT}], MAX_TOKENS)


def streamed(output: str) -> str:
    """The text a snippet printed, after checking it arrived in more than one piece."""
    reply = json.loads(output.strip().splitlines()[-1])
    assert reply["pieces"] > 1, reply  # streamed, not one body
    return reply["text"]


def snippet(body: str) -> str:
    """`body` collects the reply's pieces with `pieces.append`; the snippet prints them."""
    return f"import json, os\npieces = []\n{body}\nprint(json.dumps({{'pieces': len(pieces), 'text': ''.join(pieces)}}))"


LITELLM_CHAT = f"""
import litellm
stream = litellm.completion(model="openai/" + os.environ["DFLASH_MODEL"], stream=True,
                            api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                            messages=[{{"role": "user", "content": {PROMPT!r}}}], max_tokens={MAX_TOKENS})
for chunk in stream:
    pieces.append(chunk.choices[0].delta.content or "")
pieces[:] = [p for p in pieces if p]
"""

LITELLM_MESSAGES = f"""
import litellm
stream = litellm.completion(model="anthropic/claude-sonnet-4-5", stream=True,
                            api_base=os.environ["ANTHROPIC_BASE_URL"], api_key=os.environ["ANTHROPIC_API_KEY"],
                            messages=[{{"role": "user", "content": {PROMPT!r}}}], max_tokens={MAX_TOKENS})
for chunk in stream:
    pieces.append(chunk.choices[0].delta.content or "")
pieces[:] = [p for p in pieces if p]
"""

LITELLM_RESPONSES = f"""
import litellm
stream = litellm.responses(model="openai/" + os.environ["DFLASH_MODEL"], stream=True,
                           api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                           input={PROMPT!r}, max_output_tokens={MAX_TOKENS})
for event in stream:
    if getattr(event, "type", "") == "response.output_text.delta":
        pieces.append(event.delta)
"""

LANGCHAIN_OPENAI = f"""
from langchain_openai import ChatOpenAI
model = ChatOpenAI(model=os.environ["DFLASH_MODEL"], max_tokens=int(os.environ.get("MAX_TOKENS", {MAX_TOKENS})),
                   temperature=0,
                   use_responses_api=os.environ.get("USE_RESPONSES") == "1")
for chunk in model.stream({PROMPT!r}):
    pieces.append(chunk.text)
pieces[:] = [p for p in pieces if p]
"""

LANGCHAIN_ANTHROPIC = f"""
from langchain_anthropic import ChatAnthropic
model = ChatAnthropic(model="claude-sonnet-4-5", max_tokens={MAX_TOKENS}, temperature=0,
                      base_url=os.environ["ANTHROPIC_BASE_URL"], max_retries=0)
for chunk in model.stream({PROMPT!r}):
    pieces.append(chunk.text)
pieces[:] = [p for p in pieces if p]
"""

OPENAI_AGENTS = f"""
import asyncio
from agents import Agent, ModelSettings, Runner
from openai.types.responses import ResponseTextDeltaEvent
async def main():
    # no model named: the SDK's default (gpt-4.1) is served by the loaded pair
    agent = Agent(name="assistant", model_settings=ModelSettings(max_tokens={MAX_TOKENS}, temperature=0))
    run = Runner.run_streamed(agent, {PROMPT!r})
    async for event in run.stream_events():
        if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
            pieces.append(event.data.delta)
asyncio.run(main())
"""

PYDANTIC_AI = f"""
import asyncio
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
model = OpenAIChatModel("gpt-4o", provider=OpenAIProvider(
    base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]))
async def main():
    agent = Agent(model, model_settings={{"max_tokens": {MAX_TOKENS}, "temperature": 0}})
    async with agent.run_stream({PROMPT!r}) as result:
        async for delta in result.stream_text(delta=True):
            pieces.append(delta)
asyncio.run(main())
"""

INSTRUCTOR = f"""
import instructor, openai
client = instructor.from_openai(openai.OpenAI(max_retries=0))
stream = client.chat.completions.create(model=os.environ["DFLASH_MODEL"], response_model=None,
                                        stream=True, max_tokens={MAX_TOKENS},
                                        messages=[{{"role": "user", "content": {PROMPT!r}}}])
for chunk in stream:
    pieces.append(chunk.choices[0].delta.content or "") if chunk.choices else None
pieces[:] = [p for p in pieces if p]
"""

LITELLM_TEXT_COMPLETION = f"""
import litellm
stream = litellm.text_completion(model="text-completion-openai/" + os.environ["DFLASH_MODEL"],
                                 api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                                 prompt={COMPLETION_PROMPT!r}, max_tokens={COMPLETION_TOKENS}, stream=True)
for chunk in stream:
    pieces.append(chunk.choices[0].text or "")
pieces[:] = [p for p in pieces if p]
"""

SNIPPETS = {
    "litellm-chat": (LITELLM_CHAT, {}), "litellm-messages": (LITELLM_MESSAGES, {}),
    "litellm-responses": (LITELLM_RESPONSES, {}),
    "langchain-openai": (LANGCHAIN_OPENAI, {}),
    "langchain-openai-responses": (LANGCHAIN_OPENAI, {"USE_RESPONSES": "1"}),
    # past the 8192-token context: lowered to the room, the same reply (opencode's case)
    "langchain-openai-past-the-context": (LANGCHAIN_OPENAI, {"MAX_TOKENS": "100000"}),
    "langchain-openai-responses-past-the-context": (LANGCHAIN_OPENAI, {"USE_RESPONSES": "1",
                                                                       "MAX_TOKENS": "100000"}),
    "langchain-anthropic": (LANGCHAIN_ANTHROPIC, {}),
    "openai-agents": (OPENAI_AGENTS, {}), "pydantic-ai": (PYDANTIC_AI, {}),
    "instructor": (INSTRUCTOR, {}),
}


@pytest.mark.parametrize("client", list(SNIPPETS))
def test_a_client_streams_the_plain_reply(py_clients, plain_text, client):
    body, env = SNIPPETS[client]
    assert streamed(py_clients.run(snippet(body), **env)) == plain_text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_llm_streams_the_plain_reply(py_clients, plain_text, api):
    """The `llm` command line, as its docs point at an OpenAI-compatible endpoint."""
    args = ["-m", "llm", "openai", "endpoint", py_clients.base_url + "/v1", PROMPT,
            "-m", py_clients.model, "-o", "max_tokens", str(MAX_TOKENS), "--key", API_KEY]
    output = py_clients.run_argv(args + (["--responses"] if api == "responses" else []))
    assert output.strip() == plain_text.strip()


def test_llm_lists_what_a_client_may_send(py_clients):
    listed = py_clients.run_argv(["-m", "llm", "openai", "endpoint", py_clients.base_url + "/v1",
                                  "--models", "--key", API_KEY])
    assert py_clients.model in listed.split()


def test_litellm_text_completion_streams_the_plain_continuation(py_clients):
    """litellm's text_completion over /v1/completions: the prompt untemplated."""
    response = httpx.post(py_clients.base_url + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": py_clients.model, "prompt": COMPLETION_PROMPT,
                                "max_tokens": COMPLETION_TOKENS, "speculative": False})
    assert response.status_code == 200, response.text
    plain = response.json()["choices"][0]["text"]
    assert streamed(py_clients.run(snippet(LITELLM_TEXT_COMPLETION))) == plain
