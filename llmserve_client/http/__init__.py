"""OpenAI-compatible HTTP frontend (`llmserve-serve`): a thin client of llmserve-core over its protocol.

    from llmserve_client import AsyncClient
    from llmserve_client.http import build_app
    app = build_app(AsyncClient("ipc:///path/core.sock"))     # any ASGI server; startup waits for the core

Needs the `http` extra (starlette/fastapi and uvicorn).
"""
from llmserve_client.http.app import build_app

__all__ = ["build_app"]
