"""The engine's CPU tuning, apart from its core: the decode-attention kernel for AVX-512,
weights prepacked for oneDNN, kept decode contexts, and the heap thresholds of an engine process."""
