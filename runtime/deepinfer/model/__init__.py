"""The DeepSeek V2/V3 model: config, checkpoint loading, typed weights, the graph, plans and the KV
cache memory. The runner that executes it lives in deepinfer.engine.model_runner."""
from __future__ import annotations

from ..errors import CacheFullError
from .checkpoint import Checkpoint, SafetensorsFile, TensorStore
from .config import ModelConfig
from .deepseek import DeepseekGraph
from .graph import StepInputs
from .kv_cache import PagedKVCache
from .weights import ModelWeights, WeightLoader

__all__ = ["Checkpoint", "SafetensorsFile", "TensorStore", "ModelConfig", "DeepseekGraph", "StepInputs",
           "PagedKVCache", "ModelWeights", "WeightLoader", "CacheFullError"]
