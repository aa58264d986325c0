"""The service's routes: each API's module owns its operations, and the app serves exactly
these, with the same methods, paths and operation ids (what a client or a generated SDK keys on),
whichever module a route lives in. Nothing is loaded or served: the app is only built.
"""

from __future__ import annotations

import importlib

import pytest

# module -> (method, path, operationId) of every route it declares
OPERATIONS_BY_MODULE = {
    "openai_chat": {
        ("POST", "/v1/chat/completions", "chat_completions_v1_chat_completions_post"),
    },
    "openai_completions": {
        ("POST", "/v1/completions", "completions_v1_completions_post"),
    },
    "openai_responses": {
        ("POST", "/v1/responses", "create_response_v1_responses_post"),
    },
    "anthropic_messages": {
        ("POST", "/v1/messages", "messages_v1_messages_post"),
        ("POST", "/v1/messages/count_tokens", "count_tokens_v1_messages_count_tokens_post"),
    },
    "management": {
        ("GET", "/health", "health_health_get"),
        ("GET", "/v1/models", "models_v1_models_get"),
        ("GET", "/dflash/catalog", "catalog_dflash_catalog_get"),
        ("POST", "/dflash/load", "load_dflash_load_post"),
        ("GET", "/dflash/status", "status_dflash_status_get"),
        ("POST", "/dflash/downloads", "start_download_dflash_downloads_post"),
        ("GET", "/dflash/downloads", "list_downloads_dflash_downloads_get"),
        ("GET", "/dflash/downloads/{download_id}", "get_download_dflash_downloads__download_id__get"),
        ("GET", "/dflash/downloads/{download_id}/events",
         "download_events_dflash_downloads__download_id__events_get"),
        ("DELETE", "/dflash/downloads/{download_id}",
         "cancel_download_dflash_downloads__download_id__delete"),
    },
}


def operations(openapi: dict) -> set[tuple[str, str, str]]:
    return {(method.upper(), path, operation["operationId"])
            for path, by_method in openapi["paths"].items()
            for method, operation in by_method.items()}


@pytest.mark.parametrize("module_name", sorted(OPERATIONS_BY_MODULE))
def test_each_api_module_declares_its_own_routes(module_name):
    from fastapi import FastAPI

    module = importlib.import_module(f"dflash_local.service.{module_name}")
    alone = FastAPI()
    alone.include_router(module.router)
    assert operations(alone.openapi()) == OPERATIONS_BY_MODULE[module_name]


def test_the_app_serves_exactly_the_operations_of_its_routers():
    from dflash_local.service.app import create_app
    from dflash_local.service.state import ServiceState

    app = create_app(ServiceState())
    assert operations(app.openapi()) == set().union(*OPERATIONS_BY_MODULE.values())
    assert app.openapi_url is None  # the document is built here, never served
