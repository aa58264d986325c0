"""Where a request's system turns go in the prompt: what the target's chat template allows.

Agents send system turns anywhere in a conversation (Claude Code's Agent tool puts one inside
Anthropic `messages`). Templates differ: some render a system turn at any place, some take one
system prompt at the start (and drop or refuse the rest), some take none. The template is tried
once per loaded pair (SystemTurns.of); a request's system turns are then kept in place, merged
into the leading system prompt (logged), or refused with a 400 naming the field.
"""

from __future__ import annotations

import enum
import logging

from jinja2.exceptions import TemplateError

from dflash_local.errors import InvalidRequestError

log = logging.getLogger("dflash_local.service")

# texts no template writes of itself: found in the rendering, they show where a turn went
PROBE_BEFORE, PROBE_SYSTEM, PROBE_AFTER = "dflash-probe-before", "dflash-probe-system", "dflash-probe-after"
MERGED_SEPARATOR = "\n\n"


class SystemTurns(enum.Enum):
    ANYWHERE = "anywhere"  # rendered where they stand
    LEADING = "leading"  # one system prompt, first
    NONE = "none"  # the template takes no system turn

    @classmethod
    def of(cls, engine) -> SystemTurns:
        """Try the target's template; a served engine's server templates: its turns pass as given."""
        tokenizer = getattr(engine, "tokenizer", None)
        if not engine.capabilities.tokenizes or tokenizer is None:
            return cls.ANYWHERE
        return cls.of_template(tokenizer)

    @classmethod
    def of_template(cls, tokenizer) -> SystemTurns:
        middle = _rendered(tokenizer, [{"role": "user", "content": PROBE_BEFORE},
                                       {"role": "assistant", "content": "ok"},
                                       {"role": "system", "content": PROBE_SYSTEM},
                                       {"role": "user", "content": PROBE_AFTER}])
        # a template that moves it to the front (or drops it) is a leading-only one
        if middle is not None and (middle.find(PROBE_BEFORE) < middle.find(PROBE_SYSTEM)
                                   < middle.find(PROBE_AFTER)):
            return cls.ANYWHERE
        first = _rendered(tokenizer, [{"role": "system", "content": PROBE_SYSTEM},
                                      {"role": "user", "content": PROBE_AFTER}])
        return cls.LEADING if first is not None and PROBE_SYSTEM in first else cls.NONE


def _rendered(tokenizer, messages: list[dict]) -> str | None:
    """The template's text, or None where it refuses these turns (raise_exception, a bad index)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, IndexError, KeyError, TypeError, ValueError):
        return None


def place_system_turns(sourced: list[tuple[str, dict]], turns: SystemTurns, model: str) -> list[dict]:
    """Template messages with their system turns where `turns` allows them. `sourced` pairs each
    message with the request field it came from ("system", "messages.3"), for the log and errors."""
    systems = [(field, message) for field, message in sourced if message["role"] == "system"]
    messages = [message for _field, message in sourced]
    if not systems or turns is SystemTurns.ANYWHERE:
        return messages
    if turns is SystemTurns.NONE:
        field = systems[0][0]
        what = "system: a system prompt" if field == "system" else f"{field}.role: 'system'"
        raise InvalidRequestError(f"{what}: the chat template of {model} takes no system turn; "
                                  f"put its text in a user message")
    if len(systems) == 1 and messages[0]["role"] == "system":
        return messages  # already the one leading system prompt
    moved = [field for field, message in systems if message is not messages[0]]
    log.info("system turns %s merged into the leading system prompt: the chat template of %s "
             "takes one, at the start", ", ".join(moved), model)
    merged = {"role": "system",
              "content": MERGED_SEPARATOR.join(message["content"] for _field, message in systems)}
    return [merged, *(message for message in messages if message["role"] != "system")]
