"""A long conversation through the real dflash-chat app (Pilot) against the real embedded pair:
the app starts its own service, as `dflash-chat` does, and sends TURNS prompts of a few hundred
tokens each, so the chat passes the pair's 8k context and the overflow policy has to act. Per
turn it records whether the send succeeded, the prompt's tokens as served, how many messages
were left out (shown dimmed) and whether the app said so. Not a test (minutes on a CPU).

    nice .venv/bin/python scripts/tui_long_chat.py --turns 40 --out /tmp/tui-long-chat.json \\
        --record docs/records/tui-long-chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tui")]

from dflash_chat.app import DFlashChatApp
from dflash_chat.settings import Settings
from dflash_chat.widgets.prompt_input import PromptInput

TOPICS = ("rivers", "bridges", "bread", "clocks", "maps", "bees", "glass", "ships", "salt", "ink")
FILLER = ("People have studied {topic} for centuries, and each generation adds its own notes on "
          "how {topic} are made, used, repaired and described. ")


def prompt_for(turn: int, sentences: int) -> str:
    topic = TOPICS[turn % len(TOPICS)]
    return (f"Turn {turn + 1}. " + FILLER.format(topic=topic) * sentences
            + f"In one sentence: what is one surprising fact about {topic}?")


async def wait_for(pilot, predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        await pilot.pause(0.1)


async def one_turn(app, pilot, turn: int, sentences: int) -> dict:
    screen = app.chat_screen
    conversation = screen.conversation
    shown = len(conversation.views())
    notes_before = {id(note) for note in app._notifications}
    started = time.monotonic()
    screen.query_one(PromptInput).value = prompt_for(turn, sentences)
    await pilot.press("enter")
    notes: set[str] = set()

    def hearing(done):  # a notice leaves after its timeout, maybe before a slow reply ends
        def check() -> bool:
            notes.update(str(n.message) for n in app._notifications if id(n) not in notes_before)
            return done()
        return check

    await wait_for(pilot, hearing(lambda: len(conversation.views()) == shown + 2), "sent", 120)
    reply_id = conversation.last_view("assistant").message_id
    await wait_for(pilot, hearing(lambda: app.store.message(reply_id).status != "streaming"),
                   "reply", 300)
    await wait_for(pilot, lambda: not conversation.generating, "reply handled", 30)
    reply = app.store.message(reply_id)
    stats = (reply.meta or {}).get("stats") or {}
    return {"turn": turn + 1, "status": reply.status, "seconds": round(time.monotonic() - started, 1),
            "prompt_tokens": stats.get("prompt_tokens"),
            "completion_tokens": stats.get("completion_tokens"),
            "messages": len(conversation.views()),
            "left_out": sum(view.left_out for view in conversation.views()),
            "said_left_out": any("left out" in note for note in notes)}


async def run(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="tui-long-chat-"))
    settings = Settings(max_tokens=args.max_tokens, overflow=args.policy,
                        keep_turns=args.keep_turns)
    app = DFlashChatApp(data_dir=home, settings_file=home / "settings.toml", settings=settings)
    turns: list[dict] = []
    async with app.run_test(size=(150, 45), notifications=True) as pilot:
        await wait_for(pilot, app.service_ready.is_set, "the service ready", args.start_timeout)
        context = app.loaded_context()
        for turn in range(args.turns):
            try:
                turns.append(await one_turn(app, pilot, turn, args.sentences))
            except TimeoutError as exc:  # the record says where it stopped
                turns.append({"turn": turn + 1, "status": f"timeout: {exc}"})
                break
            print(json.dumps(turns[-1]), flush=True)
    return {"pair": "embedded", "context": context, "policy": args.policy,
            "max_tokens": args.max_tokens, "turns": turns,
            "all_sent": len(turns) == args.turns and all(t["status"] == "done" for t in turns),
            "first_turn_dropping": next((t["turn"] for t in turns if t.get("left_out")), None)}


COLUMNS = [{"key": "status", "label": "reply"},
           {"key": "prompt_tokens", "label": "prompt tokens (served)", "decimals": 0},
           {"key": "messages", "label": "messages in the chat", "decimals": 0},
           {"key": "left_out", "label": "left out (shown dimmed)", "decimals": 0},
           {"key": "said", "label": "the app said so"}]


def record_of(result: dict, command: str) -> dict:
    """The docs/records/ form: the turns every 5, and the turn where the policy first acted."""
    first = result["first_turn_dropping"]
    rows = [{"label": f"turn {t['turn']}", **{k: t.get(k) for k in ("status", "prompt_tokens",
             "messages", "left_out")}, "said": "yes" if t.get("said_left_out") else ""}
            for t in result["turns"] if t["turn"] % 5 == 0 or t["turn"] in (1, first)]
    sent = sum(t["status"] == "done" for t in result["turns"])
    return {
        "title": f"A {len(result['turns'])}-turn chat in dflash-chat on the embedded pair",
        "compares": "the overflow policy over a chat longer than the 8k context: every send "
                    "succeeds, what was left out is shown",
        "measured": f"The real app (Pilot) and its own service; {sent} of "
                    f"{len(result['turns'])} sends answered; the policy first left turns out at "
                    f"turn {first}.",
        "dataset": "generated prompts of ~260 tokens each (scripts/tui_long_chat.py)",
        "date": datetime.date.today().isoformat(),
        "engine": "auto (the app's default)",
        "settings": {"overflow": result["policy"], "max_tokens": result["max_tokens"],
                     "context": result["context"], "pair": "embedded"},
        "command": command, "source": "scripts/tui_long_chat.py, tui/dflash_chat/context_fit.py",
        "row_header": "turn", "columns": COLUMNS, "rows": rows, "notes": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--policy", default="drop_oldest", choices=["drop_oldest", "keep_last"])
    parser.add_argument("--keep-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--sentences", type=int, default=8, help="filler sentences a prompt")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, required=True, help="every turn, as JSON")
    parser.add_argument("--record", type=Path, help="also write the docs/records/ record here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.record:
        command = "scripts/tui_long_chat.py " + " ".join(argv if argv is not None else sys.argv[1:])
        from dflash_local.bench.report import write_record

        write_record(args.record, record_of(result, command), setting="shared CPU")
    print(json.dumps({k: v for k, v in result.items() if k != "turns"}))
    return 0 if result["all_sent"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
