"""logprobs / top_logprobs on /v1/chat/completions: the real server, a tiny random pair, the
official openai SDK. Streamed and not, speculative equal to plain, each chunk carrying the
entries of its own tokens, stop strings dropping the tokens they cut, bad values refused."""

from __future__ import annotations

import pytest
from service_support import EOS_PROMPT, LONG_PROMPT

PROMPT = LONG_PROMPT
TOP = 3
TOLERANCE = 1e-4  # a multi-row verify and a one-row step round differently (test_logprobs.py)


@pytest.fixture(scope="module")
def tokenizer(served):
    return served[0].loaded.engine.tokenizer


def messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]


def reply(client, prompt=PROMPT, **extra):
    return client.chat.completions.create(model="tiny", messages=messages(prompt), logprobs=True,
                                          top_logprobs=TOP, **extra).choices[0]


def chunks_of(client, prompt=PROMPT, **extra) -> list:
    return [chunk for chunk in client.chat.completions.create(
        model="tiny", messages=messages(prompt), stream=True, logprobs=True, top_logprobs=TOP,
        **extra) if chunk.choices]


def as_tuples(entries) -> list[tuple]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


def assert_close(entries, expected):
    assert [e[0] for e in entries] == [e[0] for e in expected]
    for (_, logprob, top), (_, plain_logprob, plain_top) in zip(entries, expected):
        assert logprob == pytest.approx(plain_logprob, abs=TOLERANCE)
        assert [t for t, _ in top] == [t for t, _ in plain_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in plain_top], abs=TOLERANCE)


def check_entry(entry, tokenizer, token_id=None):
    """OpenAI's shape; greedy: the token is its row's best; strings are one id's decode."""
    assert entry.logprob <= 0
    assert len(entry.top_logprobs) == TOP
    assert entry.top_logprobs[0].token == entry.token
    assert entry.top_logprobs[0].logprob == entry.logprob
    top = [t.logprob for t in entry.top_logprobs]
    assert top == sorted(top, reverse=True)
    for described in (entry, *entry.top_logprobs):  # bytes: the token's own, part of a
        if "\ufffd" not in described.token:  # character included (then the token reads U+FFFD)
            assert described.bytes == list(described.token.encode("utf-8"))
    if token_id is not None:
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("block_size", [8, "auto"])  # forced acceptances: test_logprobs.py
def test_speculative_logprobs_equal_plain_streamed_and_not(gpt, tokenizer, block_size):
    plain = reply(gpt, max_tokens=40, extra_body={"speculative": False})
    spec = reply(gpt, max_tokens=40, extra_body={"block_size": block_size})
    assert spec.message.content == plain.message.content and plain.finish_reason == "length"
    assert len(plain.logprobs.content) == 40  # one per token: none was an end-of-turn token
    # the random tiny target writes stray bytes of multi-byte characters: its tokens' bytes are
    # still the text's, where their strings read U+FFFD (a character left unfinished at the end
    # is not in the content)
    raw = b"".join(bytes(entry.bytes) for entry in plain.logprobs.content)
    decoded = raw.decode("utf-8", errors="replace")
    assert decoded.startswith(plain.message.content)
    assert set(decoded[len(plain.message.content):]) <= {"\ufffd"}
    assert any("\ufffd" in entry.token for entry in plain.logprobs.content)
    assert_close(as_tuples(spec.logprobs.content), as_tuples(plain.logprobs.content))

    chunks = chunks_of(gpt, max_tokens=40, extra_body={"block_size": block_size})
    assert "".join(c.choices[0].delta.content for c in chunks) == plain.message.content
    assert_close([t for c in chunks for t in as_tuples(c.choices[0].logprobs.content)],
                 as_tuples(plain.logprobs.content))
    if block_size == "auto":  # the story repeats itself: prompt-lookup copies were kept
        assert max(len(c.model_extra["dflash"]["token_ids"]) for c in chunks) > 1
    check_chunks_carry_their_tokens(chunks, tokenizer)


def check_chunks_carry_their_tokens(chunks, tokenizer):
    """Each chunk carries its round's tokens' entries, but for tokens of a character still
    incomplete at its end, which come with the chunk that completes it."""
    token_ids, sent = [], 0
    for chunk in chunks:
        entries = chunk.choices[0].logprobs.content
        own = chunk.model_extra["dflash"]["token_ids"]
        for entry, token_id in zip(entries, token_ids[sent:] + own):
            check_entry(entry, tokenizer, token_id)
        token_ids += own
        sent += len(entries)
        held = tokenizer.decode(token_ids).endswith("\ufffd")
        assert sent == len(token_ids) or (held and sent < len(token_ids))


def test_without_logprobs_the_field_stays_null(gpt):
    plain = gpt.chat.completions.create(model="tiny", messages=messages(PROMPT), max_tokens=4)
    assert plain.choices[0].logprobs is None
    streamed = gpt.chat.completions.create(model="tiny", messages=messages(PROMPT),
                                              max_tokens=4, stream=True)
    assert all(c.choices[0].logprobs is None for c in streamed if c.choices)


