"""The peers of experiments/embeddings_bench.py: LitServe and Mosec servers around the same model code
(examples/embeddings/minilm.py), each run by its own virtualenv's Python (never imported by ferry)."""
