"""What both serving modes share: the Backend protocol and its events, tier queues, overload
admission, supervision of worker processes, the fleet of open backends, the registry of modes,
the core's configuration and metrics."""
