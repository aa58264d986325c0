"""A tiny real target that speaks OpenAI's harmony format (gpt-oss), trained for seconds.

Harmony writes a reply's structure in special tokens: `<|channel|>analysis<|message|>...<|end|>
<|start|>assistant<|channel|>final<|message|>...<|return|>`, and a call as
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>` (openai/harmony,
docs/format.md). The target is agent_tiny's tiny Qwen3 (its trainer, train_target) with the
byte tokenizer plus harmony's markers as special tokens (as gpt-oss's o200k_harmony has them),
`<|return|>` its eos, and a chat template written here from that format document. It memorizes
three replies (no system message): a plain question answered with analysis then final, the
weather question answered with analysis then a call, and the tool's result answered in final.
A random drafter rides along so speculation runs.

Use `harmony_pair(tmp_path_factory)` (built once per session, about 20-40 s on two busy cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import tiny_models
from agent_tiny import AGENT_TOOLS, ANSWER, CALL_ARGUMENTS, first_turn, second_turn, train_target
from fixtures_tiny import Pair

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>",
           "<|call|>"]

# Written for these tests from harmony's format document: a system message, the tools as a
# developer message's `functions` namespace, a call as the assistant's commentary message to
# functions.NAME, a result as a message from functions.NAME to the assistant.
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(called='') %}"
    "<|start|>system<|message|>Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for tool in tools %}type {{ tool.function.name }} = (_: "
    "{{ tool.function.parameters | tojson }}) => any;\n{%- endfor %}}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- for call in m.tool_calls or [] %}{%- set ns.called = call.function.name %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} "
    "<|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>"
    "{%- endfor %}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.called }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)

GREETING = "hello?"
REASONING = "Greet back."
HELLO = "Hello there!"
PLAIN_REPLY = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
               f"<|start|>assistant<|channel|>final<|message|>{HELLO}<|return|>")
CALL_REASONING = "Need weather."
CALL_REPLY = (f"<|channel|>analysis<|message|>{CALL_REASONING}<|end|>"
              "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
              f"<|message|>{json.dumps(CALL_ARGUMENTS)}<|call|>")
ANSWER_REPLY = f"<|channel|>final<|message|>{ANSWER}<|return|>"


def greeting() -> list[dict]:
    return [{"role": "user", "content": GREETING}]


def make_tokenizer(out: Path):
    """tiny_models' byte tokenizer plus harmony's markers as special tokens; <|return|> its eos."""
    from tokenizers import AddedToken

    tokenizer = tiny_models.make_tokenizer(out)
    tokenizer.add_tokens([AddedToken(marker, special=True, normalized=False) for marker in MARKERS],
                         special_tokens=True)
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def _examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    turns = ((greeting(), None, PLAIN_REPLY), (first_turn(system=False), AGENT_TOOLS, CALL_REPLY),
             (second_turn(system=False), AGENT_TOOLS, ANSWER_REPLY))
    return [(tokenizer.encode(tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False),
             tokenizer.encode(reply, add_special_tokens=False)) for messages, tools, reply in turns]


_PAIR: dict[str, Pair] = {}


def harmony_pair(tmp_path_factory, block_size: int = 8) -> Pair:
    """The trained harmony target and a random drafter for it, written once per session."""
    if "pair" not in _PAIR:
        root = tmp_path_factory.mktemp("harmony-pair")
        out = root / "target"
        tokenizer = make_tokenizer(out)
        target = train_target(out, tokenizer, _examples(tokenizer))
        drafter = tiny_models.make_drafter(root / "drafter", target, block_size=block_size)
        _PAIR["pair"] = Pair(target, drafter)
    return _PAIR["pair"]
