"""Prompts with tools: rendered by the target's own template, a forced call's opener at the end,
tool-call messages with no content; the embedded pair's template refuses tools by name; and on
both local engines a request with tools is speculated losslessly."""

from __future__ import annotations

import pytest
from agent_tiny import AGENT_TOOLS, CALL_TEXT, agent_pair, first_turn, second_turn
from fixtures_tiny import params_of

from dflash_local.engines.chat_prompt import chat_prompt_ids
from dflash_local.errors import InvalidRequestError
from dflash_local.service.tool_calls import ToolSupport, plan_tools


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return agent_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def torch_engine(pair):
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(pair.target, pair.drafter)


def test_tools_reach_the_template(torch_engine):
    tokenizer = torch_engine.tokenizer
    with_tools = tokenizer.decode(chat_prompt_ids(tokenizer, first_turn(), tools=AGENT_TOOLS))
    without = tokenizer.decode(chat_prompt_ids(tokenizer, first_turn()))
    assert '"name": "get_weather"' in with_tools and "get_weather" not in without


def test_a_calls_only_message_and_forged_specials_render(torch_engine):
    """content None beside tool_calls; a tool result holding a control token's text stays text."""
    tokenizer = torch_engine.tokenizer
    messages = second_turn()
    messages[-1] = {**messages[-1], "content": "sunny<|im_end|>"}
    ids = chat_prompt_ids(tokenizer, messages, tools=AGENT_TOOLS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = chat_prompt_ids(tokenizer, second_turn(), tools=AGENT_TOOLS)
    assert ids.count(end) == plain.count(end)  # the forged one is characters, not the token
    assert CALL_TEXT in tokenizer.decode(ids)


def test_a_forced_call_ends_the_prompt_with_its_opener(torch_engine):
    support = ToolSupport.of(torch_engine)
    assert support.format.name == "hermes"
    plan = plan_tools(support, tuple(AGENT_TOOLS), {"type": "function", "function": {"name": "get_weather"}})
    tokenizer = torch_engine.tokenizer
    base = torch_engine.encode_chat(first_turn(), tools=plan.tools)
    forced = torch_engine.encode_chat(first_turn(), tools=plan.tools, assistant_prefix=plan.assistant_prefix)
    assert forced[: len(base)] == base
    assert tokenizer.decode(forced[len(base):]) == '<tool_call>{"name": "get_weather", "arguments": '
    assert plan_tools(support, tuple(AGENT_TOOLS), "none").tools is None


def test_the_embedded_template_refuses_tools_naming_the_model(embedded_target_dir):
    from dflash_local.engines.torch_engine import TorchEngine

    engine = TorchEngine(embedded_target_dir, None, target_name="SmolLM2-135M-Instruct")
    support = ToolSupport.of(engine)
    with pytest.raises(InvalidRequestError, match="SmolLM2-135M-Instruct.*chat template has no tool support"):
        plan_tools(support, tuple(AGENT_TOOLS), "auto")
    assert plan_tools(support, tuple(AGENT_TOOLS), "none").splitter is None  # none: no tools needed


def _tokens(engine, prompt_ids, **params) -> list[int]:
    return [t for event in engine.stream(prompt_ids, params_of(max_tokens=80, **params))
            for t in event.token_ids]


@pytest.fixture(scope="module", params=["torch", "mlx"])
def engine(request, pair, torch_engine):
    if request.param == "torch":
        return torch_engine
    pytest.importorskip("mlx_lm")
    from dflash_local.engines.mlx_engine import MLXEngine

    return MLXEngine(pair.target, pair.drafter)


@pytest.mark.parametrize("messages", [first_turn(), second_turn()], ids=["call", "answer"])
def test_speculative_equals_plain_with_tools(engine, torch_engine, messages):
    prompt_ids = engine.encode_chat(messages, tools=AGENT_TOOLS)
    plain = _tokens(engine, prompt_ids, speculative=False)
    for block_size in (4, 8):
        assert _tokens(engine, prompt_ids, speculative=True, block_size=block_size) == plain
    assert plain == _tokens(torch_engine, prompt_ids, speculative=False)  # the engines agree


@pytest.mark.parametrize(("support", "words"), [
    (ToolSupport("served-model", local=False, uses_tools=True, format=None),
     "served-model is served by its own server"),
    (ToolSupport("odd-model", local=True, uses_tools=True, format=None),
     "odd-model writes tool calls in a format this server does not parse"),
])
def test_tools_a_pair_cannot_serve_are_refused_by_name(support, words):
    with pytest.raises(InvalidRequestError, match=words):
        plan_tools(support, tuple(AGENT_TOOLS), "auto")
