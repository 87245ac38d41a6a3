"""MTP speculative decoding with confidence-scheduled, variable-length verification.

The engine's `speculative` config: {"method": "mtp", "num_draft": K, "confidence": "auto" | p}
(parsed by deepinfer.config.SpecConfig). This module drafts and verifies; the scheduler that chooses how
many drafts to verify, and its tables, are engine.spec_schedule. The Speculator talks to the
engine through SpecEngine (below) and to the runner through its public step API and its stores
(engine.spec_store); a sequence's drafts are fields of engine.sequence.Sequence.

How a step goes (Speculator.decode_step; the traced step is DeepseekGraph.verify_and_draft):

- Drafting. DeepSeek's MTP module predicts the token after next from the main model's hidden
  state at a position and the next token. Each sequence's first draft comes out of the step that
  verified its previous drafts (the MTP runs on the verified rows in the same plan, its next
  tokens being spec_verify's outputs); drafts 2..K apply the module to its own output (a
  "draft" plan per depth, as SGLang's NextN steps). The MTP layer has its own KV cache layer in
  the same blocks as the main model's, written at every position the main model verifies, so it
  stays consistent with the main model's cache.
- Verification. One batched forward over every sequence's last token and its admitted drafts
  (variable counts per sequence); spec_verify (ABI 1.2) judges each row: greedy rows accept the
  longest prefix that matches the target argmax, sampled rows do exact rejection sampling from
  draft and target probabilities, so the output distribution is the non-speculative one.
  Rejected positions are rolled back by moving the sequence's length: the next step writes them
  (main and MTP layer) before anything reads them, and the prefix cache registers only blocks of
  accepted positions.
- Confidence scheduling (after DeepSeek's DSpark). Each draft has a confidence: its draft
  probability, calibrated per position from the acceptance measured so far (`Calibration`). The
  product over a sequence's drafts is the probability the prefix survives. Each step ranks every
  (sequence, draft position) candidate of the batch by that and admits them while the expected
  throughput -- (sequences + expected accepted drafts) / step time at that verify size, from a
  table of step times profiled at start-up and refined by every step (`StepCosts`), plus the
  recursive drafting a speculative step brings -- keeps the best value; if a plain decode step
  (no MTP at all) is expected to be faster, the step runs plain, so speculation does not cost
  throughput where it cannot pay (high load, or hardware where verifying k tokens costs k times
  one). After plain steps the scheduler asks again at growing intervals (doubling to 64 steps),
  judging sequences without drafts by the recent calibrated acceptance of proposed drafts; while
  it keeps choosing plain, prefills skip the MTP layer. A fixed confidence threshold p admits the
  drafts whose survival probability is at least p (0: every draft, a fixed K).

A sequence that decoded plainly for some steps (the scheduler backed off) misses the MTP cache
entries of those positions; its drafts resume with that gap (lossless; the calibration absorbs a
lower acceptance). Blocks reused from the prefix cache hold the MTP entries their first owner
wrote; the one at a block's last position saw that owner's next token. Seeded sampling stays
lossless but, with speculation on, a seed's text depends on which drafts were verified.
"""
from __future__ import annotations

import time
from typing import Optional, Protocol

import numpy as np

from .block_manager import BlockManager
from .model_runner import ModelRunner
from .plan_key import bucket
from .sampling import step_seed
from .scheduler import Scheduler
from .sequence import Sequence
from ..config import SpecConfig
from .spec_schedule import Calibration, StepCosts, admit, survival

__all__ = ["SpecEngine", "SpecStats", "Speculator"]

DRAFT_SALT = 0x5DEECE66D  # draft seeds: a stream of their own (engine.sampling.step_seed)


class SpecEngine(Protocol):
    """What the Speculator uses of the engine (engine.llm_engine.Engine implements it)."""

    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler            # its running sequences (draft slots of the others are released)
    counters: dict                  # counters["steps"]: one more per speculative step

    def advance(self, seq: Sequence, tok: int, row, now: float):
        """Take one sampled token for `seq` (row: its logits row, for logprobs); its RequestOutput."""


