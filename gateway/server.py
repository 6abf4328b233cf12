"""Gateway process entry point: one uvicorn process serving ``create_app(settings)``."""

from __future__ import annotations

import argparse

import structlog
import uvicorn

from tandem.cluster.service import configure_logging
from tandem.cluster.settings import Settings, add_arguments
from tandem.gateway.app import create_app

log = structlog.get_logger(__name__)


def main(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and drains open requests)."""
    configure_logging(settings.log_level, "gateway")
    app = create_app(settings)
    log.info("gateway starting", host=settings.host, port=settings.port, model=settings.model_name,
             max_seq_len=settings.max_seq_len, max_input_len=settings.max_input_len)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,  # one structured line per request comes from the gateway itself
        timeout_graceful_shutdown=5,
        backlog=4096,
    )


def _cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.gateway.server", description="tandem OpenAI gateway")
    add_arguments(parser)
    main(Settings.from_args(parser.parse_args()))


if __name__ == "__main__":
    _cli()
