"""The app: the routers of each API mounted behind the guards, around one ServiceState.

`create_app(state)` builds it, so tests and the CLI start the same server. Routes live one
module per API: openai_chat.py, openai_completions.py, openai_responses.py, anthropic_messages.py,
management.py.
With an API key, every route but /health needs it (`Authorization: Bearer <key>` or
`x-api-key: <key>`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from dflash_local import __version__
from dflash_local.service import (
    anthropic_messages,
    management,
    openai_chat,
    openai_completions,
    openai_responses,
)
from dflash_local.service.anthropic_messages import AnthropicErrors
from dflash_local.service.api_errors import ErrorLog, install_handlers
from dflash_local.service.guards import (
    DEFAULT_MAX_BODY_BYTES,
    LOOPBACK_HOSTS,
    BearerAuth,
    BodyLimit,
    HostAllowList,
)
from dflash_local.service.json_depth import JsonBodyCheck
from dflash_local.service.state import ServiceState


@asynccontextmanager
async def lifespan(app: FastAPI):
    yield
    await asyncio.to_thread(app.state.dflash.shutdown)


def create_app(state: ServiceState, allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    # no docs page, so no schema either: it would only map the API for a stranger
    app = FastAPI(title="dflash-local", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dflash = state  # routes reach it through app_state.ServiceStateDep
    install_handlers(app)
    # the last added runs first: Host, then the key, then the body's size, then its JSON's shape
    app.add_middleware(JsonBodyCheck)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BearerAuth, api_key=state.api_key)
    app.add_middleware(HostAllowList, allowed_hosts=allowed_hosts)
    app.add_middleware(AnthropicErrors)  # it reshapes the guards' errors too
    app.add_middleware(ErrorLog)  # outermost: it logs every 4xx, whoever answered it
    for api in (management, openai_chat, openai_completions, anthropic_messages, openai_responses):
        app.include_router(api.router)
    return app
