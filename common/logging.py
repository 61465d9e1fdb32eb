"""One logging setup for every Tandem process: timestamped lines on stderr."""
from __future__ import annotations

import logging

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """A logger under the `tandem` hierarchy; attaches a stderr handler once per process."""
    global _configured
    if not _configured:
        root = logging.getLogger("tandem")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
        _configured = True
    return logging.getLogger(name if name.startswith("tandem") else f"tandem.{name}")
