"""The llmserve-core daemon: the engine behind a ZMQ ROUTER socket (see proto/PROTOCOL.md)."""
from llmserve_core.server.daemon import DaemonConfig, prepare_endpoint, run_daemon, serve

__all__ = ["DaemonConfig", "prepare_endpoint", "run_daemon", "serve"]
