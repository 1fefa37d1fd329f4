"""Mosec around examples/embeddings/minilm.py: ``python mosec_server.py PORT MODEL_DIR WORKERS
MAX_BATCH WAIT_MS``, run by the peer's own virtualenv (experiments/embeddings_bench.py)."""

import os
import pathlib
import sys

from mosec import Server, Worker

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embeddings"


class Embeddings(Worker):
    def __init__(self):
        super().__init__()
        sys.path.insert(0, str(EXAMPLES))
        from minilm import MiniLM  # in the worker process alone

        self.model = MiniLM(model_dir=os.environ["MINILM_DIR"], threads=1)  # workers re-run this module
        self.model.warmup()

    def forward(self, requests):
        vectors = self.model.run_batch([request["input"] for request in requests])
        return [{"embedding": vector.tolist()} for vector in vectors]


if __name__ == "__main__":
    port, os.environ["MINILM_DIR"], workers, max_batch, wait_ms = sys.argv[1:6]
    sys.argv = [sys.argv[0], "--port", port, "--address", "127.0.0.1"]  # mosec parses its own flags
    server = Server()
    server.append_worker(Embeddings, num=int(workers), max_batch_size=int(max_batch),
                         max_wait_time=int(wait_ms))
    server.run()
