"""The local generation service: the HTTP APIs over one loaded engine.

app.py mounts one router per API (openai_chat.py, openai_responses.py, anthropic_messages.py,
management.py; each beside its `<api>_schemas.py`) -> jobs.py (request -> job -> SSE/JSON) ->
worker.py (the generation thread); state.py owns the loaded pair, downloads.py the hub
downloads. FastAPI is imported only here.
"""
