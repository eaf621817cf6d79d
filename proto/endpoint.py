"""Where the core listens by default, shared so a client with no endpoint finds a core with none.

The default is an ipc socket in a private directory: $XDG_RUNTIME_DIR/llmserve/core.sock when that
variable names a directory, else <tmp>/llmserve-<uid>/core.sock. The directory must be owned by us and
mode 0700 (refused otherwise: another user could own or watch it); the socket file is made 0600.
"""
from __future__ import annotations

import ipaddress
import os
import re
import stat
import tempfile

SOCKET_NAME = "core.sock"
IPC_PATH_MAX_BYTES = 107        # sizeof(sockaddr_un.sun_path) - 1 on Linux

_TCP = re.compile(r"tcp://(?:\[(?P<v6>[^\[\]]+)\]|(?P<host>[^\[\]:/]+)):(?P<port>\d{1,5})")


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


def is_ipv6_endpoint(endpoint: str) -> bool:
    m = _TCP.fullmatch(endpoint)
    return m is not None and m.group("v6") is not None


def check_listen_endpoint(endpoint: str, allow_remote: bool = False) -> str:
    """Validate an endpoint the core will bind; returns it. tcp must name a loopback address unless
    allow_remote (the protocol has no authentication); an IPv6 address goes in brackets."""
    if endpoint.startswith("ipc://"):
        path = ipc_path(endpoint)
        if not path:
            raise ValueError(f"listen: empty ipc path in {endpoint!r}")
        n = len(os.fsencode(path))
        if n > IPC_PATH_MAX_BYTES:
            raise ValueError(f"listen: the ipc path is {n} bytes long; Unix sockets allow at most "
                             f"{IPC_PATH_MAX_BYTES}: choose a shorter path")
        return endpoint
    if endpoint.startswith("tcp://"):
        m = _TCP.fullmatch(endpoint)
        if m is None or not 0 < int(m.group("port")) < 65536:
            raise ValueError(f"listen: expected tcp://HOST:PORT or tcp://[IPV6]:PORT with a port in 1..65535, "
                             f"got {endpoint!r}")
        host = m.group("v6") or m.group("host")
        if m.group("v6") is not None:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"listen: {host!r} in brackets is not an IPv6 address") from None
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
