"""What a traced plan depends on (PlanKey), and the buckets that keep the number of plans small.

Buckets: a plan is traced per (kind, mode, tokens bucket, sequences bucket, ...), not per exact
shape, so a server that sees every batch size and chunk length settles on a few plans and never
retraces in steady state. The runner pads each step up to its buckets (engine.model_runner).
"""
from __future__ import annotations

from typing import NamedTuple


class PlanKey(NamedTuple):
    """The key of one traced plan in the runner's plan cache.

    A tuple underneath: it compares and hashes as the plain 7-tuple, and rank 0 sends it to the
    other ranks of a job as a JSON list of its values (parallel.group.send_step)."""

    kind: str                   # "main"; "mtp" (the MTP layer over a main step's rows); "draft"
                                # (a recursive draft); "spec" (verify the drafts and draft again)
    mode: str                   # "prefill" (fresh sequences, no cache read) or "decode"
    tokens: int                 # the tokens bucket
    seqs: int                   # the sequences bucket
    all_logits: bool = False    # logits of every token, not only each sequence's last
    keep_hidden: bool = False   # main: keep the final hidden states; spec: gather the draft logits
    pause_free: bool = False    # an expert cache's step without pauses (model.expert_cache)


def bucket(n: int) -> int:
    """The padded size of a batch of n tokens or sequences: 1, 2, 4, 8, 16, 24, 32, 48, 64, ..., 128
    (steps of 16), then steps of 64 to 512, then steps of 256."""
    if n <= 16:
        return 1 << max(n - 1, 0).bit_length()
    for limit, step in ((32, 8), (128, 16), (512, 64)):
        if n <= limit:
            return -(-n // step) * step
    return -(-n // 256) * 256
