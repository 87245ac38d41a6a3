"""Execution plans and the paged KV cache: a cached decode step allocates nothing, the arena is
smaller than the sum of all activations, plans are cached by batch shape, blocks are recycled."""
from __future__ import annotations

import numpy as np
import pytest

import deepinfer
from deepinfer.engine import ModelRunner, RunnerConfig
from deepinfer.errors import CacheFullError
from deepinfer.model.plan import SymBuf, Tracer, place
from deepinfer.tensor import Tensor

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture
def v3_model(tiny_checkpoint):
    path, _, _ = tiny_checkpoint("v3")
    return ModelRunner(path, deepinfer.get_backend("reference"),
                       RunnerConfig(max_batch=4, max_seq_len=64, block_size=4))


def test_decode_step_allocates_nothing(v3_model, monkeypatch):
    m = v3_model
    m.forward([0, 1], [[1, 2, 3], [4, 5]], [0, 0])
    m.sample(m.forward([0, 1], [[6], [7]], [3, 2]), temperature=[0.0, 0.0])   # traces and binds the B=2 plan
    calls = []
    orig_backend_empty, orig_tensor_empty = m.backend.empty, Tensor.empty.__func__
    monkeypatch.setattr(m.backend, "empty", lambda *a, **k: calls.append(a) or orig_backend_empty(*a, **k))
    monkeypatch.setattr(Tensor, "empty", classmethod(lambda cls, *a, **k: calls.append(a) or
                                                     orig_tensor_empty(cls, *a, **k)))
    n_plans = len(m.plans)
    for i in range(5):
        logits = m.forward([0, 1], [[8 + i], [9 + i]], [4 + i, 3 + i])
        m.sample(logits, temperature=[0.0, 0.0])
    assert calls == [] and len(m.plans) == n_plans


def test_arena_recycles_activations(v3_model):
    m = v3_model
    m.forward([(0, list(range(20, 36)), 0)])
    p = m.plans[("main", "prefill", 16, 1, False, False, False)]
    assert 0 < p.arena_bytes < p.total_activation_bytes / 3
    # placed buffers that are live at the same time never overlap
    acts = [s for s in p.syms if s.kind == "act" and s.first >= 0]
    for a in acts:
        for b in acts:
            if a.id < b.id and a.first <= b.last and b.first <= a.last:
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    report = m.memory_report()
    assert report["arena_bytes"] >= p.arena_bytes


def test_plans_cached_by_batch_shape(v3_model):
    m = v3_model
    m.forward([0, 1, 2], [[1], [2], [3]], [0, 0, 0])
    keys = set(m.plans)
    m.forward([0, 1, 2], [[4], [5], [6]], [1, 1, 1])
    m.forward([0, 1, 2], [[7], [8], [9]], [2, 2, 2])
    assert len(m.plans) == len(keys) + 1          # one decode plan for B=3, reused
    m.forward([0, 1], [[1], [2]], [3, 3])
    assert ("main", "decode", 2, 2, False, False, False) in m.plans


def test_kv_blocks_are_recycled_and_bounded(tiny_checkpoint):
    path, _, _ = tiny_checkpoint("v2lite")
    m = ModelRunner(path, deepinfer.get_backend("reference"),
                    RunnerConfig(max_batch=2, max_seq_len=16, block_size=4, num_cache_blocks=5))
    m.forward([(0, list(range(1, 13)), 0)])        # 3 blocks
    assert m.block_manager.num_free_blocks == 2
    with pytest.raises(CacheFullError, match="KV cache full"):
        m.forward([(1, list(range(1, 13)), 0)])
    m.free(0)
    m.free(0)                                       # freeing twice is harmless
    assert m.block_manager.num_free_blocks == 5
    m.forward([(1, list(range(1, 13)), 0)])
    with pytest.raises(CacheFullError, match="max_seq_len"):
        m.forward([(1, list(range(5)), 12)])


def test_bad_batches_are_rejected(v3_model):
    m = v3_model
    with pytest.raises(ValueError, match="vocabulary"):
        m.forward([(0, [1, 999], 0)])
    with pytest.raises(ValueError, match="cached"):
        m.forward([(0, [1], 5)])
    with pytest.raises(ValueError, match="max_batch"):
        m.forward([(i, [1], 0) for i in range(5)])
    with pytest.raises(ValueError, match="twice"):
        m.forward([(0, [1], 0), (0, [2], 0)])


def test_planner_detects_read_before_write():
    tr = Tracer(None)
    a = tr.empty((4, 4), "f32")
    b = tr.empty((4, 4), "f32")
    with pytest.raises(RuntimeError, match="before any op wrote it"):
        tr.add(a=a, b=a, out=b)


def test_place_first_fit():
    syms = [SymBuf(i, n, "act", "x") for i, n in enumerate([1000, 1000, 1000, 500])]
    for s, (f, l) in zip(syms, [(0, 1), (1, 2), (2, 3), (3, 4)]):
        s.first, s.last = f, l
    size = place(syms, 5)
    assert syms[2].offset == syms[0].offset      # 0 died before 2 was born
    assert size == 2 * 1024


