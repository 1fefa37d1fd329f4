"""Pure cores and the production scheduler under MockClock: no torch, no child process, no socket."""
