"""Structured logging: one key=value line per event, with the service name."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> None:
    logging.basicConfig(
        level=os.environ.get("STEADYRL_LOG_LEVEL", "INFO"),
        format=f"ts=%(asctime)s level=%(levelname)s service={service} logger=%(name)s %(message)s",
    )
