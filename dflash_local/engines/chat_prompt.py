"""Chat prompts: messages to the token ids a target sees, under its own chat template, and the
ids that end an assistant turn.

One encoding for what the engines serve, what the next turn's warm-up keeps
(engines/turn_warmup.py) and what a drafter is trained on (train/regenerate.py). What a client
wrote stays text: only the template's own markup becomes control tokens (client_text.py).
Boundary: tokenizers and templates only; no framework, no engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from dflash_local.engines.client_text import (
    client_strings,
    encode_marked,
    mark_special_texts,
    strings_in,
)
from dflash_local.errors import InvalidRequestError, PromptTooLongError

log = logging.getLogger(__name__)

TOO_LONG_MARGIN = 2  # counted in chunks, a prompt refused early is surely too long
COUNT_WHOLE_UNDER_CHARS_PER_TOKEN = 8  # content shorter than this many characters per context token
COUNT_CHUNK_CHARS = 16_384
TOKENIZED_FROM_CHARS = 16  # a shorter text is counted as the one token it is at least
PROBED_ROLES = ("system", "user", "assistant", "tool")
PROBE_OPENING = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
PROBE_CLOSING = {"role": "user", "content": "Bye"}
# template text, or pieces alternating template text and client text (a forced call's opener
# around the tool's name): the client's pieces are marked as every client text is
AssistantPrefix = str | tuple[str, ...]


def chat_prompt_ids(tokenizer, messages: list[dict], thinking: bool | None = None,
                    tools: list[dict] | None = None, assistant_prefix: AssistantPrefix = "",
                    generation_prompt: bool = True) -> list[int]:
    """The ids of messages under the tokenizer's chat template, ready for the assistant's turn:
    one encoding for what the engines serve and what a drafter is trained on.
    `generation_prompt=False`: the conversation as history, its last message closed (what the
    next request's prompt begins with: engines/turn_warmup.py).

    What the client wrote is text: a "<|im_end|>" in a message, a tool's description or schema,
    a call's arguments or a tool's result is tokenized as those characters, never as the control
    token, so only the template's own markup ends or opens a turn (client_text.py). Values free
    of special-token text are encoded exactly as the rendered template.
    `tools` go to the template as its `tools`; `assistant_prefix` (template text, e.g. a forced
    tool call's opener, with the client's pieces in it apart) follows the generation prompt. An assistant message that only calls
    tools may have no content (None or "")."""
    check_texts(messages, tools)
    return _prompt_ids_of_checked(tokenizer, messages, thinking, tools, assistant_prefix,
                                   generation_prompt)


def request_prompt_ids(tokenizer, messages: list[dict], max_context: int,
                       thinking: bool | None, tools: list[dict] | None,
                       assistant_prefix: AssistantPrefix, floors: dict[str, int]) -> list[int]:
    """A request's prompt (what an engine's encode_chat returns): chat_prompt_ids, its texts
    checked once before any tokenizer sees them, a prompt far past `max_context` refused
    before it is tokenized whole (`floors`: message_markup_floors, measured at load)."""
    check_texts(messages, tools)
    check_prompt_length(tokenizer, messages, max_context, floors, tools)
    return _prompt_ids_of_checked(tokenizer, messages, thinking, tools, assistant_prefix)


def _prompt_ids_of_checked(tokenizer, messages: list[dict], thinking: bool | None = None,
                            tools: list[dict] | None = None, assistant_prefix: AssistantPrefix = "",
                            generation_prompt: bool = True) -> list[int]:
    """chat_prompt_ids of messages and tools whose texts `check_texts` has already passed."""
    pieces = (assistant_prefix,) if isinstance(assistant_prefix, str) else assistant_prefix
    marked = mark_special_texts(tokenizer, messages, tools, pieces[1::2])
    if marked is None:
        return tokenizer.encode(chat_text(tokenizer, messages, thinking, generation_prompt, tools)
                                + "".join(pieces), add_special_tokens=False)
    rendered = chat_text(tokenizer, marked.messages, thinking, generation_prompt, marked.tools)
    prefix = "".join(piece if index % 2 == 0 else marked.extra[index // 2]
                     for index, piece in enumerate(pieces))
    return encode_marked(tokenizer, rendered + prefix, marked.texts)


def chat_text(tokenizer, messages: list[dict], thinking: bool | None = None,
              generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The chat template's text of the messages (thinking on/off where it has the switch).
    A tool-calls-only message's content is given as "" (templates that concatenate it fail on
    None); a template's own refusal ("Conversation roles must alternate") is the request's."""
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    extra = {} if thinking is None else {"enable_thinking": thinking}
    if tools:
        extra["tools"] = list(tools)
    messages = [{**message, "content": ""} if message.get("content") is None else message
                for message in messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **extra)
    except TemplateError as exc:
        raise InvalidRequestError(f"the target's chat template refused these messages: "
                                  f"{exc}") from None


def next_turn_ids(tokenizer, messages: list[dict], reply: str, prompt_ids: list[int],
                  thinking: bool | None = None) -> list[int] | None:
    """The ids the next request of this conversation begins with: the messages and the reply
    as history, closed by the template's end of turn, encoded as chat_prompt_ids encodes a
    prompt. None where the template writes the history otherwise than the prompt it extends
    (one that drops an earlier turn's reasoning): nothing kept would be reused.
    The messages are a request's, whose texts its prompt's encoding checked, and the reply is
    decoded text: neither is checked again."""
    history = [*messages, {"role": "assistant", "content": reply}]
    if not chat_text(tokenizer, history, thinking, generation_prompt=False).startswith(
            chat_text(tokenizer, messages, thinking)):
        return None
    ids = _prompt_ids_of_checked(tokenizer, history, thinking, generation_prompt=False)
    return ids if len(ids) > len(prompt_ids) else None


