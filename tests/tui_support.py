"""What the Pilot tests of dflash-chat share: waiting for the app, and running it offline."""

from __future__ import annotations

import asyncio

from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.settings import Settings


async def until(pilot, predicate, what: str = "condition", timeout: float = 30.0) -> None:
    """Let the app run until `predicate()` holds (a wait, not an assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await pilot.pause(0.05)


def run_offline(scenario, size: tuple[int, int], settings: Settings | None = None) -> None:
    """Run `scenario(app, pilot)` in an app that starts no service."""
    async def main():
        app = DFlashChatApp(Options(connect=False), settings=settings)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(app, pilot)
    asyncio.run(main())


def serve_pair(app, pair_id: str, thinking: str | None = None) -> None:
    """Make the offline app believe its service loaded `pair_id` on Transformers (and, with
    `thinking`, that the catalog lists the pair with that thinking mode)."""
    if thinking is not None:
        app.catalog = [{"id": pair_id, "thinking": thinking}]
    app.status = {"loaded": {"pair": pair_id, "served_name": pair_id, "engine": "transformers",
                             "drafter": "z/d"}}


def screen_lines(app) -> list[str]:
    """The text on the terminal, line by line, as the compositor paints it."""
    return [strip.text for strip in app.screen._compositor.render_strips()]
