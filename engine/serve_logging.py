"""tandem's loggers inside a Ray Serve replica: into the replica's own log, next to Serve's lines.

Serve configures only the "ray.serve" logger in a replica; without this, tandem's INFO lines
(one per finished request, worker lifecycle) would be dropped.
"""

from __future__ import annotations

import logging


def use_serve_log_handlers(level: str | int = logging.INFO) -> None:
    serve_logger = logging.getLogger("ray.serve")
    tandem_logger = logging.getLogger("tandem")
    tandem_logger.setLevel(level)
    for handler in serve_logger.handlers:
        if handler not in tandem_logger.handlers:
            tandem_logger.addHandler(handler)
    tandem_logger.propagate = False
