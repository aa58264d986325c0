"""A conversation against the loaded pair's context: the meter's words, and the overflow policy
applied before a send.

Boundary: no Textual, no HTTP. The prompt's tokens are the service's own count (a `count`
callable the caller binds to /v1/messages/count_tokens); a reply needs `max_tokens` of room
after the prompt, so the prompt's budget is the context less max_tokens. Turns are only ever
left out of the request: the chat keeps every message, and the app marks those left out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dflash_chat.actions import BY_ID, key_label

# dropping turns goes this far below the budget, so the next sends keep the same first turn
# (and the prefix cache its start) instead of dropping one more turn every time
TRIM_TO = 0.75
WARN_AT = 0.8  # the meter turns yellow, and the app says once what overflow will do
POLICY_WORDS = {"drop_oldest": "the oldest turns are left out (the system prompt stays)",
                "keep_last": "only the system prompt and the last {keep_turns} turns are sent",
                "refuse": "a message that does not fit is refused",
                "summarise": "the oldest turns are left out and the model's summary of them is "
                             "sent in their place"}
# the summarise policy: room kept for the summary, and what the model is asked
SUMMARY_TOKENS = 160
SUMMARY_ASK = ("Summarise the conversation so far in at most 100 words: the facts, names, "
               "numbers and decisions a reader needs to go on with it. Write only the summary.")
SUMMARY_HEAD = "Summary of the earlier conversation, which is not shown: "

Count = Callable[[list[dict]], Awaitable[int]]


@dataclass(frozen=True)
class HistoryMessage:
    id: int
    role: str  # "user" | "assistant"
    content: str


@dataclass(frozen=True)
class ContextFit:
    tokens: int  # the prompt's tokens as it will be sent
    context: int
    first_kept: int | None  # the first history message sent, when this fit left turns out
    dropped: int = 0  # history messages this fit left out

    @property
    def fraction(self) -> float:
        return self.tokens / self.context if self.context else 0.0


class ContextOverflow(Exception):
    """The message cannot be sent under the chat's policy: `explain` says by how much and what
    the user can do, naming the keys of the user's keymap (str: the default keys)."""

    def __init__(self, tokens: int, context: int, max_tokens: int, why: str):
        self.tokens, self.context, self.max_tokens, self.why = tokens, context, max_tokens, why
        super().__init__(self.explain(lambda action_id: key_label(BY_ID[action_id].keys)))

    def explain(self, keys_of: Callable[[str], str]) -> str:
        return overflow_text(self.tokens, self.context, self.max_tokens, self.why, keys_of)


async def fit_history(count: Count, system: list[dict], history: list[HistoryMessage],
                      prompt: str, context: int, max_tokens: int, policy: str,
                      keep_turns: int = 0, summary: str = "") -> ContextFit:
    """The shortest cut of `history` (whole turns from the oldest, none if it fits) that leaves
    room for the prompt and a reply of `max_tokens`, under `policy` (OVERFLOW_POLICIES).
    keep_last cuts to the last `keep_turns` turns, or fewer where those do not fit either.
    `summary`: the one sent after `system` now (with_summary); a cut replaces it (summarise:
    with a new one, whose room is kept; other policies: with none), so cuts count without it."""
    budget = context - max_tokens
    # where a cut may fall: before a later turn's prompt, or after the whole history
    cuts = [i for i, message in enumerate(history) if message.role == "user" and i] + [len(history)]
    trim_to = TRIM_TO
    if policy == "keep_last":  # the window itself keeps the first turn sent stable
        cuts, trim_to = cuts[max(0, len(cuts) - 1 - keep_turns):], 1.0

    async def tokens_from(cut: int, start: list[dict] = system) -> int:
        kept = [{"role": m.role, "content": m.content} for m in history[cut:]]
        return await count(start + kept + [{"role": "user", "content": prompt}])

    whole = await tokens_from(0, with_summary(system, summary))
    if whole <= budget:
        return ContextFit(whole, context, None)
    if policy == "refuse":
        raise ContextOverflow(whole, context, max_tokens, policy)
    if policy == "summarise":  # the summary sent in place of the dropped turns needs room too
        budget -= SUMMARY_TOKENS
    alone = whole if not history else await tokens_from(len(history))
    if alone > budget:
        raise ContextOverflow(alone, context, max_tokens, "alone")
    low, high, counted = 0, len(cuts) - 1, {len(cuts) - 1: alone}
    if alone <= budget * trim_to:  # the first cut that leaves the trimmed room (counts fall)
        while low < high:
            middle = (low + high) // 2
            counted[middle] = await tokens_from(cuts[middle])
            low, high = (low, middle) if counted[middle] <= budget * trim_to else (middle + 1, high)
    cut = cuts[high]
    tokens = counted[high] if high in counted else await tokens_from(cut)
    # every message from first_kept on is sent: past the whole history, only the new prompt
    first_kept = history[cut].id if cut < len(history) else history[-1].id + 1
    return ContextFit(tokens, context, first_kept, dropped=cut)


