"""How a route reaches the service's state: the app holds one ServiceState (`app.state.dflash`,
set by create_app) and a route takes it as a FastAPI dependency, so routes are plain module
functions and a test can build several apps, each around its own state.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dflash_local.service.state import ServiceState


def service_state(request: Request) -> ServiceState:
    return request.app.state.dflash


ServiceStateDep = Annotated[ServiceState, Depends(service_state)]
