"""Real processes, real HTTP, threads on the real clock, redis-server and Ray."""
