"""A sequence prefilled on one engine and decoded on another, its KV handed over as bytes in real
frames (:mod:`workers.engine.kv_transfer`), makes the tokens a colocated engine makes, on
SmolLM2-135M in float32, greedy: with a prefix hit on the decode side (the blocks it kept from an
earlier hand-off are not written again), a prompt of several chunks, and an answer whose first
token ends it (no hand-off); and seeded sampling, whose index carries over. Bytes that fail the
manifest break the protocol.
"""

from __future__ import annotations

import msgspec
import pytest
from tokenizers import Tokenizer

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.kv_transfer import KvTransfer
from workers.engine.loop import EngineLoop, step_messages
from workers.engine.runner import ModelRunner
from workers.protocol import (
    Add,
    FrameDecoder,
    KvBlocks,
    KvExported,
    KvHandoff,
    Message,
    ProtocolError,
    Sampling,
    SequenceFinished,
    Tokens,
    encode,
)

GREEDY = Sampling(max_tokens=12, ignore_eos=True)
SEEDED = Sampling(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True)
SHARED = ("You are a helpful assistant. You answer every question in one short sentence, plainly, "
          "without lists or headings, and you never repeat the question. Question: ")


@pytest.fixture(scope="module")
def decode_runner(smollm2):
    """A second SmolLM2 in float32 with its own cache: the decode engine's."""
    return ModelRunner(smollm2, num_blocks=64)


def new_engine(runner) -> Engine:
    return Engine(runner, EngineConfig(block_size=runner.block_size, num_blocks=runner.num_blocks,
                                       max_batch_tokens=32, max_seqs=4, watermark=0.0))


def wire(messages: list[Message]) -> list[Message]:
    """``messages`` encoded and read back, as the pipe carries them."""
    return FrameDecoder().feed(b"".join(map(encode, messages)))