def unicode_problem(text: str) -> str | None:
    """What makes `text` unencodable: JSON's "\\ud800" gives Python a lone surrogate, which no
    tokenizer can encode; None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start} is a lone surrogate ({text[exc.start]!a}): not valid Unicode text"
    return None


def content_of(message: dict) -> str:
    """A message's text; "" for an assistant's tool-calls-only message (content None)."""
    return message.get("content") or ""


def check_texts(messages: list[dict], tools: list[dict] | None = None) -> None:
    """Refuse text no tokenizer can encode, naming where it is: every string the template may
    render (a tool's schema and a call's arguments are any JSON, unchecked by the request's)."""
    for name, value in (("messages", messages), ("tools", tools or [])):
        if all(unicode_problem(text) is None for text, _ in strings_in(value)):
            continue
        for where, text in client_strings(value, name):  # the first problem, by its path
            if (problem := unicode_problem(text)) is not None:
                raise InvalidRequestError(f"{where}: {problem}")


def check_prompt_length(tokenizer, messages: list[dict], max_context: int,
                        floors: dict[str, int],
                        tools: list[dict] | tuple[dict, ...] | None = None) -> None:
    """Refuse a request far past the context without templating or tokenizing all of it (10 MB
    of text, or 10,000 short messages, would hold the worker for seconds): every message costs
    at least its role's markup (`floors`: message_markup_floors, measured once when the pair
    loads, so no request pays for the probes), and the texts the template renders
    (contents, calls, the tools' schemas) are counted a chunk at a time, stopping once surely
    too long. Chunks counted apart miss at most a merge or two at each cut, hence the margin."""
    markup = sum(floors.get(message.get("role"), 1) for message in messages)
    if markup > TOO_LONG_MARGIN * max_context:
        raise PromptTooLongError(
            f"{len(messages)} messages take at least {markup} tokens of the chat template's "
            f"markup alone: far past the target's context of {max_context} tokens")
    texts = rendered_texts(messages, tools)
    chars = sum(map(len, texts))
    if chars <= max_context * COUNT_WHOLE_UNDER_CHARS_PER_TOKEN:
        return  # tokenizing it whole is cheap: the exact check comes after
    counted, seen = 0, 0
    for text in texts:
        for start in range(0, len(text), COUNT_CHUNK_CHARS):
            chunk = text[start:start + COUNT_CHUNK_CHARS]
            # a short text is at least one token: a schema's 300,000 keys are not tokenized
            counted += 1 if len(chunk) < TOKENIZED_FROM_CHARS else len(tokenizer.encode(
                chunk, add_special_tokens=False, split_special_tokens=True))
            seen += len(chunk)
            if counted > TOO_LONG_MARGIN * max_context:
                raise PromptTooLongError(
                    f"prompt of {chars} characters has over {counted} tokens in its first "
                    f"{seen} characters alone (messages and tools): far past the target's "
                    f"context of {max_context} tokens")


def message_markup_floors(tokenizer) -> dict[str, int]:
    """role -> the fewest tokens an empty message of that role adds to a conversation under the
    tokenizer's chat template (a role missing: 1). Measured with one and two such messages
    between a conversation's turns and its last user turn, where a template writes a message
    plainly (it may add to the last message, and group a run of tool results): a dozen
    templatings, which an engine runs once, at load."""
    return {role: max(1, min(costs)) for role in PROBED_ROLES
            if (costs := _inserted_costs(tokenizer, role))}


def _inserted_costs(tokenizer, role: str) -> list[int]:
    lengths = []
    for count in range(3):
        probe = [*PROBE_OPENING, *[{"role": role, "content": ""}] * count, PROBE_CLOSING]
        try:
            text = chat_text(tokenizer, probe, generation_prompt=False)
        except InvalidRequestError:  # the template refuses this order of roles: no floor
            return []
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
    return [later - earlier for earlier, later in pairwise(lengths)]


def rendered_texts(messages: list[dict], tools: list[dict] | tuple[dict, ...] | None) -> list[str]:
    """The client's texts a template writes into the prompt: each message's content, its
    calls' names and arguments (keys too: they are rendered as JSON), every string of the tools."""
    texts = []
    for message in messages:
        texts.append(content_of(message))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            texts.append(str(function.get("name") or ""))
            texts += [text for text, _ in strings_in(function.get("arguments"))]
    texts += [text for text, _ in strings_in(list(tools or ()))]
    return texts


def generation_config_eos(target_dir: Path | None) -> list[int]:
    """The eos ids a target's generation_config.json lists (one id or a list; [] without one)."""
    path = target_dir / "generation_config.json" if target_dir is not None else None
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s is unreadable (%s): stopping on the tokenizer's end tokens only", path, exc)
        return []
    return eos_id_list(eos)


def eos_id_list(eos) -> list[int]:
    """A generation config's eos_token_id (None, one id or a list) as a list of ids."""
    eos = eos if isinstance(eos, list) else [eos]
    return [token_id for token_id in eos if isinstance(token_id, int) and not isinstance(token_id, bool)]


def end_of_turn_ids(tokenizer, generation_eos: Sequence[int] = ()) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's eos, the target's own generation
    config's (`generation_eos`: what its authors stop on, e.g. SmolLM2's <|endoftext|>, which is
    also its unknown token) and the chat-template end markers the tokenizer knows (never its
    unknown-token id otherwise): where a generation stops, served or regenerated."""
    ids = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids += [int(token_id) for token_id in generation_eos if int(token_id) not in ids]
    # harmony (gpt-oss): <|return|> ends a reply, <|call|> a turn that calls a tool
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|return|>",
                  "<|call|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return ids
