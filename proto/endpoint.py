"""Where the core listens by default, shared so a client with no endpoint finds a core with none.

The default is an ipc socket in a private directory: $XDG_RUNTIME_DIR/llmserve/core.sock when that
variable names a directory, else <tmp>/llmserve-<uid>/core.sock. The directory must be owned by us and
mode 0700 (refused otherwise: another user could own or watch it); the socket file is made 0600.
"""
from __future__ import annotations

import ipaddress
import os
import stat
import tempfile

SOCKET_NAME = "core.sock"


def runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "llmserve")
    return os.path.join(tempfile.gettempdir(), f"llmserve-{os.getuid()}")


def default_endpoint() -> str:
    return "ipc://" + os.path.join(runtime_dir(), SOCKET_NAME)


def ensure_private_dir(path: str) -> None:
    """Create `path` 0700, or check an existing one is ours and not open to others."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path}: exists and is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path}: owned by uid {st.st_uid}, not by us ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def check_listen_endpoint(endpoint: str, allow_remote: bool = False) -> str:
    """Validate an endpoint the core will bind; returns it. tcp must name a loopback address unless
    allow_remote (the protocol has no authentication)."""
    if endpoint.startswith("ipc://"):
        if not ipc_path(endpoint):
            raise ValueError(f"listen: empty ipc path in {endpoint!r}")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen: expected tcp://HOST:PORT, got {endpoint!r}")
        if not allow_remote:
            try:
                loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ValueError(f"listen: {host} is not a loopback address; pass --allow-remote to expose "
                                 "the unauthenticated protocol beyond this host")
        return endpoint
    raise ValueError(f"listen: expected ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
