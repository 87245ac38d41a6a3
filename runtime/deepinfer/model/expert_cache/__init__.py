"""The expert cache: routed MoE experts held in a bounded number of slots per layer and loaded when a
step routes to them, from pinned host memory or straight from the checkpoint files, with the next
layer's experts pre-loaded while the current layer runs.

Why: every other weight of a DeepSeek model is small next to its routed experts (V3: 656 of 671B
parameters), and a token uses 8 of 256 per layer. Keeping all of them in device memory is what makes
a model fit or not; keeping the ones that recent tokens used (LRU hit rates of 75-98% are reported
for DeepSeek routers) and streaming the rest lets a model larger than the device run, and starting
with none resident (capacity 1.0: lazy loading) lets the first token come before they are all read.

The modules, each with its part of the design in its docstring:
  config      ExpertCacheConfig (the engine config's `expert_cache`) and the defaults per backend
  policy      which experts a layer keeps in its slots (LayerSlots; the LRU / LFRU policies)
  layout      one expert's byte layout (ImageLayout), slot counts, a layer's slots (CachedLayer) and
              what the graph traces a streamed layer over (StreamedLayer)
  table       the expert -> slot table on the device (the moe_experts expert_map)
  sources     where an expert's bytes come from: checkpoint file runs, conversion, host images
  readers     the Python reader threads
  native      the native reader threads (runtime/native/expert_reader.c)
  loads       loads into slots: started, given up, waited for
  routing     a pause's routing read back to the host
  pause_free  decode steps without pauses, and their back-off
  cache       ExpertCache: the slots, and the hooks the runner calls around and inside a step
"""
from __future__ import annotations

from .cache import ExpertCache
from .config import SOURCES, ExpertCacheConfig
from .layout import ImageLayout, StreamedLayer
from .policy import POLICIES, LayerSlots

__all__ = ["ExpertCache", "ExpertCacheConfig", "ImageLayout", "LayerSlots", "POLICIES", "SOURCES", "StreamedLayer"]
