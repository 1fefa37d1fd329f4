"""torch and the engine's model, runner and sampler on tiny checkpoints or SmolLM2."""
