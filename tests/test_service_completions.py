"""POST /v1/completions: the real server, a tiny random pair, the official openai SDK
(`client.completions.create`). echo + logprobs equal the target's own forward over prompt and
reply; speculative equals plain, token for token, streamed and not; a list of prompts is a choice
each; bad input is a 400 naming the field and its value."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from service_support import assert_openai_error, make_pair, start_service

TOLERANCE = 1e-4  # float32 sums in another order (test_logprobs.py)
PROMPT_IDS = [12, 80, 101, 116, 32, 109, 101, 32, 40, 120, 200, 33]
TEXT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(served):
    return served[0].loaded.engine


def complete(gpt, prompt, **extra):
    return gpt.completions.create(model="tiny", prompt=prompt, **extra)


def own_logprobs(engine, ids: list[int]) -> np.ndarray:
    """log_softmax of the target's logits over `ids`, float64: row i predicts ids[i + 1]."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_echo_logprobs_equal_the_models_forward(gpt, engine):
    """Prompt and reply tokens alike: each logprob and its best alternatives are the forward's
    over the whole sequence (the reply's ids from the chunks' `dflash.token_ids`)."""
    chunks = [chunk for chunk in complete(gpt, PROMPT_IDS, echo=True, logprobs=2, max_tokens=6,
                                          stream=True) if chunk.choices]
    reply_ids = [i for chunk in chunks for i in chunk.model_extra["dflash"]["token_ids"]]
    ids = PROMPT_IDS + reply_ids
    tokens = [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens]
    values = [value for chunk in chunks for value in chunk.choices[0].logprobs.token_logprobs]
    tops = [top for chunk in chunks for top in chunk.choices[0].logprobs.top_logprobs]
    assert tokens == [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert values[0] is None and tops[0] is None  # nothing predicts the first token
    reference = own_logprobs(engine, ids)
    for position in range(1, len(ids)):
        row = reference[position - 1]
        assert values[position] == pytest.approx(row[ids[position]], abs=TOLERANCE)
        best = np.argsort(-row, kind="stable")[:2]
        # a dict by token string: the random target's stray bytes all read U+FFFD, one key
        shown = {engine.tokenizer.decode([i], skip_special_tokens=False): row[i] for i in best}
        for token, value in shown.items():
            if "\ufffd" not in token:
                assert tops[position][token] == pytest.approx(value, abs=TOLERANCE)
        if "\ufffd" not in tokens[position]:  # the token itself is among them
            assert tops[position][tokens[position]] == values[position]
    text = "".join(chunk.choices[0].text for chunk in chunks)
    assert text.startswith(engine.decode(PROMPT_IDS))
    offsets = [o for chunk in chunks for o in chunk.choices[0].logprobs.text_offset]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert offsets[len(PROMPT_IDS)] == len(engine.decode(PROMPT_IDS))  # the reply's first token


def test_lm_eval_request_shape(gpt, engine):
    """What lm-eval's local-completions sends for a loglikelihood: a batch of token lists, echo,
    logprobs 1, max_tokens 1; it reads token_logprobs[ctxlen:-1] and their top entries."""
    reply = complete(gpt, [PROMPT_IDS], echo=True, logprobs=1, max_tokens=1, temperature=0,
                     seed=1234)
    choice = reply.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(PROMPT_IDS) + 1  # prompt + the one generated
    reference = own_logprobs(engine, PROMPT_IDS)
    context = 5
    continuation = sum(choice.logprobs.token_logprobs[context:-1])
    expected = sum(reference[i - 1, PROMPT_IDS[i]] for i in range(context, len(PROMPT_IDS)))
    assert continuation == pytest.approx(expected, abs=len(PROMPT_IDS) * TOLERANCE)
    greedy = all(lp == max(top.values()) for lp, top in
                 zip(choice.logprobs.token_logprobs[context:-1], choice.logprobs.top_logprobs[context:-1]))
    assert greedy == all(int(np.argmax(reference[i - 1])) == PROMPT_IDS[i]
                         for i in range(context, len(PROMPT_IDS)))
    assert reply.usage.prompt_tokens == len(PROMPT_IDS)
    # the scoring's state was kept: the generation prefilled only the prompt's last row
    assert reply.usage.prompt_tokens_details.cached_tokens == len(PROMPT_IDS) - 1


def test_a_text_prompts_offsets_count_its_special_token_text(gpt, engine):
    """A text prompt is echoed as sent, a special token's text included: each token's offset
    is where its text starts in that echo."""
    prompt = "Hi<|im_end|> there"
    choice = complete(gpt, prompt, echo=True, logprobs=1, max_tokens=2).choices[0]
    ids = engine.encode_raw(prompt)
    special = ids.index(engine.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    offsets = choice.logprobs.text_offset
    assert choice.text.startswith(prompt)
    assert offsets[special] == prompt.index("<|im_end|>")
    assert offsets[special + 1] == prompt.index(" there")  # after the special token's text
    assert offsets[len(ids)] == len(prompt)  # the reply's first token


@pytest.mark.parametrize("block_size", [8, "auto"])
def test_speculative_equals_plain_streamed_and_not(gpt, block_size):
    asked = {"prompt": TEXT, "max_tokens": 40, "logprobs": 3, "echo": True}
    plain = complete(gpt, extra_body={"speculative": False}, **asked)
    spec = complete(gpt, extra_body={"block_size": block_size}, **asked)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    assert spec.usage.dflash["speculative"] and not plain.usage.dflash["speculative"]
    assert plain.usage.completion_tokens == 40
    spec_lp = [v for v in spec.choices[0].logprobs.token_logprobs if v is not None]
    plain_lp = [v for v in plain.choices[0].logprobs.token_logprobs if v is not None]
    assert spec_lp == pytest.approx(plain_lp, abs=TOLERANCE)

    chunks = list(complete(gpt, stream=True, stream_options={"include_usage": True},
                           extra_body={"block_size": block_size}, **asked))
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert texts[0].startswith(TEXT)  # the echo comes first
    assert "".join(texts) == plain.choices[0].text
    streamed = [lp for chunk in chunks if chunk.choices for lp in chunk.choices[0].logprobs.tokens]
    assert streamed == plain.choices[0].logprobs.tokens
    offsets = [o for chunk in chunks if chunk.choices for o in chunk.choices[0].logprobs.text_offset]
    assert offsets == plain.choices[0].logprobs.text_offset


def test_stop_and_a_list_of_prompts(gpt):
    whole = complete(gpt, TEXT, max_tokens=30).choices[0].text
    stop = whole[10:13]
    cut = complete(gpt, TEXT, max_tokens=30, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index(stop)]
    for prompts in ([TEXT, "Count slowly."], [PROMPT_IDS, PROMPT_IDS[:5]]):
        reply = complete(gpt, prompts, max_tokens=8, extra_body={"speculative": False})
        assert [c.index for c in reply.choices] == [0, 1]
        for prompt, choice in zip(prompts, reply.choices, strict=True):
            assert choice.text == complete(gpt, prompt, max_tokens=8).choices[0].text
        assert reply.usage.completion_tokens == sum(
            c.model_extra["dflash"]["rounds"] + 1 for c in reply.choices)  # plain: a token a round


@pytest.mark.parametrize(("body", "named"), [
    ({"prompt": TEXT, "echo": True, "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 10**6]}, "1000000"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [TEXT, ""]}, "prompt 1"),
    ({"prompt": [-3]}, "-3"),
    ({"prompt": TEXT, "suffix": "The end."}, "suffix"),
    ({"prompt": TEXT, "best_of": 2}, "best_of"),
    ({"prompt": TEXT, "n": 2}, "n"),
    ({"prompt": TEXT, "logprobs": 21}, "logprobs"),
    ({"prompt": [TEXT, TEXT], "stream": True}, "prompt"),
])
def test_bad_input_is_a_400_naming_field_and_value(served, body, named):
    response = httpx.post(served[1].url + "/v1/completions", json={"model": "tiny", **body})
    error = assert_openai_error(response, 400)
    assert named in error["message"]


def test_an_id_past_the_embeddings_rows_is_a_400(tmp_path):
    """A tokenizer may hold more tokens than the target has embedding rows: an id the
    embedding lacks is refused as outside the vocabulary, never run."""
    from transformers import AutoTokenizer

    target, drafter = make_pair(tmp_path / "pair")
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    rows = len(tokenizer)
    assert json.loads((target / "config.json").read_text())["vocab_size"] == rows  # the premise
    tokenizer.add_tokens(["<no-row>"])
    tokenizer.save_pretrained(str(target))
    _state, server = start_service(target, drafter)
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": [5, rows], "max_tokens": 2})
    finally:
        server.stop()
    message = assert_openai_error(response, 400)["message"]
    assert f"token id {rows} (position 1)" in message and f"ids are 0 to {rows - 1}" in message


@pytest.mark.parametrize(("prompt", "field", "tokens"), [
    ([5] * 1024, "prompt", 1024), ([[5], [5] * 1030], "prompt.1", 1030)])
def test_a_prompt_that_leaves_no_room_is_refused_before_it_queues(served, prompt, field, tokens):
    """In OpenAI's words, naming the prompt, before any of the request's prompts generates."""
    state, server = served
    jobs_before = state.loaded.worker.jobs_done
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 1024 tokens. "
                                       f"However, your prompt ({field}) resulted in {tokens} tokens")
    assert state.loaded.worker.jobs_done == jobs_before
