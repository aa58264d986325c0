"""EngineOptions: an engine is handed exactly the options given, under its constructor's names,
and an option its kind cannot honour is refused by name before anything loads or starts."""

from __future__ import annotations

import re

import pytest

from dflash_local import engines
from dflash_local.engines.options import EngineOptions
from dflash_local.engines.table import LAUNCHED, LOCAL, RELAY
from dflash_local.errors import InvalidRequestError


def test_only_the_options_given_reach_the_engine():
    assert EngineOptions().keywords("mlx", LOCAL) == {}
    options = EngineOptions(dtype="bfloat16", prefix_cache=False, draft_window=8)
    assert options.keywords("transformers", LOCAL) == {"dtype": "bfloat16", "prefix_cache": False,
                                                       "draft_window": 8}
    launched = EngineOptions(dtype="auto", plain_twin=True, extra_args=("--enforce-eager",))
    assert launched.keywords("vllm", LAUNCHED) == {"dtype": "auto", "plain_twin": True,
                                                   "extra_args": ("--enforce-eager",)}
    assert EngineOptions(api_key="k").keywords("openai", RELAY) == {"api_key": "k"}


@pytest.mark.parametrize(("options", "engine", "kind", "message"), [
    (EngineOptions(prefix_cache_mb=64), "vllm", LAUNCHED,
     "prefix_cache_mb 64: the vllm engine does not take it (local engines only)"),
    (EngineOptions(server_python="/v/bin/python"), "mlx", LOCAL,
     "server_python '/v/bin/python': the mlx engine does not take it (launched engines only)"),
    (EngineOptions(dtype="float32"), "openai", RELAY,
     "dtype 'float32': the openai engine does not take it (local and launched engines only)"),
])
def test_an_option_the_engine_cannot_honour_is_refused(options, engine, kind, message):
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        options.keywords(engine, kind)


def test_the_relay_is_refused_a_draft_window_before_it_connects():
    with pytest.raises(InvalidRequestError, match="draft_window 6: a relayed server keeps its own "
                                                  r"draft window \(set it where that server starts\)"):
        engines.load_engine("openai", "http://127.0.0.1:9", None, EngineOptions(draft_window=6))
