"""The serving engine: block manager (reference counts, prefix cache), scheduler (continuous
admission, chunked prefill, preemption by recompute), add_request / step / abort, bucketed plans.
Every behaviour is checked against the same prompts run one at a time."""
from __future__ import annotations

import random

import pytest

import deepinfer
from deepinfer.engine import BlockManager, Engine, Sequence, bucket, default_model_dir
from deepinfer.engine.llm_engine import QueueFullError
from deepinfer.errors import ConfigError

MODEL = default_model_dir()
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):",
           "for i in range(10):", "with open(path) as f:\n", "x = [1, 2, 3]\ny ="]


def _backend():
    return "cpu" if [c for c in deepinfer.candidates() if c.ok and c.name == "cpu"] else "reference"


def _engine(**cfg):
    base = {"backend": _backend(), "precision": "f32", "max_batch": 4, "max_seq_len": 256}
    base.update(cfg)
    return Engine.from_pretrained(MODEL, config=base)


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy ids of each prompt, generated with nothing else in the engine and no prefix cache hits."""
    e = _engine(enable_prefix_cache=False)
    return {p: e.generate_ids([e.tokenizer.encode(p)], max_new_tokens=12)[0] for p in PROMPTS}


def _drain(engine, rids, got=None):
    got = got if got is not None else {}
    reasons = {}
    for r in rids:
        got.setdefault(r, [])
    while any(r not in reasons for r in rids):
        assert engine.has_unfinished(), f"requests {set(rids) - set(reasons)} never finished"
        _step(engine, got, reasons)
    return got, reasons


def _step(engine, got, reasons=None):
    for o in engine.step():
        got.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished and reasons is not None:
            reasons[o.request_id] = o.finish_reason


# ---------------------------------------------------------------------- block manager
def test_block_manager_shares_full_prefix_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4, max_blocks_per_seq=8)
    a = Sequence(list(range(10)))                  # 2 full blocks + 2 tokens
    assert bm.allocate(a) == 0
    bm.grow(a, 10)
    a.num_computed = 10
    bm.commit(a)
    assert len(a.block_hashes) == 2 and bm.num_used_blocks == 3
    b = Sequence(list(range(8)) + [99, 98, 97])    # the same first 2 blocks
    assert bm.allocate(b) == 8 and b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref == 2
    c = Sequence(list(range(8)))                   # exactly 2 blocks: the last one is recomputed
    assert bm.allocate(c) == 4
    bm.release(a)
    bm.release(a)                                  # idempotent
    bm.release(b)
    bm.release(c)
    assert bm.num_used_blocks == 0
    d = Sequence(list(range(9)))                   # freed blocks keep their contents: still a hit
    assert bm.allocate(d) == 8
    bm.release(d)


def test_block_manager_reuses_unhashed_blocks_first_and_forgets_overwritten_hashes():
    bm = BlockManager(num_blocks=3, block_size=2, max_blocks_per_seq=3)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    bm.grow(a, 3)
    a.num_computed = 3
    bm.commit(a)                                   # block of [1, 2] is hashed
    bm.release(a)
    x = Sequence([7, 7, 7, 7, 7, 7])
    bm.allocate(x)
    bm.grow(x, 6)                                  # takes every block, the hashed one last
    assert bm.num_free_blocks == 0
    bm.release(x)
    assert bm.allocate(Sequence([1, 2, 3])) == 0   # its old contents were overwritten: no false hit


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 25, 33, 100, 129, 513)] == [1, 2, 4, 8, 16, 24, 32, 48, 112, 192,
                                                                              768]


# ---------------------------------------------------------------------- scheduling
def test_requests_arriving_while_others_decode_equal_one_at_a_time(engine, alone):
    e = engine
    got = {}
    rids = [e.add_request(PROMPTS[0], max_new_tokens=12)]
    for _ in range(3):
        _step(e, got)
    rids += [e.add_request(p, max_new_tokens=12) for p in PROMPTS[1:3]]
    for _ in range(2):
        _step(e, got)
    rids += [e.add_request(p, max_new_tokens=12) for p in PROMPTS[3:]]     # 6 requests, max_batch 4: some wait
    got, reasons = _drain(e, rids, got)
    assert [got[r] for r in rids] == [alone[p] for p in PROMPTS]
    assert set(reasons.values()) <= {"length", "stop"}
    assert e.block_manager.num_used_blocks == 0 and not e.scheduler.has_work()


def test_chunked_prefill_equals_one_pass(alone):
    e = _engine(max_num_batched_tokens=8, enable_prefix_cache=False)
    long = PROMPTS[2] * 3
    ids = e.tokenizer.encode(long)
    assert len(ids) > 8
    ref = _engine(enable_prefix_cache=False).generate_ids([ids], max_new_tokens=12)[0]
    assert e.generate_ids([ids], max_new_tokens=12)[0] == ref
    assert e.generate_ids([e.tokenizer.encode(p) for p in PROMPTS], max_new_tokens=12) == [alone[p] for p in PROMPTS]


def test_preemption_recomputes_and_loses_nothing(alone):
    # 6 blocks of 16 tokens: four sequences growing to ~20 tokens each cannot all stay
    e = _engine(kv_cache_tokens=96, kv_block_size=16, max_seq_len=96)
    out = e.generate_ids([e.tokenizer.encode(p) for p in PROMPTS], max_new_tokens=12)
    assert out == [alone[p] for p in PROMPTS]
    assert e.scheduler.num_preemptions > 0
    assert e.block_manager.num_used_blocks == 0


def test_prefix_cache_prefills_a_shared_prompt_once(alone):
    e = _engine(kv_block_size=4)
    system = "# a helper module for parsing configuration files\nimport json\nimport os\n\n"
    first = e.generate(system + PROMPTS[0], max_new_tokens=8)
    computed = e.stats()["computed_prompt_tokens"]
    second = e.generate(system + PROMPTS[0], max_new_tokens=8)
    n = len(e.tokenizer.encode(system + PROMPTS[0]))
    assert second == first
    assert e.stats()["computed_prompt_tokens"] - computed < n // 2          # most of it came from the cache
    assert e.block_manager.prefix_hits >= n // 2
    other = e.generate(system + PROMPTS[1], max_new_tokens=12)            # shares the system prompt only
    assert other == e.tokenizer.decode(alone[PROMPTS[1]]) or other == _engine(enable_prefix_cache=False).generate(
        system + PROMPTS[1], max_new_tokens=12)


def test_abort_frees_blocks_at_once(engine):
    e = engine
    rid = e.add_request(PROMPTS[2], max_new_tokens=40)
    e.step()
    e.step()
    assert e.block_manager.num_used_blocks > 0
    assert e.abort(rid) and not e.abort(rid)
    assert e.block_manager.num_used_blocks == 0 and not e.scheduler.has_work()


def _choices(engine, rid, n):
    per = {i: [] for i in range(n)}
    done = set()
    while len(done) < n:
        assert engine.has_unfinished()
        for o in engine.step():
            if o.request_id == rid:
                per[o.index] += o.token_ids
                if o.finished:
                    done.add(o.index)
    return [per[i] for i in range(n)]


def test_n_choices_and_seeded_sampling_do_not_depend_on_the_batch(engine):
    e = engine
    opts = dict(max_new_tokens=10, temperature=1.0, seed=5)
    alone = _choices(e, e.add_request(PROMPTS[0], n=3, **opts), 3)
    assert len({tuple(c) for c in alone}) > 1                             # the choices differ
    others = [e.add_request(p, max_new_tokens=10, temperature=0.8, seed=1) for p in PROMPTS[1:4]]
    e.step()
    busy = _choices(e, e.add_request(PROMPTS[0], n=3, **opts), 3)
    assert busy == alone
    while e.has_unfinished():
        e.step()
    assert e.block_manager.num_used_blocks == 0 and others


def test_max_tokens_zero_and_bad_requests(engine):
    e = engine
    rid = e.add_request("x", max_new_tokens=0)
    outs = e.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.token_ids) for o in outs] == [(rid, True, "length", [])]
    with pytest.raises(ConfigError, match="max_seq_len"):
        e.add_request("x", max_new_tokens=10_000)
    with pytest.raises(ConfigError, match="vocabulary"):
        e.add_request([10 ** 9], max_new_tokens=1)
    with pytest.raises(ConfigError, match="n must be"):
        e.add_request("x", n=0)


def test_queue_bound():
    e = _engine(max_queue=2)
    e.add_request("a", max_new_tokens=1)
    e.add_request("b", max_new_tokens=1)
    with pytest.raises(QueueFullError, match="max_queue"):
        e.add_request("c", max_new_tokens=1)


def test_plans_settle_on_buckets(engine):
    """Random arrivals, prompt and output lengths: the plan count stops growing (no retrace in
    steady state)."""
    e, rng = engine, random.Random(0)

    def wave(k):
        rids, got, reasons = [], {}, {}
        for _ in range(k):
            p = "".join(rng.choice(PROMPTS)[: rng.randint(3, 30)] for _ in range(rng.randint(1, 3)))
            rids.append(e.add_request(p, max_new_tokens=rng.randint(1, 10)))
            if rng.random() < 0.5:
                _step(e, got, reasons)
        while e.has_unfinished():
            _step(e, got, reasons)
        assert set(reasons) == set(rids) and e.block_manager.num_used_blocks == 0

    wave(40)
    n = len(e.runner.plans)
    wave(40)
    assert len(e.runner.plans) <= n + 2 and n <= 24
