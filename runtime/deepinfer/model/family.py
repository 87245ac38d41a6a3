"""The model families, one table: what differs between DeepSeek V2/V3, V3.2 and V4 for the code that
loads and runs a model. The runner asks `family_of(cfg)` and never branches on the family itself
(vLLM's model registry is the model). A new family is one more row here plus its own weights and
graph modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import deepseek_v4 as V4
from .config import ModelConfig
from .deepseek import DeepseekGraph, dsa_cache_pools
from .weights import WeightLoader
from .weights_v4 import V4WeightLoader


@dataclass(frozen=True)
class Family:
    name: str                        # as an error message names it
    weight_loader: type              # model.weights.WeightLoader or a subclass's kind
    graph: type                      # the traced model: a model.graph.ModelGraph subclass
    # ops beyond the V2 set and the ABI minor whose fields the family's steps use
    required_ops: tuple = ()
    min_abi_minor: int = 0
    # per layer {pool: (entries per block, width)} of a cache made of several pools;
    # None: one latent tensor per layer (model.kv_cache.PagedKVCache)
    cache_pools: Optional[Callable] = None
    # compressed entries of 4 and 128 tokens map onto blocks: only power-of-two block sizes
    pow2_blocks: bool = False
    # width of the hidden state the MTP layer reads (the final-normed hidden state, or V4's residual
    # streams before its hyper-connection head)
    hidden_width: Callable = lambda cfg: cfg.hidden_size
    # the step inputs a family derives from positions and slots (plan, cfg, block_size, pos, slots)
    fill_inputs: Optional[Callable] = None


def _fill_v4_inputs(p, cfg: ModelConfig, block_size: int, pos, slots) -> None:
    """-position, and per compression ratio r the entry slot and first position of the window each
    token closes (model.deepseek_v4)."""
    if "neg_positions" not in p.inputs:
        return
    pos = np.asarray(pos, np.int64)
    slots = np.asarray(slots, np.int64)
    p.host_input("neg_positions")[:] = -pos
    for r in V4.step_ratios(cfg):
        per = max(1, block_size // r)
        closes = ((pos + 1) % r == 0) & (slots >= 0)
        p.host_input(f"comp_slots_{r}")[:] = np.where(closes, (slots // block_size) * per + (pos % block_size) // r,
                                                       -1)
        p.host_input(f"comp_pos_{r}")[:] = np.where(closes, pos + 1 - r, 0)


DEEPSEEK_V2_V3 = Family("DeepSeek V2/V3", WeightLoader, DeepseekGraph)
DEEPSEEK_V32 = Family("DeepSeek V3.2", WeightLoader, DeepseekGraph, required_ops=("indexer_topk", "layernorm"),
                      min_abi_minor=3, cache_pools=dsa_cache_pools)
DEEPSEEK_V4 = Family("DeepSeek V4", V4WeightLoader, V4.DeepseekV4Graph, required_ops=V4.REQUIRED_OPS,
                     min_abi_minor=3, cache_pools=V4.cache_pools, pow2_blocks=True,
                     hidden_width=lambda cfg: cfg.hidden_size * cfg.v4.hc_mult, fill_inputs=_fill_v4_inputs)


def family_of(cfg: ModelConfig) -> Family:
    """The family of a parsed config (model.config decides V4 and V3.2 by their config keys)."""
    if cfg.v4 is not None:
        return DEEPSEEK_V4
    if cfg.dsa is not None:
        return DEEPSEEK_V32
    return DEEPSEEK_V2_V3
