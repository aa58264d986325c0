"""harmony (gpt-oss) replies split into content, reasoning and calls (service/harmony.py), fed
whole and in pieces of every size; and the detokenizer that keeps only a harmony tokenizer's
special tokens."""

from __future__ import annotations

import json

import pytest
import tiny_models
from harmony_tiny import CALL_REPLY, PLAIN_REPLY
from harmony_tiny import make_tokenizer as make_harmony_tokenizer

from dflash_local.engines.chat_prompt import end_of_turn_ids
from dflash_local.engines.detokenize import StreamDetokenizer, speaks_harmony
from dflash_local.service.harmony import HarmonySplitter
from dflash_local.service.tool_stream import ParsedCall

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
PIECES = (1, 2, 3, 5, 7, 1000)


def split(text: str, piece: int, schemas=None) -> tuple[str, str, list[ParsedCall]]:
    """(content, reasoning, calls) of `text` fed `piece` characters at a time."""
    splitter = HarmonySplitter(SCHEMAS if schemas is None else schemas)
    content, reasoning, calls = [], [], []
    for start in range(0, len(text), piece):
        out, made = splitter.feed(text[start:start + piece])
        content.append(out)
        calls += made
        reasoning.append(splitter.take_reasoning())
    out, made = splitter.finish()
    return "".join(content) + out, "".join(reasoning) + splitter.take_reasoning(), calls + made


@pytest.mark.parametrize("piece", PIECES)
def test_analysis_is_reasoning_and_final_is_content(piece):
    assert split(PLAIN_REPLY, piece) == ("Hello there!", "Greet back.", [])


@pytest.mark.parametrize("piece", PIECES)
def test_a_commentary_call_to_a_given_function_is_a_call(piece):
    assert split(CALL_REPLY, piece) == ("", "Need weather.",
                                        [ParsedCall("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("piece", PIECES)
def test_the_recipient_may_sit_after_the_role(piece):
    reply = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
    assert split(reply, piece)[2] == [ParsedCall("get_weather", '{"city": "Rome"}')]


CALL = '<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}'


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(("call", "schemas"), [
    (CALL.format(name="get_weather", body='{"city": "Paris"<|call|>'), None),  # bad JSON
    (CALL.format(name="get_weather", body='["Paris"]<|call|>'), None),  # arguments not an object
    (CALL.format(name="get_time", body='{"city": "Paris"}<|call|>'), None),  # not among tools
    (CALL.format(name="get_weather", body='{"city": "Paris"}<|call|>'), {}),  # no tools given
    (CALL.format(name="get_weather", body='{"city": "Pa'), None),  # cut off
])
def test_a_malformed_call_is_the_text_the_model_wrote(call, schemas, piece):
    content, reasoning, calls = split("<|channel|>analysis<|message|>hm<|end|>" + call, piece, schemas)
    assert (content, reasoning, calls) == (call, "hm", [])


@pytest.mark.parametrize("piece", PIECES)
def test_a_preamble_is_content_and_calls_follow(piece):
    reply = ("<|channel|>commentary<|message|>Checking.<|end|>"
             + CALL.format(name="get_weather", body='{"city": "Oslo"}<|call|>'))
    assert split(reply, piece) == ("Checking.", "", [ParsedCall("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("text", ["plain words, no markup", "a < b <| c |> d", "x" * 300])
def test_text_outside_the_format_is_content_unchanged(text, piece):
    assert split(text, piece) == (text, "", [])


def test_content_streams_holding_back_only_a_possible_marker():
    splitter = HarmonySplitter({})
    assert splitter.feed("<|channel|>final<|message|>Hel") == ("Hel", [])
    assert splitter.feed("lo <|re") == ("lo ", [])
    assert splitter.feed("turn|>") == ("", [])
    assert splitter.finish() == ("", [])


def test_a_forced_named_call_continues_from_its_opener():
    splitter = HarmonySplitter(SCHEMAS)
    assert splitter.feed("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>") == ("", [])
    text, calls = splitter.feed('{"city": "Lima"}<|call|>')
    assert (text, calls, splitter.calls_made) == ("", [ParsedCall("get_weather", '{"city": "Lima"}')], 1)


def test_only_a_harmony_tokenizer_keeps_its_special_tokens(tmp_path):
    harmony = make_harmony_tokenizer(tmp_path / "harmony")
    plain = tiny_models.make_tokenizer(tmp_path / "plain")
    assert speaks_harmony(harmony) and not speaks_harmony(plain)

    ids = harmony.encode(PLAIN_REPLY, add_special_tokens=False)
    # what a user saw before: the markers dropped, the channels run together
    assert harmony.decode(ids, skip_special_tokens=True) == "analysisGreet back.assistantfinalHello there!"
    detokenizer = StreamDetokenizer(harmony)
    assert "".join(detokenizer.add([token]) for token in ids) == PLAIN_REPLY

    plain_ids = plain.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert StreamDetokenizer(plain).add(plain_ids) == "hi"


def test_call_and_return_end_a_harmony_turn(tmp_path):
    harmony = make_harmony_tokenizer(tmp_path / "harmony")
    ends = end_of_turn_ids(harmony)
    assert {harmony.convert_tokens_to_ids(marker) for marker in ("<|call|>", "<|return|>")} <= set(ends)
    assert harmony.convert_tokens_to_ids("<|end|>") not in ends  # the analysis message's end


def test_call_arguments_keep_their_json():
    reply = CALL.format(name="get_weather", body=json.dumps({"city": "Zürich"}, ensure_ascii=False) + "<|call|>")
    assert split(reply, 4)[2] == [ParsedCall("get_weather", '{"city": "Zürich"}')]