def test_top_logprobs_zero_gives_the_logprob_alone(gpt):
    choice = gpt.chat.completions.create(model="tiny", messages=messages(PROMPT), max_tokens=6,
                                            logprobs=True).choices[0]
    assert len(choice.logprobs.content) == 6
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in choice.logprobs.content)


@pytest.mark.parametrize("speculative", [True, False])
def test_the_end_of_turn_token_has_no_entry(gpt, speculative):
    choice = reply(gpt, EOS_PROMPT, max_tokens=50, extra_body={"speculative": speculative})
    chunks = chunks_of(gpt, EOS_PROMPT, max_tokens=50, extra_body={"speculative": speculative})
    assert choice.finish_reason == "stop" and chunks[-1].choices[0].finish_reason == "stop"
    token_ids = [t for c in chunks for t in c.model_extra["dflash"]["token_ids"]]
    assert len(choice.logprobs.content) == len(token_ids) - 1  # all but the end of the turn
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert_close(as_tuples(streamed), as_tuples(choice.logprobs.content))
    assert "".join(e.token for e in streamed) == choice.message.content


def kept_count(tokenizer, token_ids: list[int], kept_chars: int) -> int:
    """How many tokens begin inside the first `kept_chars` characters of their text."""
    starts = [len(tokenizer.decode(token_ids[:i], skip_special_tokens=True).rstrip("\ufffd"))
              for i in range(len(token_ids))]
    return sum(start < kept_chars for start in starts)


@pytest.mark.parametrize("speculative", [True, False])
def test_tokens_a_stop_string_cuts_are_dropped_with_their_text(gpt, tokenizer, speculative):
    full = chunks_of(gpt, max_tokens=60, extra_body={"speculative": speculative})
    text = "".join(c.choices[0].delta.content for c in full)
    token_ids = [t for c in full for t in c.model_extra["dflash"]["token_ids"]]
    at = next(i for i in range(12, len(text) - 4) if text[i : i + 2].isascii()
              and text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
    stop = text[at : at + 2]
    extra = {"speculative": speculative}
    choice = reply(gpt, max_tokens=60, stop=[stop], extra_body=extra)
    assert choice.message.content == text[:at] and choice.finish_reason == "stop"
    expected = kept_count(tokenizer, token_ids, at)
    assert 0 < expected < len(token_ids)
    entries = as_tuples(choice.logprobs.content)
    assert len(entries) == expected
    whole = [t for c in full for t in as_tuples(c.choices[0].logprobs.content)]
    assert_close(entries, whole[:expected])
    streamed = chunks_of(gpt, max_tokens=60, stop=[stop], extra_body=extra)
    assert "".join(c.choices[0].delta.content for c in streamed) == text[:at]
    assert_close([t for c in streamed for t in as_tuples(c.choices[0].logprobs.content)], entries)


@pytest.mark.parametrize(("fields", "words"), [
    ({"top_logprobs": 2}, ["top_logprobs (2) requires logprobs: true"]),
    ({"logprobs": True, "top_logprobs": 21}, ["top_logprobs", "20", "21"]),
    ({"logprobs": True, "top_logprobs": -1}, ["top_logprobs", "-1"]),
    ({"logprobs": "yes"}, ["logprobs", "'yes'"]),
])
def test_bad_values_are_refused_by_name(gpt, fields, words):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        gpt.chat.completions.create(model="tiny", messages=messages(PROMPT), max_tokens=4,
                                       extra_body=fields)
    message = refused.value.body["message"]
    assert all(word in message for word in words), message


def test_an_entry_waits_while_the_stop_matcher_holds_its_text(embedded_target_dir):
    """" Paris" ends with what could begin the stop string "s. T": its entry waits with that
    text; the stop string then cuts inside it, so it keeps its entry while "." and " Then",
    wholly cut away, lose theirs. The worker's own StopMatcher, SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from dflash_local.events import StepEvent, TokenLogprob
    from dflash_local.service.logprob_entries import LogprobEntries
    from dflash_local.service.stop_strings import StopMatcher

    tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir)
    paris, dot, then = (tokenizer.encode(text, add_special_tokens=False) for text in
                        (" Paris", ".", " Then"))
    assert len(paris) == len(dot) == len(then) == 1
    stops, entries = StopMatcher(("s. T",)), LogprobEntries(tokenizer)
    sent = []
    for token_ids, text in (([*paris], " Paris"), ([*dot, *then], ". Then")):
        event = StepEvent(token_ids=tuple(token_ids), text=text,
                          logprobs=tuple(TokenLogprob(-0.5, (t,), (-0.5,)) for t in token_ids))
        safe, hit = stops.feed(text)
        taken = entries.take(event, safe, "stop" if hit else None, hit)
        sent.append((safe, [entry["token"] for entry in taken]))
    assert sent == [(" Pari", []), ("", [" Paris"])]
