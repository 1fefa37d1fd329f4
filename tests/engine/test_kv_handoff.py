"""A sequence prefilled on one engine and decoded on another, its KV handed over as bytes in real
frames (:mod:`workers.engine.kv_transfer`), makes the tokens a colocated engine makes, on
SmolLM2-135M in float32, greedy: with a prefix hit on the decode side (the blocks it kept from an
earlier hand-off are not written again), a prompt of several chunks, and an answer whose first
token ends it (no hand-off); and seeded sampling, whose index carries over. Bytes that fail the
manifest break the protocol. The same over shared memory: equal tokens, a refused segment
unlinked, none left behind, and frames past the bound on the bytes in segments. A decode engine
tells the pool, after the step that follows a hand-off, what its import and that step took.
"""

from __future__ import annotations

import os

import msgspec
import pytest
from tokenizers import Tokenizer

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.kv_transfer import KvTransfer
from workers.engine.loop import EngineLoop, step_messages
from workers.kv_manifest import SHM_DIR, discard
from workers.protocol import (
    Add,
    FrameDecoder,
    KvBlocks,
    KvExported,
    KvHandoff,
    KvTaken,
    Message,
    ProtocolError,
    SequenceFinished,
    Tokens,
    encode,
)
from workers.sampling import Sampling

GREEDY = Sampling(max_tokens=12, ignore_eos=True)
SEEDED = Sampling(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=77, ignore_eos=True)
SHARED = ("You are a helpful assistant. You answer every question in one short sentence, plainly, "
          "without lists or headings, and you never repeat the question. Question: ")



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


def ferry_segments() -> list[str]:
    return sorted(path.name for path in SHM_DIR.glob("ferry-kv-*"))


def test_over_shared_memory_the_tokens_are_the_colocated_ones_and_no_segment_stays(
        smollm2, smollm2_runner, decode_runner):
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    prompts = [tokenizer.encode(SHARED + text).ids for text in ("Why is the sky blue?", "Name a river.")]
    expected = colocated(smollm2_runner, prompts, GREEDY)
    before = ferry_segments()
    pair = Disaggregated(smollm2_runner, decode_runner)
    pair.out.shm = True
    assert pair.run(prompts, GREEDY) == expected
    assert pair.moved == {}  # no kv frame: the manifests named segments
    assert ferry_segments() == before and pair.out.outstanding() == 0


def exported_to_shm(runner, rid: int, prompt: list[int]) -> tuple[KvExported, Add]:
    """``prompt`` prefilled on a shm prefill engine: its ``kv_exported`` and the ``add`` to send."""
    prefill = new_engine(runner)
    out = KvTransfer(prefill, runner, prefill=True, shm=True)
    prefill.add(prompt, GREEDY, rid=rid)
    frames: list[Message] = []
    while not frames:
        output = prefill.step()
        frames = out.exports(output)
    [exported] = frames
    assert isinstance(exported, KvExported) and exported.manifest.segment in ferry_segments()
    add = Add.of(rid, prompt, 0, "", GREEDY.replace(temperature=0.0), output_tokens=[output.tokens[rid]])
    return exported, add


def test_a_decode_engine_says_after_its_next_step_what_the_import_and_that_step_took(
        smollm2_runner, decode_runner):
    decode = new_engine(decode_runner)
    transfer = KvTransfer(decode, decode_runner, prefill=False)
    into = EngineLoop(decode, 0.0, transfer)
    exported, add = exported_to_shm(smollm2_runner, 5, list(range(1, 40)))
    into.take([KvHandoff(add, exported.manifest)])
    output = into.step()
    assert output is not None and 5 in output.tokens  # its first token here, in the step right after
    [taken] = transfer.exports(output)
    assert isinstance(taken, KvTaken) and taken.rid == 5 and taken.seconds > 0 and taken.stepped > 0
    assert transfer.exports(into.step()) == []  # said once


def test_a_shm_segment_that_fails_the_manifest_is_refused_and_unlinked(smollm2_runner, decode_runner):
    decode = new_engine(decode_runner)
    into = EngineLoop(decode, 0.0, KvTransfer(decode, decode_runner, prefill=False))
    exported, add = exported_to_shm(smollm2_runner, 8, list(range(1, 40)))
    path = SHM_DIR / exported.manifest.segment
    with open(path, "r+b") as segment:
        segment.seek(100)
        byte = segment.read(1)
        segment.seek(100)
        segment.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ProtocolError, match="digest"):
        into.take([KvHandoff(add, exported.manifest)])
    assert not path.exists()
    exported, add = exported_to_shm(smollm2_runner, 9, list(range(1, 40)))
    short = msgspec.structs.replace(exported.manifest, kv_tokens=exported.manifest.kv_tokens - 1)
    with pytest.raises(ProtocolError, match="expected KV of 39 tokens"):
        into.take([KvHandoff(add, short)])
    assert not (SHM_DIR / exported.manifest.segment).exists()
    elsewhere = msgspec.structs.replace(exported.manifest, segment="../etc/passwd")
    with pytest.raises(ProtocolError, match="not a hand-off segment"):
        into.take([KvHandoff(add, elsewhere)])


def test_past_its_bound_a_prefill_engine_sends_frames(smollm2_runner):
    prefill = new_engine(smollm2_runner)
    out = KvTransfer(prefill, smollm2_runner, prefill=True, shm=True)
    prompt = list(range(1, 16 * 40))  # 40 blocks of the runner's 64: a second one is past the bound
    kinds = []
    for rid in (1, 2):
        prefill.add(prompt, GREEDY, rid=rid)
        frames: list[Message] = []
        while not frames:
            frames = out.exports(prefill.step())
        exported = frames[-1]
        assert isinstance(exported, KvExported)
        kinds.append((exported.manifest.segment != "", len(frames) > 1))
    assert kinds == [(True, False), (False, True)]
    assert out.outstanding() == 40 * smollm2_runner.block_bytes
    discard(f"ferry-kv-{os.getpid()}-1")  # as the pool does with one no engine will take
    assert out.outstanding() == 0
