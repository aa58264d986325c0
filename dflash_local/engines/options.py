"""EngineOptions: what the CLIs and the service ask of an engine they load, typed and frozen,
from the parsed flags (cli/options.py) down to `load_engine` (engines/__init__.py), which gives
each engine the options it was given as its constructor's keywords.

Boundary: the options, which kinds of engine honour each, and the refusal of one an engine
cannot honour; no engine is imported here. The kinds are the engine table's: `local` runs the
pair in this process with our loop (mlx, transformers), `launched` starts a server with its own
DFlash flags (vllm, sglang), `relay` streams from a running OpenAI-compatible server (openai).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dflash_local.engines.table import LAUNCHED, LOCAL, RELAY
from dflash_local.errors import InvalidRequestError


def _option(default, *kinds: str, refusal: str | None = None):
    """A field the engines of `kinds` honour; `refusal`: why another kind cannot, where there
    is more to say than the kinds."""
    return field(default=default, metadata={"kinds": kinds, "refusal": refusal})


@dataclass(frozen=True)
class EngineOptions:
    """How to load an engine. A field left at its default is not given: the engine's own
    default applies. Each field applies to the kinds of engine named beside it."""

    # local, launched: auto, float32, bfloat16 or float16 (None: float32 for a local engine,
    # the checkpoint's own for a server)
    dtype: str | None = _option(None, LOCAL, LAUNCHED)
    # local, launched: the drafter keeps only the last N context rows (None: unbounded)
    draft_window: int | None = _option(
        None, LOCAL, LAUNCHED,
        refusal="a relayed server keeps its own draft window (set it where that server starts)")
    # local, the transformers engine only: torch's device (None: the CPU); MLX uses its default
    device: str | None = _option(None, LOCAL)
    # local: keep recent conversations' states for their next turn, in this many MB (None: the
    # default budget, engines' prefix caches: method/prefix_cache.py)
    prefix_cache: bool = _option(True, LOCAL)
    prefix_cache_mb: int | None = _option(None, LOCAL)
    # local: the prefix cache's disk tier under the data dir, in MB (None: its default, 0: off;
    # method/prefix_disk.py)
    prefix_cache_disk_mb: int | None = _option(None, LOCAL)
    # launched: also start a plain server of the target (speculation off per request, races)
    plain_twin: bool = _option(False, LAUNCHED)
    # launched: the interpreter whose venv has the server (None: this one)
    server_python: str | None = _option(None, LAUNCHED)
    # launched: more flags for the server's command line
    extra_args: tuple[str, ...] = _option((), LAUNCHED)
    # relay: the server's API key, and a plain server of the same target
    api_key: str | None = _option(None, RELAY)
    plain_base_url: str | None = _option(None, RELAY)

    def keywords(self, engine: str, kind: str) -> dict[str, object]:
        """The constructor keywords of `engine`, of `kind`: the fields given. One its kind
        cannot honour is refused, naming the field, its value and who takes it."""
        given = {}
        for option in fields(self):
            value = getattr(self, option.name)
            if value == option.default:
                continue
            kinds = option.metadata["kinds"]
            if kind not in kinds:
                why = (option.metadata["refusal"] or
                       f"the {engine} engine does not take it ({' and '.join(kinds)} engines only)")
                raise InvalidRequestError(f"{option.name} {value!r}: {why}")
            given[option.name] = value
        return given


ENGINE_DEFAULTS = EngineOptions()  # nothing given: each engine's own defaults
