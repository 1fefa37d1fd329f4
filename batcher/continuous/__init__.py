"""The continuous mode: the EnginePool, its replicas' tier queues and frames, the router
(least queued tokens, bounded prefix affinity), the token load admission reads, and the stream
of a job's tokens into events."""
