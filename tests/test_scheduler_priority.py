"""The scheduler's priority policy (vLLM's `priority`: lower runs first, then arrival): waiting order,
preemption of the lowest-ranked running sequence, a high-priority arrival taking the place of a
low-priority one in a full batch; fcfs unchanged; the engine refuses a priority under fcfs; and
through a live server the request field reaches the engine."""
from __future__ import annotations

import pytest

from deepinfer.engine import Engine, default_model_dir
from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, Status
from deepinfer.errors import ConfigError


def _seq(n, priority=0, rid=None):
    return Sequence(list(range(1, n + 1)), request_id=rid, priority=priority)


def _sched(policy, blocks=64, seqs=4):
    return Scheduler(BlockManager(blocks, 4, 64, enable_prefix_cache=False), seqs, 512, policy)


def _step(s: Scheduler) -> list:
    """One scheduled step, as the engine does it: computed tokens advance; decode rows get a token."""
    batch = s.schedule()
    for b in batch:
        b.seq.num_computed = b.start + b.num_tokens
        if b.samples:
            b.seq.append(7)
    return [b.seq for b in batch]


def test_waiting_is_ordered_by_priority_then_arrival():
    s = _sched("priority", seqs=1)
    a, b, c, d = _seq(3, 5, "a"), _seq(3, 1, "b"), _seq(3, 5, "c"), _seq(3, 0, "d")
    for q in (a, b, c, d):
        s.add(q)
    assert [q.request_id for q in s.waiting] == ["d", "b", "a", "c"]
    f = _sched("fcfs", seqs=1)
    for q in (a, b, c, d):
        f.add(q)
    assert [q.request_id for q in f.waiting] == ["a", "b", "c", "d"]


def test_a_high_priority_arrival_takes_a_full_batch_slot():
    s = _sched("priority", seqs=2)
    low1, low2 = _seq(3, 9, "low1"), _seq(3, 9, "low2")
    s.add(low1), s.add(low2)
    _step(s)
    assert s.running == [low1, low2]
    urgent = _seq(3, 0, "urgent")
    s.add(urgent)
    ran = _step(s)
    assert urgent in ran and urgent.status is Status.RUNNING
    assert low2.status is Status.WAITING and s.waiting[0] is low2     # the latest of the lowest went back
    assert s.num_preemptions == 1
    # fcfs: the newcomer waits
    f = _sched("fcfs", seqs=2)
    a, b = _seq(3, 9), _seq(3, 9)
    f.add(a), f.add(b)
    _step(f)
    c = _seq(3, 0)
    f.add(c)
    assert c not in _step(f) and f.num_preemptions == 0


def test_cache_pressure_preempts_the_lowest_priority():
    s = _sched("priority", blocks=4, seqs=4)        # 16 tokens of cache
    hi, lo = _seq(6, 0, "hi"), _seq(6, 5, "lo")
    s.add(lo), s.add(hi)
    _step(s)
    assert set(s.running) == {hi, lo}
    for _ in range(8):                                # decode until the cache runs out
        _step(s)
    assert hi.status is Status.RUNNING and lo.status is Status.WAITING


def test_the_engine_takes_priority_only_under_the_priority_policy():
    fcfs = Engine.from_pretrained(default_model_dir(), config={"backend": "reference", "max_batch": 1,
                                                               "precision": "f32", "max_seq_len": 64})
    with pytest.raises(ConfigError, match="scheduling_policy 'priority'"):
        fcfs.add_request("x", priority=1, max_new_tokens=1)
    eng = Engine.from_pretrained(default_model_dir(), config={"backend": "reference", "max_batch": 1,
                                                              "precision": "f32", "max_seq_len": 64,
                                                              "scheduling_policy": "priority"})
    late = eng.add_request("def f():", max_new_tokens=3, priority=5)
    eng.step()                                       # `late` is running
    first = eng.add_request("import os", max_new_tokens=3, priority=0)
    order = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order == [first, late]                    # the urgent one took the only slot and finished first
    with pytest.raises(ConfigError, match="scheduling_policy"):
        Engine.from_pretrained(default_model_dir(), config={"backend": "reference", "scheduling_policy": "sjf"})


def test_serve_takes_the_policy_on_the_command_line():
    from deepinfer.cli import _serve_overrides, build_parser

    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert _serve_overrides(args)["scheduling_policy"] == "priority"
    assert "scheduling_policy" not in _serve_overrides(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling-policy", "sjf"])
