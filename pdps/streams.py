"""Producing records for streaming sources (see docs/online.md#streaming-sources).

:func:`append` writes numpy columns to a stream, one entry per record, in the
layout the streaming source of the same URL reads (``redis-stream://``, and its
in-process fake ``memory-stream://``). The work is the adapter's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pdps.core.errors import ConfigError
from pdps.registry import open_data_source

__all__ = ["append"]


def append(url: str, columns: Mapping[str, np.ndarray]) -> list[str]:
    """Append one entry per row of ``columns`` (name -> array, one row per record) to
    the stream at ``url``; return the entries' ids, in order.

    The first append stores the stream's schema (each column's dtype and per-record
    shape) next to it; an append whose columns disagree with it (or with the URL's
    ``schema=``) raises ConfigError before anything is written.
    """
    source = open_data_source(url)
    if not hasattr(source, "append"):
        raise ConfigError(f"{url} is not a stream pdps can append to; append to redis-stream:// or memory-stream://")
    try:
        return source.append(columns)
    finally:
        source.close()
