"""Whom an HTTP request is for: the `user` the frontend hands the core with it, so the core's fair shares
and per-client queue caps hold between HTTP users, not just between connections (the frontend is one).

In order: the request's API key (`Authorization: Bearer ...`), unless it is the server's own --api-key
(every client then sends the same one); else OpenAI's `user` field; else the peer's address. Keys and user
names are hashed, so no secret, and no name of unbounded length, reaches the core or a log. A client that
invents names (keys, `user` values) gets a share per name: fair shares assume names that clients cannot
mint, such as keys a gateway in front of this server issues. Behind a proxy every request comes from its
address: let the proxy pass keys or `user` on.
"""
from __future__ import annotations

import hashlib
import hmac


def _digest(kind: str, value: bytes) -> str:
    return f"{kind}:{hashlib.sha256(value).hexdigest()[:24]}"


class Requester:
    """What the HTTP layer knows of a request's sender, before its body is decoded."""

    def __init__(self, scope: dict, server_key: str | None):
        self.bearer: bytes | None = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                if scheme.lower() == b"bearer" and token:
                    self.bearer = token
                break
        if self.bearer is not None and server_key is not None and hmac.compare_digest(self.bearer, server_key.encode()):
            self.bearer = None          # the server's own key names no one
        client = scope.get("client")
        self.address = client[0] if client else ""

    def user(self, openai_user: str | None) -> str:
        """The core's `user` for this request (a short, fixed-size string)."""
        if self.bearer is not None:
            return _digest("key", self.bearer)
        if openai_user:
            return _digest("user", openai_user.encode(errors="surrogatepass"))
        return f"addr:{self.address}"[:64]
