"""Training's follow-up turns on a harmony (gpt-oss format) target: the tiny harmony target
regenerates its answer for real (analysis, then final), and the conversation that goes on sends
back what a chat client would: the final channel, as the service splits it."""

from __future__ import annotations

import pytest
from harmony_tiny import GREETING, HELLO, PLAIN_REPLY, REASONING, harmony_pair

from dflash_local.errors import DFlashError
from dflash_local.train import chat_prompts, regenerate


@pytest.fixture(scope="module")
def harmony_target(tmp_path_factory):
    """The tiny harmony target's (tokenizer, model), loaded once for the module."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = harmony_pair(tmp_path_factory)
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    return tokenizer, AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)


@pytest.fixture
def one_request(monkeypatch):
    """The templated chat requests cut to the one the tiny target knows (it writes noise for
    any other): the request list is data, every step after it runs as in training."""
    monkeypatch.setattr(chat_prompts, "templated_chat_prompts", lambda: [GREETING])
    monkeypatch.setattr(regenerate, "templated_chat_prompts", lambda: [GREETING])


def test_a_harmony_answer_goes_back_as_its_final_channel(harmony_target, tmp_path, one_request):
    tokenizer, model = harmony_target
    data = tmp_path / "chat"
    regenerate.regenerate(model, tokenizer, [GREETING], (1, 3), data, max_new_tokens=64)
    prompt = tuple(regenerate.encode_prompt(tokenizer, GREETING))
    written = regenerate.answers_in(data, {prompt})[prompt]
    assert tokenizer.decode(written) == PLAIN_REPLY  # the target's own reply, both channels
    [conversation] = regenerate.follow_up_prompts(tokenizer, data)
    request, answer, follow_up = conversation
    assert request == {"role": "user", "content": GREETING}
    assert answer == {"role": "assistant", "content": HELLO}  # not "analysisGreet back.assistantfinal..."
    assert follow_up["content"] in chat_prompts.FOLLOW_UPS
    sent = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert f"<|channel|>final<|message|>{HELLO}<|end|>" in sent and REASONING not in sent


def test_an_answer_cut_inside_its_reasoning_has_nothing_to_go_on_from(harmony_target, tmp_path,
                                                                       one_request):
    tokenizer, model = harmony_target
    data = tmp_path / "chat"
    regenerate.regenerate(model, tokenizer, [GREETING], (1, 3), data, max_new_tokens=6)
    prompt = tuple(regenerate.encode_prompt(tokenizer, GREETING))
    written = regenerate.answers_in(data, {prompt})[prompt]
    assert PLAIN_REPLY.startswith(tokenizer.decode(written)) and len(written) == 6
    assert regenerate.answer_text(tokenizer, written) == ""  # the user saw no answer yet
    with pytest.raises(DFlashError, match="holds no answers to the --chat-prompts requests"):
        regenerate.follow_up_prompts(tokenizer, data)
