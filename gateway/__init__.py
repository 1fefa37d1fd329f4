"""ferry's front door: the command line now, the HTTP gateway next (aiohttp, never trio)."""
