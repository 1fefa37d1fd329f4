"""Where worker processes run: local child processes over pipes, or Ray actors on a cluster
with the same frames over TCP. The pools see one worker interface whatever the placement."""