def overflow_text(tokens: int, context: int, max_tokens: int, why: str,
                  keys_of: Callable[[str], str]) -> str:
    room = context - max_tokens
    head = (f"This message alone makes a prompt of {tokens} tokens" if why == "alone" else
            f"With this message the prompt would be {tokens} tokens")
    new_chat, policy, undo = keys_of("new_chat"), keys_of("toggle_overflow"), "ctrl+z"
    advice = {"refuse": "This chat's overflow policy is refuse: shorten the message, start a new "
                        f"chat ({new_chat}), or choose another policy ({policy}).",
              "drop_oldest": f"Shorten it ({undo} takes a paste back) or start a new chat "
                             f"({new_chat})."}
    return (f"{head}; the pair's context of {context} leaves {room} after {max_tokens} max "
            f"tokens for the reply. {advice.get(why, advice['drop_oldest'])}")


def with_summary(system: list[dict], summary: str) -> list[dict]:
    """The system message with the summary of the turns left out after it: one system message
    at the start (some chat templates take no other), the same on every send until the next
    summary, so the prefix cache keeps serving the conversation's start."""
    if not summary:
        return system
    prompt = system[0]["content"] + "\n\n" if system else ""
    return [{"role": "system", "content": prompt + SUMMARY_HEAD + summary}]


async def summary_request(count: Count, system: list[dict], dropped: list[HistoryMessage],
                          context: int) -> list[dict] | None:
    """What the model summarises: the request as the chat sent it last, up to the turns now
    left out (its start is in the prefix cache), then the ask; its oldest turns go where that
    and the summary would not fit the context (None: not even the last turn fits). The first
    turn kept is bisected: counts fall as turns go, so log2(turns) counts, not one a turn."""
    turns = [{"role": m.role, "content": m.content} for m in dropped]
    starts = [i for i, turn in enumerate(turns) if i == 0 or turn["role"] == "user"]

    def request_from(start: int) -> list[dict]:
        return system + turns[start:] + [{"role": "user", "content": SUMMARY_ASK}]

    low, high, fits = 0, len(starts), context - SUMMARY_TOKENS  # starts[high]: the first that fits
    while low < high:
        middle = (low + high) // 2
        low, high = ((low, middle) if await count(request_from(starts[middle])) <= fits
                     else (middle + 1, high))
    return request_from(starts[high]) if high < len(starts) else None


def policy_words(policy: str, keep_turns: int) -> str:
    return POLICY_WORDS[policy].format(keep_turns=keep_turns)


def meter_text(tokens: int | None, context: int | None) -> str:
    """The status bar's meter: the conversation's tokens over the pair's context."""
    if not context or tokens is None:
        return ""
    return f"ctx {_short(tokens)}/{_short(context)} {tokens / context:.0%}"


def _short(count: int) -> str:
    return f"{count / 1000:.1f}k" if count >= 1000 else str(count)
