"""ferry's version: the installed distribution's (``ferry --version``, the OIP's server metadata)."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "trio-ferry"


def version() -> str:
    """The version pip installed (editable installs included); ``unknown`` from a bare checkout."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
