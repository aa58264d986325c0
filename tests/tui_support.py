"""What the Pilot tests of dflash-chat share: waiting for the app, running it offline, a reply
streamed as its worker posts it, and the text on the screen."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from dflash_chat.app import DFlashChatApp, Options
from dflash_chat.protocol import StreamChunk, StreamUsage
from dflash_chat.settings import Settings
from dflash_chat.widgets.conversation import Conversation
from dflash_chat.widgets.prompt_input import PromptInput


async def until(pilot, predicate, what: str = "condition", timeout: float = 30.0) -> None:
    """Let the app run until `predicate()` holds (a wait, not an assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await pilot.pause(0.05)


def run_offline(scenario, size: tuple[int, int], settings: Settings | None = None,
                toasts: bool = False) -> None:
    """Run `scenario(app, pilot)` in an app that starts no service (`toasts`: notifications are
    shown on screen, as the user sees them)."""
    async def main():
        app = DFlashChatApp(Options(connect=False), settings=settings)
        async with app.run_test(size=size, notifications=toasts) as pilot:
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


def chunk(text: str, ids, accepted: int, round_index: int, finish: str | None = None):
    return StreamChunk(text, tuple(ids), drafted=7 if round_index else 0, accepted=accepted,
                       round=round_index, block_size=8, finish_reason=finish,
                       received_at=time.monotonic())


async def streamed_reply(app, pilot, chunks, status: str, usage: StreamUsage | None = None):
    """A reply started as Enter starts one, its chunks and end posted as the worker posts them."""
    screen = app.chat_screen
    screen.query_one(PromptInput).value = "Count to ten."
    await pilot.press("enter")
    conversation = screen.conversation
    await until(pilot, lambda: conversation.generating, "reply started")
    reply_id = conversation.last_view("assistant").message_id
    conversation.post_message(Conversation.RequestSent(reply_id, time.monotonic()))
    arrived = [replace(c, received_at=time.monotonic()) for c in chunks]  # after the request
    conversation.post_message(Conversation.ChunksArrived(reply_id, arrived))
    conversation.post_message(Conversation.StreamEnded(reply_id, status, usage, None))
    await until(pilot, lambda: not conversation.generating, "reply ended")
    await pilot.pause()
    return conversation.last_view("assistant")
