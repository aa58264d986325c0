"""The frameworks' structured output against the embedded pair (tests/client_harness.py: the
clients run in scripts/setup_clients.sh's venv): llm `--schema`, LangChain
`with_structured_output(method="json_schema")`, openai-agents `output_type`, pydantic-ai
`NativeOutput` and instructor's JSON_SCHEMA mode each complete, and what each hands back
validates against its schema. Each one's reply equals the service's own constrained plain
decoding of the schema the framework sent, where the framework sends the conversation as given.

Skipped without the clients' venv (CI runs them with DFLASH_CI_CLIENTS=1).
"""

from __future__ import annotations

import json

import pytest
from client_harness import API_KEY, requires_clients

pytestmark = requires_clients

PROMPT = "Give one colour of the rainbow and its position in it, from 1 to 7."
MAX_TOKENS = 80
COLOURS = ("red", "orange", "yellow", "green", "blue", "indigo", "violet")

# every snippet defines the same answer type and prints it as JSON
ANSWER = """
import json, os
from typing import Literal
from pydantic import BaseModel, Field
class Colour(BaseModel):
    name: Literal["red", "orange", "yellow", "green", "blue", "indigo", "violet"]
    position: int = Field(ge=1, le=7)
"""

LANGCHAIN = ANSWER + f"""
from langchain_openai import ChatOpenAI
model = ChatOpenAI(model=os.environ["DFLASH_MODEL"], max_tokens={MAX_TOKENS}, temperature=0)
answer = model.with_structured_output(Colour, method="json_schema").invoke({PROMPT!r})
print(answer.model_dump_json())
"""

OPENAI_AGENTS = ANSWER + f"""
from agents import Agent, ModelSettings, Runner
agent = Agent(name="assistant", model=os.environ["DFLASH_MODEL"], output_type=Colour,
              model_settings=ModelSettings(max_tokens={MAX_TOKENS}, temperature=0))
print(Runner.run_sync(agent, {PROMPT!r}).final_output.model_dump_json())
"""

PYDANTIC_AI = ANSWER + f"""
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
model = OpenAIChatModel(os.environ["DFLASH_MODEL"], provider=OpenAIProvider(
    base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]))
agent = Agent(model, output_type=NativeOutput(Colour),
              model_settings={{"max_tokens": {MAX_TOKENS}, "temperature": 0}})
print(agent.run_sync({PROMPT!r}).output.model_dump_json())
"""

INSTRUCTOR = ANSWER + f"""
import instructor, openai
client = instructor.from_openai(openai.OpenAI(max_retries=0), mode=instructor.Mode.JSON_SCHEMA)
answer = client.chat.completions.create(model=os.environ["DFLASH_MODEL"], response_model=Colour,
                                        max_retries=0, max_tokens={MAX_TOKENS}, temperature=0,
                                        messages=[{{"role": "user", "content": {PROMPT!r}}}])
print(answer.model_dump_json())
"""

SNIPPETS = {"langchain": LANGCHAIN, "openai-agents": OPENAI_AGENTS, "pydantic-ai": PYDANTIC_AI,
            "instructor": INSTRUCTOR}


def colour(output: str) -> dict:
    """The answer a snippet printed, checked against the schema it asked for."""
    answer = json.loads(output.strip().splitlines()[-1])
    assert set(answer) == {"name", "position"}, answer
    assert answer["name"] in COLOURS and 1 <= answer["position"] <= 7, answer
    return answer


@pytest.fixture(scope="module")
def constrained_plain(py_clients) -> dict:
    """The service's own plain decoding under the schema LangChain and the OpenAI SDK send."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "position"],
              "properties": {"name": {"enum": list(COLOURS), "type": "string"},
                             "position": {"type": "integer", "minimum": 1, "maximum": 7}}}
    text = py_clients.plain_reply([{"role": "user", "content": PROMPT}], MAX_TOKENS,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "Colour", "schema": schema, "strict": True}})
    return json.loads(text)


@pytest.mark.parametrize("client", list(SNIPPETS))
def test_a_frameworks_structured_output_validates(py_clients, client):
    colour(py_clients.run(SNIPPETS[client]))


def test_langchain_gets_the_constrained_plain_reply(py_clients, constrained_plain):
    assert colour(py_clients.run(LANGCHAIN)) == constrained_plain


def test_llm_schema(py_clients):
    """`llm --schema` (its concise schema syntax) through llm's OpenAI-compatible endpoint."""
    args = ["-m", "llm", "openai", "endpoint", py_clients.base_url + "/v1", PROMPT,
            "-m", py_clients.model, "--schema", "name, position int",
            "-o", "max_tokens", str(MAX_TOKENS), "--key", API_KEY]
    answer = json.loads(py_clients.run_argv(args))
    assert set(answer) == {"name", "position"} and isinstance(answer["position"], int), answer