class SpecStats:
    """What engine.stats() reports about speculation."""

    def __init__(self):
        self.spec_steps = 0
        self.plain_steps = 0
        self.verify_tokens = 0          # rows of spec steps (sequences' last tokens + drafts)
        self.drafts_proposed = 0        # drafts made (every depth)
        self.drafts_verified = 0
        self.drafts_accepted = 0
        self.seq_steps = 0              # (sequence, spec step) pairs
        self.tokens_emitted = 0         # tokens spec steps produced (accepted + bonus/correction)
        self.draft_runs = 0             # recursive draft plans run
        self.seconds = {"spec": 0.0, "plain": 0.0, "draft": 0.0}

    def report(self, cal: Calibration, costs: StepCosts) -> dict:
        per_pos = [round(float(a) / float(t), 4) if t else None for a, t in zip(cal.accepted, cal.tested)]
        return {
            "spec_steps": self.spec_steps, "spec_plain_steps": self.plain_steps,
            "spec_drafts_proposed": self.drafts_proposed, "spec_drafts_verified": self.drafts_verified,
            "spec_drafts_accepted": self.drafts_accepted,
            "spec_acceptance_per_position": per_pos,
            "spec_mean_accepted_length": round(self.tokens_emitted / self.seq_steps, 4) if self.seq_steps else None,
            "spec_verify_tokens_per_step": round(self.verify_tokens / self.spec_steps, 3) if self.spec_steps else None,
            "spec_draft_runs": self.draft_runs,
            "spec_step_seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "spec_step_table_us": costs.describe(),
        }


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


