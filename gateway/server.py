"""Gateway process entry point: one uvicorn process serving ``create_app(settings)``.

With ``--reuse-port`` several such processes listen on one port (``tandem serve
--gateway-processes``): each is a whole gateway (its own output stream, admission
queue and event loop, the same Redis), the kernel deals connections among them.

Signals are the gateway's own, not uvicorn's (uvicorn would stop listening at once):
the first SIGTERM or SIGINT drains (``tandem.gateway.drain``: new requests get 503
while the open streams finish, for up to --shutdown-timeout-s), the second ends
the open streams at once with an error event and ``[DONE]``; then uvicorn exits.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

import structlog
import uvicorn

from tandem.cluster.process import configure_logging
from tandem.cluster.settings import Settings, add_arguments
from tandem.gateway.app import create_app
from tandem.gateway.errors import GatewayError, ShuttingDown

log = structlog.get_logger(__name__)

STOP_GRACE_S = 2.0  # after the second signal: for the streams' last events to go out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app, shutdown_timeout_s: float):
        super().__init__(config)
        self._app = app
        self._shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_signals = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """Runs in the signal handler: only schedules work on the loop (no locks taken here)."""
        self._num_signals += 1
        if self._loop is None or not self.started:
            self.should_exit = True  # still starting: nothing to drain
            return
        self._loop.call_soon_threadsafe(self._on_signal, self._num_signals)

    def _on_signal(self, count: int) -> None:
        service = self._app.state.service
        if count == 1:
            log.info("draining: new requests get 503", open_requests=service.drain.num_in_flight,
                     timeout_s=self._shutdown_timeout_s)
            service.drain.start()
            self._loop.create_task(self._exit_when_idle())
        else:
            log.warning("stopping now: ending the open streams", open_requests=service.drain.num_in_flight)
            service.drain.stop_now()
            service.mux.fail_all(ShuttingDown("the gateway stopped before the request finished"))
            self._loop.create_task(self._exit_when_idle(STOP_GRACE_S))

    async def _exit_when_idle(self, timeout_s: float | None = None) -> None:
        drain = self._app.state.service.drain
        idle = await drain.wait_idle(self._shutdown_timeout_s if timeout_s is None else timeout_s)
        if not idle and timeout_s is None:
            if drain.state.value == "stopping":
                return  # the second signal's own wait takes over
            log.warning("shutdown timeout: ending the open streams", open_requests=drain.num_in_flight)
            drain.stop_now()
            self._app.state.service.mux.fail_all(ShuttingDown("the gateway's shutdown timeout ended the request"))
            await drain.wait_idle(STOP_GRACE_S)
        self.should_exit = True


def main(settings: Settings) -> None:
    """Serve until told to stop (see the module's docstring)."""
    configure_logging(settings.log_level, "gateway", settings.log_format)
    app = create_app(settings)
    log.info("gateway starting", host=settings.host, port=settings.port, model=settings.model_name,
             max_seq_len=settings.max_seq_len, max_input_len=settings.max_input_len)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # uvicorn's own lines (its "Press CTRL+C" comes before the workers are ready) only when debugging
        log_level="debug" if settings.log_level.lower() == "debug" else "warning",
        access_log=False,  # one structured line per request comes from the gateway itself
        timeout_graceful_shutdown=5,
        backlog=4096,
    )
    try:  # before serving: a --lora-modules adapter that cannot be served ends the process in one line
        asyncio.run(app.state.service.adapters.check_startup_modules())
    except GatewayError as exc:
        raise SystemExit(f"tandem gateway: {exc.message}") from None
    server = DrainingServer(config, app, settings.shutdown_timeout_s)
    try:
        server.run(sockets=[shared_socket(settings.host, settings.port, config.backlog)] if settings.reuse_port
                   else None)
    except SystemExit:
        if app.state.startup_error:  # the app refused to start (e.g. an adapter name served from another path)
            raise SystemExit(f"tandem gateway: {app.state.startup_error}") from None
        raise


def shared_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on (host, port) that other processes may bind too (SO_REUSEPORT): the
    kernel spreads new connections over every gateway process listening there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.gateway.server", description="tandem OpenAI gateway")
    add_arguments(parser)
    main(Settings.from_args(parser.parse_args()))


if __name__ == "__main__":
    _cli()
