"""LitServe around examples/embeddings/minilm.py: ``python litserve_server.py PORT MODEL_DIR WORKERS
MAX_BATCH WAIT_MS``, run by the peer's own virtualenv (experiments/embeddings_bench.py)."""

import pathlib
import sys

import litserve as ls

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embeddings"


class Embeddings(ls.LitAPI):
    def setup(self, device):
        sys.path.insert(0, str(EXAMPLES))
        from minilm import MiniLM  # in the inference worker alone, as ferry's workers import it

        self.model = MiniLM(model_dir=sys.argv[2], threads=1)
        self.model.warmup()

    def decode_request(self, request):
        return request["input"]

    def predict(self, texts):
        return self.model.run_batch(list(texts))

    def unbatch(self, output):
        return list(output)

    def encode_response(self, vector):
        return {"embedding": vector.tolist()}


if __name__ == "__main__":
    port, _, workers, max_batch, wait_ms = sys.argv[1:6]
    api = Embeddings(max_batch_size=int(max_batch), batch_timeout=float(wait_ms) / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=int(workers))
    server.run(port=int(port), host="127.0.0.1", generate_client_file=False)