def test_speculative_rollback(v3_model, tiny_checkpoint):
    """Re-running positions already cached (a rejected draft) overwrites them."""
    _, hf, _ = tiny_checkpoint("v3")
    import torch

    m = v3_model
    ids = [3, 4, 5, 6, 7]
    m.forward([(0, ids[:3], 0)])
    m.forward([(0, [99, 98], 3)])                   # a draft that gets rejected
    got = m.backend.to_numpy(m.forward([(0, ids[3:], 3)], all_logits=True))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, 3:].numpy()
    assert np.abs(got - ref).max() < 1e-4 * max(1, np.abs(ref).max())


def test_score_chunks_match_one_pass(v3_model):
    ids = list(range(30, 50))
    one = v3_model.score(ids, chunk=64)
    chunked = v3_model.score(ids, chunk=6)          # prefill 6, then chunks of 6 through the cache
    assert one.shape == (20, 256)
    assert np.abs(one - chunked).max() < 1e-4 * max(1, np.abs(one).max())
    assert v3_model.block_manager.num_free_blocks == v3_model.block_manager.num_blocks


def test_a_new_batch_shape_marshals_no_weight_descriptor_again(tiny_checkpoint, cpu_backend):
    """Each tensor's C descriptor is filled once for its life (ABI 1.1 work): a plan for a new batch
    shape fills only its own activation and input views, never a weight or an expert array again."""
    path, _, _ = tiny_checkpoint("v3")
    be = cpu_backend
    m = ModelRunner(path, be, RunnerConfig(max_batch=4, max_seq_len=64, block_size=4))
    filled: list = []
    real = be._fill_new
    be._fill_new = lambda c, t, keep, what: filled.append(t) or real(c, t, keep, what)
    try:
        def prepare(T):
            filled.clear()
            p = m.plan("main", "decode", T, T)
            for op, kw in p.bound:
                be.prepare(op, **kw)
            return list(filled)

        first, second = prepare(1), prepare(3)
        weights = {id(t) for t in first} - {id(t) for t in second}
        assert weights, "the first plan filled no weight descriptor"
        assert not {id(t) for t in first} & {id(t) for t in second}, "a tensor was marshalled twice"
        # what the second plan filled lives in the plan's arena or input store, not in a weight
        stores = {id(m.arena.tensor.buffer)} | {id(getattr(p, "_input_store").buffer) for p in m.plans.values()}
        assert all(id(t.buffer) in stores for t in second if t.buffer is not None and not t.quant), second[:3]
    finally:
        be._fill_new = real


def _graph_backend():
    """The reference backend with a pretend graph capture: capture() records the prepared calls and
    the graph's launch replays them, so the runner's capture logic (when it captures, that replays
    read each step's fresh inputs) is checked without a GPU."""
    from deepinfer.reference import ReferenceBackend

    class Replay:
        def __init__(self, calls):
            self.calls, self.launches = list(calls), 0

        def launch(self):
            self.launches += 1
            for c in self.calls:
                c()

    class GraphReference(ReferenceBackend):
        supports_graphs = True

        def __init__(self):
            super().__init__()
            self.captured = []

        def capture(self, calls):
            self.captured.append(Replay(calls))
            return self.captured[-1]

    return GraphReference()


def test_decode_plans_are_captured_and_replayed(tiny_checkpoint):
    graph_backend = _graph_backend()
    path, _, _ = tiny_checkpoint("v3")
    eager = ModelRunner(path, deepinfer.get_backend("reference"),
                        RunnerConfig(max_batch=4, max_seq_len=64, block_size=4, enforce_eager=True))
    graphed = ModelRunner(path, graph_backend, RunnerConfig(max_batch=4, max_seq_len=64, block_size=4))
    assert graphed.use_graphs and not eager.use_graphs
    rng = np.random.default_rng(0)
    # a changing batch in the same bucket (3 and 4 sequences share bucket 4), then a smaller one
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 3, 7, 4)]
    steps = [[0, 1, 2], [0, 1, 2, 3], [1, 3], [0, 1, 2, 3], [2]]
    for m in (eager, graphed):
        for i, p in enumerate(prompts):
            m.forward([i], [p], [0])
    pos = [len(p) for p in prompts]
    for k, seqs in enumerate(steps):
        toks = [[int(rng.integers(0, 200))] for _ in seqs]
        starts = [pos[s] for s in seqs]
        a = eager.backend.to_numpy(eager.forward(seqs, toks, starts))
        b = graphed.backend.to_numpy(graphed.forward(seqs, toks, starts))
        np.testing.assert_array_equal(a, b)
        for s in seqs:
            pos[s] += 1
    decode = [p for k, p in graphed.plans.items() if k.mode == "decode"]
    prefill = [p for k, p in graphed.plans.items() if k.mode == "prefill"]
    assert decode and all(p.graph is not None for p in decode if p.runs > 1)
    assert all(p.graph is None for p in prefill)
    assert sum(g.launches for g in graph_backend.captured) >= 2
    assert not any(p.graph is not None for p in eager.plans.values())