def colocated(runner, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
    """Each prompt's tokens from one engine that does it all, the prompts running together."""
    engine = new_engine(runner)
    made: list[list[int]] = [[] for _ in prompts]
    for rid, prompt in enumerate(prompts):
        engine.add(prompt, sampling, rid=rid)
    while engine.has_work:
        for rid, token in engine.step().tokens.items():
            made[rid].append(token)
    return made


class Disaggregated:
    """A prefill engine and a decode engine, and the pool's part between them: forward the
    ``kv`` frames, then a ``kv_handoff`` with the sequence's ``add``."""

    def __init__(self, prefill_runner, decode_runner) -> None:
        self.prefill = new_engine(prefill_runner)
        self.decode = new_engine(decode_runner)
        self.out = KvTransfer(self.prefill, prefill_runner, prefill=True)
        self.into = EngineLoop(self.decode, 0.0, KvTransfer(self.decode, decode_runner, prefill=False))
        self.prompts: dict[int, list[int]] = {}
        self.made: dict[int, list[int]] = {}
        self.moved: dict[int, int] = {}  # rid -> KV bytes handed over
        self.ended: dict[int, SequenceFinished] = {}

    def run(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Each prompt prefilled, then decoded elsewhere, one after the other."""
        for prompt in prompts:
            rid = len(self.prompts)
            self.prompts[rid], self.made[rid] = prompt, []
            self.prefill.add(prompt, sampling, rid=rid)
            while self.prefill.has_work:
                output = self.prefill.step()
                self._read(wire([*step_messages(output), *self.out.exports(output)]), sampling)
            while self.decode.has_work:
                self._read(wire(step_messages(self.decode.step())), sampling)
        return [self.made[rid] for rid in range(len(prompts))]

    def _read(self, messages: list[Message], sampling: Sampling) -> None:
        chunks: list[Message] = []
        for message in messages:
            if isinstance(message, Tokens):
                self.made[message.rid] += message.ids
            elif isinstance(message, SequenceFinished):
                self.ended[message.rid] = message
            elif isinstance(message, KvBlocks):
                chunks.append(message)
                self.moved[message.rid] = self.moved.get(message.rid, 0) + len(message.data)
            elif isinstance(message, KvExported):
                rid = message.rid
                named = sampling.replace(temperature=sampling.temperature or 0.0)  # as the pool sends it
                add = Add.of(rid, self.prompts[rid], 0, "", named, output_tokens=self.made[rid])
                self.into.take(wire([*chunks, KvHandoff(add, message.manifest)]))
                chunks = []


def test_handed_off_sequences_make_the_colocated_engines_tokens(smollm2, smollm2_runner, decode_runner):
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    long = " ".join(f"Item {i} is a red box on the shelf." for i in range(12))
    prompts = [tokenizer.encode(SHARED + text).ids for text in
               ("What is the capital of France?", "Why is the sky blue?", long)]
    expected = colocated(smollm2_runner, prompts, GREEDY)
    pair = Disaggregated(smollm2_runner, decode_runner)
    assert pair.run(prompts, GREEDY) == expected
    assert all(len(tokens) == 12 for tokens in expected)
    assert len(prompts[2]) > 100  # several 32-token chunks on the prefill engine
    block_bytes = decode_runner.block_bytes
    assert pair.moved == {rid: -(-len(prompt) // 16) * block_bytes for rid, prompt in enumerate(prompts)}
    stats = pair.decode.stats()
    common = next(i for i, ids in enumerate(zip(*prompts, strict=False)) if len(set(ids)) > 1)
    shared = common // 16 * 16  # the tokens of the full blocks every prompt begins with
    assert shared >= 16 and stats.prefix_hits == 2 * shared  # the 2nd and 3rd found the 1st's there
    assert stats.free_blocks == stats.total_blocks  # every block given back
    assert [pair.ended[rid].usage.output_tokens for rid in range(3)] == [12, 12, 12]


def test_a_seeded_sequence_handed_off_samples_what_it_would_have(smollm2_runner, decode_runner):
    prompt = list(range(100, 140))
    expected = colocated(smollm2_runner, [prompt], SEEDED)
    assert Disaggregated(smollm2_runner, decode_runner).run([prompt], SEEDED) == expected
    assert expected != colocated(smollm2_runner, [prompt], SEEDED.replace(seed=78))  # the seed carries it


def test_an_answer_ended_by_its_first_token_is_not_handed_off(smollm2_runner, decode_runner):
    pair = Disaggregated(smollm2_runner, decode_runner)
    assert pair.run([[1, 2, 3, 4, 5]], Sampling(max_tokens=1)) == colocated(
        smollm2_runner, [[1, 2, 3, 4, 5]], Sampling(max_tokens=1))
    assert pair.moved == {} and pair.ended[0].reason == "max_tokens"
    assert not pair.prefill.has_work and not pair.decode.has_work


def test_kv_bytes_that_fail_the_manifest_break_the_protocol(smollm2_runner, decode_runner):
    prefill = new_engine(smollm2_runner)
    out = KvTransfer(prefill, smollm2_runner, prefill=True)
    prefill.add(list(range(1, 40)), GREEDY, rid=7)
    frames: list[Message] = []
    while not frames:
        output = prefill.step()
        frames = out.exports(output)
        first = output.tokens.get(7)
    chunks, exported = frames[:-1], frames[-1]
    assert isinstance(exported, KvExported) and first is not None
    add = Add.of(7, list(range(1, 40)), 0, "", GREEDY.replace(temperature=0.0), output_tokens=[first])
    bad = bytearray(chunks[0].data)  # type: ignore[attr-defined]
    bad[100] ^= 1
    decode = new_engine(decode_runner)
    into = EngineLoop(decode, 0.0, KvTransfer(decode, decode_runner, prefill=False))
    with pytest.raises(ProtocolError, match="digest"):
        into.take([KvBlocks(7, bytes(bad)), *chunks[1:], KvHandoff(add, exported.manifest)])
    short = msgspec.structs.replace(exported.manifest, kv_tokens=exported.manifest.kv_tokens - 1)
    with pytest.raises(ProtocolError, match="expected KV of 39 tokens"):
        into.take([*chunks, KvHandoff(add, short)])
