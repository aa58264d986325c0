"""A tiny real target that calls a tool: trained for seconds to memorize one weather round trip.

The target is a real Qwen3 (Transformers, float32) with our own Hermes-style chat template
(`<tool_call>{json}</tool_call>`, results as `<tool_response>`), so the service's tool path runs
end to end: rendered with tools -> the model writes a call -> the call is parsed -> the result
goes back -> the model answers. Greedy decoding reproduces the memorized replies exactly for the
prompts below (AGENT_TOOLS, first_turn(), second_turn(); with or without the system message).
A random z-lab-format drafter rides along so speculation runs; what it drafts does not matter:
the target verifies every token.

Use `agent_pair(tmp_path_factory)` once per session (built on first use: ~200 Adam steps, about
20-40 s on two busy cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import tiny_models
import torch
from fixtures_tiny import Pair

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

# Written for these tests (Hermes/Qwen style): a system turn lists the tools as JSON lines inside
# <tools>, a call is <tool_call>{"name", "arguments"}</tool_call>, a result a user turn's
# <tool_response>. An assistant message's content may be None or "" when it only calls.
AGENT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n"
    "{%- for tool in tools %}"
    '{"name": {{ tool.function.name | tojson }}, "description": {{ (tool.function.description or "") | tojson }}, '
    '"parameters": {{ tool.function.parameters | tojson }}}\n'
    "{%- endfor %}</tools>\n"
    'Call a function as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SYSTEM = "You are a helpful assistant."
QUESTION = "weather in Paris?"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
AGENT_TOOLS = [WEATHER_TOOL]
CALL_ARGUMENTS = {"city": "Paris"}
CALL_TEXT = TOOL_CALL_OPEN + json.dumps({"name": "get_weather", "arguments": CALL_ARGUMENTS}) + TOOL_CALL_CLOSE
TOOL_RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris, 21 C."


def first_turn(system: bool = True) -> list[dict]:
    """The question (template form): the model answers with CALL_TEXT."""
    head = [{"role": "system", "content": SYSTEM}] if system else []
    return [*head, {"role": "user", "content": QUESTION}]


def second_turn(system: bool = True, call_id: str = "call_0") -> list[dict]:
    """The question, the model's call, the tool's result: the model answers ANSWER."""
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}
    return [*first_turn(system), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


def make_tokenizer(out: Path):
    """tiny_models' byte-level tokenizer plus <tool_call> and </tool_call> as single, non-special
    tokens (as Qwen's are: they survive decoding), with AGENT_TEMPLATE."""
    from tokenizers import AddedToken

    tokenizer = tiny_models.make_tokenizer(out)
    tokenizer.add_tokens([AddedToken(TOOL_CALL_OPEN, special=False, normalized=False),
                          AddedToken(TOOL_CALL_CLOSE, special=False, normalized=False)])
    tokenizer.chat_template = AGENT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def _examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids ending with <|im_end|>) for each memorized turn."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for system in (True, False):
        for messages, reply in ((first_turn(system), CALL_TEXT), (second_turn(system), ANSWER)):
            prompt = tokenizer.encode(tokenizer.apply_chat_template(
                messages, tools=AGENT_TOOLS, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)
            examples.append((prompt, tokenizer.encode(reply, add_special_tokens=False) + [end]))
    return examples


def _train(model, examples, steps: int = 400, seed: int = 0, loss_floor: float = 0.01) -> None:
    """Full-batch Adam on the reply tokens only, until greedy decoding reproduces every reply."""
    torch.manual_seed(seed)
    width = max(len(p) + len(r) for p, r in examples)
    inputs = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros(len(examples), width, dtype=torch.long)
    for row, (prompt, reply) in enumerate(examples):
        ids = prompt + reply
        inputs[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt): len(ids)] = torch.tensor(reply)
        attention[row, : len(ids)] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < loss_floor:  # memorized from about 0.08 on; 0.01 leaves a wide margin
            break
    model.eval()


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(count):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def make_agent_target(out: Path, seed: int = 0) -> Path:
    tokenizer = make_tokenizer(out)
    return train_target(out, tokenizer, _examples(tokenizer), seed)


def tiny_qwen3(vocab: int, seed: int = 0, max_positions: int = 1024):
    """The untrained tiny Qwen3 (float32) the agent targets start from."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, eos_token_id=2, pad_token_id=0,
                         rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_target(out: Path, tokenizer, examples: list[tuple[list[int], list[int]]],
                 seed: int = 0, max_positions: int = 1024, loss_floor: float = 0.01) -> Path:
    """A tiny Qwen3 for `tokenizer` (saved in `out`) trained until greedy decoding writes each
    example's reply (prompt ids, reply ids) exactly, saved beside it."""
    model = tiny_qwen3(len(tokenizer), seed, max_positions)
    _train(model, examples, seed=seed, loss_floor=loss_floor)
    for prompt, reply in examples:
        got = _greedy(model, prompt, len(reply))
        if got != reply:
            raise AssertionError(f"the tiny target did not memorize {tokenizer.decode(reply)!r}: "
                                 f"it writes {tokenizer.decode(got)!r}")
    model.save_pretrained(out)
    return out


_PAIR: dict[str, Pair] = {}


def agent_pair(tmp_path_factory, block_size: int = 8) -> Pair:
    """The trained target and a random drafter for it, written once per session."""
    if "pair" not in _PAIR:
        root = tmp_path_factory.mktemp("agent-pair")
        target = make_agent_target(root / "target")
        drafter = tiny_models.make_drafter(root / "drafter", target, block_size=block_size)
        _PAIR["pair"] = Pair(target, drafter)
    return _PAIR["pair"]
