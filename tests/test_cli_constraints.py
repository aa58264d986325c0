"""`dflash-local generate --json-schema FILE / --grammar FILE / --regex`, as a user runs it (a
subprocess on a tiny pair; the other flags in-process): the reply equals the naive constrained oracle and validates; a bad
schema or an unreadable file is an error naming the flag, before any model loads."""

from __future__ import annotations

import json

import pytest
from constraint_oracle import ANSWER_SCHEMA, constrained_plain, follows_answer_schema
from fixtures_tiny import tiny_engine, tiny_pair
from test_cli import cli, cli_env  # noqa: F401 (cli_env: a fixture this module uses)

from dflash_local.cli.main import main
from dflash_local.events import OutputConstraint

PROMPT = "Is it raining? Answer in JSON."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, "qwen3")


def test_generate_json_schema_follows_the_schema(pair, cli_env, tmp_path):  # noqa: F811
    schema_file = tmp_path / "answer.json"
    schema_file.write_text(json.dumps(ANSWER_SCHEMA))
    result = cli(cli_env, "generate", "--json", "--target", str(pair.target), "--drafter",
                 str(pair.drafter), "--block-size", "8", "--max-tokens", "64",
                 "--json-schema", str(schema_file), PROMPT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    engine = tiny_engine(pair)
    constraint = OutputConstraint("json_schema", json.dumps(ANSWER_SCHEMA))
    assert report["token_ids"] == constrained_plain(engine, report["prompt_token_ids"], constraint, 64)
    assert follows_answer_schema(report["text"])


def test_generate_grammar_and_regex(pair, capsys, tmp_path):
    grammar_file = tmp_path / "yes_no.lark"
    grammar_file.write_text('start: "yes" | "no"\n')
    for flag, value in (("--grammar", str(grammar_file)), ("--regex", "(yes|no)")):
        assert main(["generate", "--json", "--target", str(pair.target), "--drafter",
                     str(pair.drafter), "--max-tokens", "8", flag, value, PROMPT]) == 0
        assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")


def test_bad_constraints_are_named_before_loading(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    for args, words in ((["--json-schema", str(bad)], f"--json-schema {bad}: invalid JSON Schema"),
                        (["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
                        (["--regex", "a(b"], "--regex: invalid regex")):
        assert main(["generate", "--target", "nobody/no-such-model", *args, PROMPT]) != 0
        stderr = capsys.readouterr().err
        assert words in stderr, stderr
        assert "no-such-model" not in stderr  # refused before the model is looked up
