"""The local generation service: an OpenAI-compatible HTTP API over one loaded engine.

app.py (routes) -> chat.py (request -> job -> SSE/JSON) -> worker.py (the generation thread);
state.py owns the loaded pair, downloads.py the hub downloads. FastAPI is imported only here.
"""
