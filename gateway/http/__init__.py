"""The HTTP server: aiohttp routes and the request path, the server's life cycle, connection
limits, the event loop, log hygiene and the metrics registry."""
