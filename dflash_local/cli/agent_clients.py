"""The agent clients `dflash-local launch` starts, and which catalog pairs can serve them.

Boundary: data and pure decisions only (no process, no HTTP): each client's size and API, the
command line and environment that point it at a service, and whether a pair takes tools and
has the context a client's fixed prompt needs. `cli/launch.py` runs what this decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from dflash_local.engines.table import LOCAL, engine_names
from dflash_local.errors import InvalidRequestError
from dflash_local.pairs.catalog import EMBEDDED_PAIR_ID, Catalog, PairSpec

API_KEY_ENV = "DFLASH_LOCAL_API_KEY"  # the key the service takes (`serve --api-key`'s default)
PROVIDER_ID = "dflash_local"  # the provider name written into codex's and opencode's config
# what a session needs past the fixed prompt: the conversation, file contents, tool results and
# the replies; below it a client compacts after a turn or two
WORK_ROOM_TOKENS = 16384
LOCAL_ENGINES = frozenset(engine_names(LOCAL))  # the engines the service passes tools to


@dataclass(frozen=True)
class Pointing:
    """How a client is pointed at a service: arguments before the user's, and environment."""

    args: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True)
class Service:
    """The service a client talks to: its root URL, key and model name, and its context."""

    url: str  # http://127.0.0.1:PORT, no /v1
    api_key: str
    model: str
    max_context: int


@dataclass(frozen=True)
class AgentClient:
    name: str  # what `launch` takes
    executable: str
    package: str  # the npm package it installs from
    api: str  # the endpoint it speaks
    # its first request's prompt with its default tools: SmolLM2's tokenizer on the prompt
    # scripts/agent_clients.py records, rounded up (another target's tokenizer differs a little)
    prompt_tokens: int
    point: Callable[[Service], Pointing]

    @property
    def context_needed(self) -> int:
        return self.prompt_tokens + WORK_ROOM_TOKENS


def _point_claude(service: Service) -> Pointing:
    # AUTH_TOKEN (a bearer key), not API_KEY: Claude Code asks before it uses a custom API key
    return Pointing((), {"ANTHROPIC_BASE_URL": service.url, "ANTHROPIC_AUTH_TOKEN": service.api_key,
                         "ANTHROPIC_MODEL": service.model,
                         "ANTHROPIC_SMALL_FAST_MODEL": service.model})


def _point_codex(service: Service) -> Pointing:
    provider = {"name": "dflash-local", "base_url": f"{service.url}/v1", "env_key": API_KEY_ENV,
                "wire_api": "responses"}
    table = ", ".join(f"{key} = {json.dumps(value)}" for key, value in provider.items())
    overrides = {"model_provider": json.dumps(PROVIDER_ID), "model": json.dumps(service.model),
                 f"model_providers.{PROVIDER_ID}": f"{{ {table} }}",
                 "model_context_window": str(service.max_context)}
    args = tuple(part for key, value in overrides.items() for part in ("-c", f"{key}={value}"))
    return Pointing(args, {API_KEY_ENV: service.api_key})


def _point_opencode(service: Service) -> Pointing:
    model = {"name": service.model, "tool_call": True,
             "limit": {"context": service.max_context, "output": WORK_ROOM_TOKENS // 2}}
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "dflash-local",
                "options": {"baseURL": f"{service.url}/v1", "apiKey": f"{{env:{API_KEY_ENV}}}"},
                "models": {service.model: model}}
    config = {"provider": {PROVIDER_ID: provider}, "model": f"{PROVIDER_ID}/{service.model}"}
    # merged over the user's own config by opencode itself: their files stay untouched
    return Pointing((), {"OPENCODE_CONFIG_CONTENT": json.dumps(config),
                         API_KEY_ENV: service.api_key})


CLIENTS = {client.name: client for client in (
    AgentClient("claude", "claude", "@anthropic-ai/claude-code", "/v1/messages", 23000,
                _point_claude),
    AgentClient("codex", "codex", "@openai/codex", "/v1/responses", 9000, _point_codex),
    AgentClient("opencode", "opencode", "opencode-ai", "/v1/chat/completions", 8000,
                _point_opencode),
)}

# The tool-call format each target architecture's chat template writes (service/tool_formats.py
# parses these), and its context where the catalog gives none (the family's config.json).
TOOL_FAMILIES: dict[str, tuple[str, int | None]] = {
    "qwen3": ("hermes", 40960), "qwen3_moe": ("qwen3_coder", 262144),
    "qwen3_next": ("qwen3_coder", 262144), "qwen3_5": ("qwen3_coder", 262144),
    "qwen3_5_moe": ("qwen3_coder", 262144), "gpt_oss": ("harmony", 131072),
    "llama": ("llama3_json", 131072),
}
# pairs whose target's template has no tool section, whatever its architecture (SmolLM2)
NO_TOOL_PAIRS = frozenset({EMBEDDED_PAIR_ID})


def pair_context(pair: PairSpec) -> int | None:
    declared = (pair.architecture() or {}).get("max_position_embeddings")
    return declared or TOOL_FAMILIES.get(pair.model_type, (None, None))[1]


def why_pair_cannot_serve(pair: PairSpec, client: AgentClient,
                          engines: frozenset[str] = LOCAL_ENGINES) -> str | None:
    """None when the pair can serve the client on one of `engines`; else the reason, in words."""
    if not set(pair.engines) & engines:
        return (f"it runs on {', '.join(pair.engines)}, not on a local engine "
                f"({', '.join(sorted(engines)) or 'none installed'}); a server engine gets no tools from us")
    if pair.id in NO_TOOL_PAIRS or pair.model_type not in TOOL_FAMILIES:
        return "its chat template takes no tools, or writes calls in a format not parsed here"
    context = pair_context(pair)
    if context is not None and context < client.context_needed:
        return (f"its context of {context} tokens is under the {client.context_needed} {client.name} "
                f"needs ({client.prompt_tokens} for its prompt and tools + {WORK_ROOM_TOKENS} to work)")
    return None


def pairs_that_serve(catalog: Catalog, client: AgentClient,
                     engines: frozenset[str] = LOCAL_ENGINES) -> list[PairSpec]:
    return [pair for pair in catalog.pairs if why_pair_cannot_serve(pair, client, engines) is None]


def refusal(pair_id: str, reason: str, catalog: Catalog, client: AgentClient,
            engines: frozenset[str] = LOCAL_ENGINES) -> InvalidRequestError:
    """The error naming why this pair cannot serve the client and the catalog pairs that can."""
    fitting = ", ".join(pair.id for pair in pairs_that_serve(catalog, client, engines)) or "none"
    return InvalidRequestError(f"pair {pair_id!r} cannot serve {client.name}: {reason}. Pairs "
                               f"that can on {', '.join(sorted(engines))}: {fitting}")


def check_loaded(client: AgentClient, pair_id: str | None, max_context: int | None,
                 catalog: Catalog, engines: frozenset[str] = LOCAL_ENGINES) -> None:
    """A running service's pair: as a catalog pair where it is one, and by its own context."""
    reason = None
    if pair_id is not None and pair_id in {pair.id for pair in catalog.pairs}:
        reason = why_pair_cannot_serve(catalog.get(pair_id), client, engines)
    if reason is None and max_context is not None and max_context < client.context_needed:
        reason = (f"its context of {max_context} tokens is under the {client.context_needed} "
                  f"{client.name} needs")
    if reason is not None:
        raise refusal(pair_id or "loaded", reason, catalog, client, engines)
