"""Where ``kivi serve`` listens and how it stops: a socket bound before the model loads, uvicorn on it,
and a shutdown on Ctrl-C / SIGTERM that ends every open request with an error of its own.

Shutdown: the first signal stops new connections and requests (503); open requests get
``grace_s`` seconds to finish, then each is ended: a stream with an OpenAI error event
(``server_shutting_down``) and ``[DONE]``, a non-streamed request with a 503. A second signal ends
them at once. :func:`serve_until_signal` then returns the signal, so the command can exit with
128 + its number and one line. uvicorn re-raises the signal once it has stopped (for a plain
``python -m uvicorn``); here the command's own handlers stay in place while it runs and take that
re-raise, so a Ctrl-C cannot escape as a traceback from inside uvicorn or asyncio.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

from .engine import Engine

SHUTDOWN_MESSAGE = "the server is shutting down"
#: how long uvicorn waits, past the grace period, for connections to close before it cancels them
_BACKSTOP_S = 5.0


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to ``host:port`` and listening (``OSError`` when the address is taken): bound
    before the model loads, so a second server on the same port fails at once, before it prints anything."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a port in TIME_WAIT
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_until_signal(app: Any, engine: Engine, sock: socket.socket, *, grace_s: float,
                       log_level: str = "warning") -> int | None:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM; the signal that stopped it (``None``: it stopped
    on its own). See the module docstring for what happens to open requests."""
    import uvicorn

    class _Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        signals: list[int] = []

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:  # a signal handler, on the loop's thread
            self.signals = [*self.signals, sig]
            super().handle_exit(sig, frame)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(_drain, self.loop, engine, grace_s if len(self.signals) == 1 else 0.0)

    # lifespan "off": the app has no startup / shutdown hooks, and a task waiting for the shutdown event
    # is one more thing to cancel (with a logged traceback) when a second Ctrl-C cuts the shutdown short
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s + _BACKSTOP_S, lifespan="off")
    server = _Server(config)
    previous = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return server.signals[0] if server.signals else None


def _ignore(_sig: int, _frame: Any) -> None:
    """Takes uvicorn's re-raise of the signal it handled (see the module docstring)."""


def _drain(loop: asyncio.AbstractEventLoop, engine: Engine, grace_s: float) -> None:
    engine.close(SHUTDOWN_MESSAGE)
    abort = lambda: engine.abort_open_requests(SHUTDOWN_MESSAGE)  # noqa: E731
    if grace_s > 0:
        loop.call_later(grace_s, abort)
    else:
        abort()