class Speculator:
    """The engine's speculative decoding: drafting, verification, the scheduler and its tables.
    The engine hands it prefill steps (to draft after them) and decode batches (to run)."""

    def __init__(self, engine: SpecEngine, cfg: SpecConfig):
        self.engine, self.runner, self.cfg = engine, engine.runner, cfg
        self.K = cfg.num_draft
        self.threshold = None if cfg.confidence == "auto" else float(cfg.confidence)
        self.runner.enable_speculation(self.K)
        self.cal = Calibration(self.K)
        self.costs = StepCosts()
        self.stats = SpecStats()
        self.slots: dict = {}           # seq_id -> row of the draft store
        # the scheduler's back-off after drafts that did not pay (see decode_step)
        self.bootstrap_wait, self.bootstrap_backoff, self._bootstrapped = 0, 1, False
        self.expect = [0.8] * self.K    # recent calibrated acceptance of proposed drafts, per position
        self.draft_seconds = None       # recent recursive drafting time per speculative step
        self.backend = self.runner.backend

    # ------------------------------------------------------------------ sequence state
    # A sequence's drafts live on it (engine.sequence): seq.drafts, seq.draft_probs, seq.draft_q
    # and seq.draft_len (drafts are stale once the sequence moved on).
    @staticmethod
    def drafts_of(seq) -> list:
        d = seq.drafts
        if not d or seq.draft_len != len(seq) or seq.num_computed != len(seq) - 1:
            return []
        return d

    def _slot(self, seq) -> int:
        s = self.slots.get(seq.seq_id)
        if s is None:
            used = set(self.slots.values())
            s = next(i for i in range(self.runner.max_batch) if i not in used)
            self.slots[seq.seq_id] = s
        return s

    def _release_slots(self, running: list) -> None:
        keep = {s.seq_id for s in running}
        for sid in [k for k in self.slots if k not in keep]:
            del self.slots[sid]

    @staticmethod
    def _params(seq):
        p = seq.params
        return p.temperature, p.top_k, p.top_p

    def _draft_params(self, seqs: list, depth: int) -> tuple:
        temp, top_k, top_p, seeds = [], [], [], []
        for seq in seqs:
            t, k, pp = self._params(seq)
            temp.append(t)
            top_k.append(k)
            top_p.append(pp)
            seeds.append(step_seed(seq.params.seed ^ DRAFT_SALT, seq.index, len(seq) + depth))
        return temp, top_k, top_p, seeds

    def _set_drafts(self, seq, tokens: list, probs: list, sampled: bool) -> None:
        seq.drafts, seq.draft_probs, seq.draft_q, seq.draft_len = list(tokens), list(probs), sampled, len(seq)
        self.stats.drafts_proposed += len(tokens)
        for j, pr in enumerate(probs):
            self._note_proposed(j, pr)

    # ------------------------------------------------------------------ after a prefill step
    def after_prefill(self, batch: list, samples: list) -> None:
        """Run the MTP layer over the positions a prefill step computed (its cache layer must hold
        every position) and draft for the sequences whose prompt is now complete. `batch`: the
        step's ScheduledSeq list, after the engine appended the sampled tokens; samples: which of
        them sampled a token (their chunk ended the prompt)."""
        r = self.runner
        if self.threshold is None and self.bootstrap_backoff >= 16:
            # speculation has not paid for a while (high load, or verification that costs more
            # than it gains here): skip the MTP layer; these sequences would draft without the
            # prompt in its cache if speculation resumes (lossless, less accepted)
            return
        steps, tokens = [], []
        for s in batch:
            seq, start, n = s.seq, s.start, s.num_tokens
            nxt = seq.token_ids[start + 1:start + n + 1]
            nxt = nxt + [0] * (n - len(nxt))     # a sequence that stopped at its first token: never read
            steps.append((seq, start, n))
            tokens.append(nxt)
        logits = r.run(steps, kind="mtp", tokens=tokens)
        want = [i for i, s in enumerate(batch) if samples[i] and not s.seq.is_finished]
        if not want:
            return
        seqs = [batch[i].seq for i in want]
        self._release_slots(self.engine.scheduler.running)
        rows_logits = logits if len(want) == logits.shape[0] else None
        if rows_logits is None:
            rows_logits = r.backend.empty((len(want), logits.shape[1]), "f32")
            r.spec_store.gather_rows(logits, want, rows_logits)
        toks, probs = r.sampler.sample(rows_logits, *self._draft_params(seqs, 0), with_probs=True)
        sampled = [seq.params.temperature > 0 for seq in seqs]
        if any(sampled):
            sel = [i for i, sm in enumerate(sampled) if sm]
            r.spec_store.scatter_draft_rows(rows_logits, sel, [self._slot(seqs[i]) for i in sel], 0)
        # the MTP hidden state of each sequence's last row, for deeper drafts
        ends = np.cumsum([s.num_tokens for s in batch]) - 1
        last_row = [int(ends[i]) for i in want]
        for seq, tok, pr, sm in zip(seqs, toks, probs, sampled):
            self._set_drafts(seq, [tok], [pr], sm)
        self._draft_deeper(seqs, last_row)

    # ------------------------------------------------------------------ recursive drafts
    def _draft_deeper(self, seqs: list, mtp_rows: list) -> None:
        """Drafts 2..K: the MTP layer on its own hidden state and its last draft, for the
        sequences where one more draft is expected to pay (or reach the threshold). mtp_rows[i]:
        the row of the last plan whose MTP hidden state drafted seqs[i]'s first draft."""
        if self.K < 2 or not seqs:
            return
        r, bm = self.runner, self.engine.block_manager
        live = None       # the sequences drafting so far; their hidden states are spec_store.draft[:len(live)]
        for depth in range(1, self.K):
            pool = seqs if live is None else live
            # the draft writes the MTP layer's cache at position len(seq) - 1 + depth - 1
            keep = [i for i in self._choose_deeper(pool, depth) if bm.can_grow(pool[i], len(pool[i]) + depth)]
            if not keep:
                return
            for i in keep:
                bm.grow(pool[i], len(pool[i]) + depth)
            if live is None:
                r.spec_store.keep_draft_hidden([mtp_rows[i] for i in keep])
            elif len(keep) != len(live):
                # compact the rows still drafting (through a second store: no gather in place)
                r.spec_store.compact_drafting(keep)
            live = [pool[i] for i in keep]
            steps = [(seq, len(seq) - 1 + depth - 1, 1) for seq in live]
            with Timer() as tm:
                logits = r.run(steps, kind="draft", tokens=[[seq.drafts[-1]] for seq in live])
                dt, dp = r.sampler.sample(logits, *self._draft_params(live, depth), with_probs=True)
            if r.last_plan.runs > 2:
                self.costs.observe("draft", self._bucket(len(live)), tm.seconds)
            self.stats.draft_runs += 1
            self.stats.seconds["draft"] += tm.seconds
            sel = [j for j, seq in enumerate(live) if seq.draft_q]
            if sel:
                r.spec_store.scatter_draft_rows(logits, sel, [self._slot(live[j]) for j in sel], depth)
            for seq, tok, pr in zip(live, dt, dp):
                seq.drafts.append(tok)
                seq.draft_probs.append(pr)
                self.stats.drafts_proposed += 1
                self._note_proposed(depth, pr)

    def _choose_deeper(self, seqs: list, depth: int) -> list:
        """Indices of the sequences that draft at position `depth` (0-based), ascending."""
        gains = [(survival(seq.draft_probs[:depth], self.cal)[-1] * self.cal.mean(depth), i)
                 for i, seq in enumerate(seqs)]
        if self.threshold is not None:
            return [i for g, i in gains if g >= self.threshold]
        # auto: the expected tokens gained must pay for the extra draft run
        gains.sort(reverse=True)
        n_run = max(len(self.engine.scheduler.running), 1)
        spec_sec = self.costs.get("spec", self._bucket(n_run * (depth + 1)))
        per_token = spec_sec / max(n_run * (1 + sum(self.cal.mean(j) for j in range(depth))), 1e-9)
        best, best_n, acc = 0.0, 0, 0.0
        for n, (g, _) in enumerate(gains, 1):
            acc += g
            extra_rows = self.costs.get("spec", self._bucket(n_run * (depth + 1) + n)) - spec_sec
            v = acc * per_token - self.costs.get("draft", self._bucket(n)) - max(extra_rows, 0.0)
            if v > best:
                best, best_n = v, n
        return sorted(i for _, i in gains[:best_n])

    @staticmethod
    def _bucket(n: int) -> int:
        return bucket(max(int(n), 1))

    # ------------------------------------------------------------------ one decode step
    def decode_step(self, batch: list, now_fn) -> Optional[list]:
        """Run the decode batch speculatively; None: the scheduler chose a plain step (the engine
        runs it). Returns the RequestOutputs.

        The step time the tables learn is the whole step's wall time, from here to the outputs
        (the choice, the verify plan, the acceptance, calibration and bookkeeping), as a plain
        step's is (engine.step): on a GPU a small model's plan takes about as long as the Python
        around it, and a table of the plan's time alone made speculation look cheaper than it is."""
        t_entry = time.perf_counter()
        eng, r, bm = self.engine, self.runner, self.engine.block_manager
        self._release_slots(eng.scheduler.running)
        seqs = [s.seq for s in batch]
        drafts = [self.drafts_of(seq) for seq in seqs]
        # speculate or not: sequences without drafts (new after a plain step) count as if they had
        # K drafts of the measured mean acceptance -- this step's MTP run gives them real ones
        if self.bootstrap_wait > 0 and not any(drafts):
            self.bootstrap_wait -= 1          # recent drafts did not pay: stay plain a while
            return None
        surv = [survival(seq.draft_probs[:len(d)], self.cal) if d else [] for seq, d in zip(seqs, drafts)]
        virt = [len(d) if d else self.K for d in drafts]
        vsurv = [sv if d else self._expected_survival() for d, sv in zip(drafts, surv)]
        over = self._draft_overhead(len(seqs))
        counts = admit(virt, vsurv, self.costs, self._bucket, self.threshold, spec_ready=True, overhead=over).counts
        if counts is None and not any(drafts):
            # not even drafts of the usual acceptance would pay at this batch size: ask again later
            self.bootstrap_backoff = min(2 * self.bootstrap_backoff, 64)
            self.bootstrap_wait = self.bootstrap_backoff
            return None
        if counts is not None and any(drafts):
            counts = admit([len(d) for d in drafts], surv, self.costs, self._bucket, self.threshold,
                           spec_ready=True, overhead=over).counts
        if self.threshold is None and any(drafts):
            # a step that started drafting (bootstrap) should lead to verified drafts; when the real
            # drafts are not worth verifying, wait twice as long before drafting again
            if counts is None or not any(counts):
                if self._bootstrapped:
                    self.bootstrap_backoff = min(2 * self.bootstrap_backoff, 64)
                    self.bootstrap_wait = self.bootstrap_backoff
            else:
                self.bootstrap_backoff = 1
            self._bootstrapped = False
        if counts is None:
            return None
        if not any(drafts):
            self._bootstrapped = True
            counts = [0] * len(seqs)
        for i, seq in enumerate(seqs):       # drafts never take a block another sequence needs
            while counts[i] and not bm.can_grow(seq, len(seq) + counts[i]):
                counts[i] -= 1
            bm.grow(seq, len(seq) + counts[i])
        steps, tokens = [], []
        draft_ids, temp, top_k, top_p, seeds, dseeds, src = [], [], [], [], [], [], []
        with_q = False
        for seq, d, k in zip(seqs, drafts, counts):
            start = seq.num_computed
            steps.append((seq, start, 1 + k))
            tokens.append([seq.token_ids[start]] + d[:k])
            t, tk, tp = self._params(seq)
            n_out = seq.num_output_tokens
            slot = self._slot(seq) if (k and seq.draft_q) else 0
            for j in range(k + 1):
                draft_ids.append(d[j] if j < k else -1)
                temp.append(t)
                top_k.append(tk)
                top_p.append(tp)
                seeds.append(step_seed(seq.params.seed, seq.index, n_out + j))
                # the MTP drafts again at every row (the next step keeps the row after the last accepted)
                dseeds.append(step_seed(seq.params.seed ^ DRAFT_SALT, seq.index, start + 2 + j))
                src.append(j * r.max_batch + slot if j < k else 0)
            with_q |= bool(k and seq.draft_q and t > 0)
        T = len(draft_ids)
        inputs = {"draft_ids": (draft_ids, -1), "temperature": (temp, 0.0), "top_k": (top_k, 0), "top_p": (top_p, 1.0),
                  "seeds": (seeds, 0), "draft_seeds": (dseeds, 0)}
        if with_q:
            inputs["draft_src"] = (src, 0)
            r.spec_store.draft_logits()
        logits = r.run(steps, all_logits=True, keep_hidden=with_q, kind="spec", tokens=tokens, inputs=inputs)
        be = self.backend
        verified = be.to_numpy(r.output("verified")).tolist()
        accepted = be.to_numpy(r.output("accepted")).tolist()
        dtok = be.to_numpy(r.output("draft_tokens")).tolist()
        dprob = be.to_numpy(r.output("draft_probs")).tolist()
        traced = r.last_plan.runs <= 2     # a plan's first runs trace, bind and capture it: not its step time
        st = self.stats
        st.spec_steps += 1
        st.verify_tokens += T
        host = None
        if any(seq.params.logprobs is not None for seq in seqs):
            host = be.to_numpy(logits)
        outs, now = [], now_fn()
        keep_rows, keep_seqs = [], []
        row = 0
        for (seq, start, n), d, k in zip(steps, drafts, counts):
            a = 0
            while a < k and accepted[row + a]:
                a += 1
            for j in range(min(a + 1, k)):      # calibration: drafts tested (all before them accepted)
                self.cal.update(j, seq.draft_probs[j], j < a)
            st.drafts_verified += min(a + 1, k)
            st.drafts_accepted += a
            st.seq_steps += 1
            new = d[:a] + [verified[row + a]]
            emitted = 0
            for j, tok in enumerate(new):
                o = eng.advance(seq, tok, host[row + j] if host is not None and seq.params.logprobs is not None
                                 else None, now)
                emitted += 1
                outs.append(o)
                if seq.is_finished:
                    break
            st.tokens_emitted += emitted
            if not seq.is_finished:
                seq.num_computed = start + 1 + a
                bm.commit(seq)
                self._set_drafts(seq, [dtok[row + a]], [dprob[row + a]], seq.params.temperature > 0)
                keep_rows.append(row + a)
                keep_seqs.append(seq)
            row += n
        eng.counters["steps"] += 1
        # merge the outputs of one request's tokens into one RequestOutput per sequence
        outs = _merge(outs)
        sampled = [i for i, seq in enumerate(keep_seqs) if seq.draft_q]
        if sampled:
            r.spec_store.scatter_draft_rows(r.output("draft_logits"), [keep_rows[i] for i in sampled],
                                 [self._slot(keep_seqs[i]) for i in sampled], 0)
        spent = time.perf_counter() - t_entry
        if not traced:
            self.costs.observe("spec", self._bucket(T), spent)
        st.seconds["spec"] += spent
        with Timer() as td:       # the recursive drafts: their own table and _draft_overhead
            self._draft_deeper(keep_seqs, keep_rows)
        self.draft_seconds = td.seconds if self.draft_seconds is None else \
            0.8 * self.draft_seconds + 0.2 * td.seconds
        return outs

    def _draft_overhead(self, S: int) -> float:
        """Seconds of recursive drafting a speculative step brings (measured per step; before any,
        every sequence drafting all K: speculation must not look cheaper than it is)."""
        if self.draft_seconds is None:
            return sum(self.costs.get("draft", self._bucket(S)) for _ in range(self.K - 1))
        return self.draft_seconds

    def _expected_survival(self) -> list:
        """Survival of K drafts a sequence without drafts would get: per position, the recent
        average of the calibrated acceptance of the drafts proposed there (0.8 before any: it
        has to be tried to be measured)."""
        out, p = [], 1.0
        for j in range(self.K):
            p *= self.expect[j]
            out.append(p)
        return out

    def _note_proposed(self, pos: int, prob: float) -> None:
        self.expect[pos] += 0.1 * (self.cal(pos, prob) - self.expect[pos])

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        if self.runner.last_plan.runs > 2:
            self.costs.observe("plain", self._bucket(batch_size), seconds)
        self.stats.plain_steps += 1
        self.stats.seconds["plain"] += seconds

    def report(self) -> dict:
        return self.stats.report(self.cal, self.costs)

    # ------------------------------------------------------------------ the step-time table
    def profile(self, repeats: int = 5) -> None:
        """Time plain decode steps, speculative steps and draft runs over the batch sizes this
        engine can see (dummy sequences, random tokens), so the scheduler has costs from the first
        step; the engine keeps refining them with the steps it runs."""
        r, bm = self.runner, self.engine.block_manager
        V = r.cfg.vocab_size
        rng = np.random.default_rng(0)
        ctx = 16
        need = lambda n: -(-(ctx + self.K + 2) // bm.block_size) * n
        maxS = r.max_batch
        while maxS > 1 and need(maxS) > bm.num_free_blocks:
            maxS //= 2
        if need(1) > bm.num_free_blocks:
            return
        seqs = []
        try:
            for _ in range(maxS):
                seq = Sequence(rng.integers(0, V, ctx + self.K + 2).tolist(), cacheable=False)
                bm.grow(seq, ctx + self.K + 2)
                seq.num_computed = ctx
                seqs.append(seq)
            be = r.backend

            def timed(fn):
                fn()
                fn()     # traced, then captured
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    be.synchronize()
                    ts.append(time.perf_counter() - t0)
                return float(min(ts))    # the machine's cost; noise only ever adds

            sizes = sorted({bucket(s) for s in range(1, maxS + 1)})
            sizes = [s for s in sizes if s <= maxS]
            for S in sizes:
                sub = seqs[:S]

                def plain():
                    lg = r.run([(q, ctx, 1) for q in sub])
                    r.sampler.sample(lg, temperature=[0.0] * S)
                self.costs.observe("plain", S, timed(plain))

                def draft():
                    lg = r.run([(q, ctx, 1) for q in sub], kind="draft", tokens=[[5]] * S)
                    r.sampler.sample(lg, [0.0] * S, [0] * S, [1.0] * S, [0] * S, with_probs=True)
                self.costs.observe("draft", S, timed(draft))
            spec_sizes = sorted({bucket(t) for t in range(1, maxS * (self.K + 1) + 1)})
            for T in spec_sizes:
                S = min(maxS, T)
                per = [T // S + (1 if i < T % S else 0) for i in range(S)]
                if max(per) > self.K + 1:
                    continue
                steps = [(q, ctx, n) for q, n in zip(seqs[:S], per)]
                toks = [rng.integers(0, V, n).tolist() for n in per]
                inputs = {"draft_ids": (rng.integers(0, V, T).tolist(), -1), "temperature": ([0.0] * T, 0.0),
                          "top_k": ([0] * T, 0), "top_p": ([1.0] * T, 1.0), "seeds": ([0] * T, 0),
                          "draft_seeds": ([0] * T, 0)}

                def spec():
                    r.run(steps, all_logits=True, kind="spec", tokens=toks, inputs=inputs)
                    for name in ("verified", "accepted", "draft_tokens", "draft_probs"):
                        be.to_numpy(r.output(name))
                self.costs.observe("spec", T, timed(spec))
        finally:
            for seq in seqs:
                bm.release(seq)


def _merge(outs: list) -> list:
    """One RequestOutput per (request, choice) from a step's per-token outputs."""
    merged, order = {}, []
    for o in outs:
        key = (o.request_id, o.index)
        m = merged.get(key)
        if m is None:
            merged[key] = o
            order.append(key)
            continue
        m.token_ids = m.token_ids + o.token_ids
        m.text += o.text
        m.logprobs = m.logprobs + o.logprobs
        m.finished, m.finish_reason = o.finished, o.finish_reason
        m.num_output_tokens = o.num_output_tokens
    return [merged[k] for k in order]
