"""Mosec around the reference worker: ``python mosec_server.py PORT WORKERS MAX_BATCH WAIT_MS``, run by
the peer's own virtualenv (experiments/fixed_bench.py). A call sleeps 200 ms at any batch size and
answers each input reversed, as ferry's ``sleep`` worker does."""

import sys
import time

from mosec import Server, Worker


class Reference(Worker):
    def forward(self, requests):
        time.sleep(0.2)
        return [{"output": request["input"][::-1]} for request in requests]


if __name__ == "__main__":
    port, workers, max_batch, wait_ms = sys.argv[1:5]
    sys.argv = [sys.argv[0], "--port", port, "--address", "127.0.0.1"]  # mosec parses its own flags
    server = Server()
    server.append_worker(Reference, num=int(workers), max_batch_size=int(max_batch),
                         max_wait_time=int(wait_ms))
    server.run()
