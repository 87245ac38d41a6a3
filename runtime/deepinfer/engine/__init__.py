"""The engine, in the shape of nano-vllm's: one file per job.

    llm_engine.py    Engine: add_request / step / abort, and generate / stream / chat on top
    scheduler.py     waiting and running queues, chunked prefill, preemption by recompute
    block_manager.py KV cache blocks: reference counts, prefix caching of full blocks
    sequence.py      a request's tokens, computed positions and blocks
    model_runner.py  the model on a backend: weights, KV memory, bucketed plans, inputs, sampling
    tokenizer.py     tokenizer, chat template, incremental detokenizer
    sampling.py      SamplingParams and per-token seeds
"""
from .block_manager import BlockManager
from .llm_engine import Engine, QueueFullError, RequestOutput, default_model_dir, resolve_model_dir
from .model_runner import ModelRunner, bucket, load_runner
from .sampling import SamplingParams, step_seed
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .tokenizer import Detokenizer, Tokenizer

__all__ = ["Engine", "QueueFullError", "RequestOutput", "default_model_dir", "resolve_model_dir", "ModelRunner",
           "bucket", "load_runner", "SamplingParams", "step_seed", "Scheduler", "BlockManager", "Sequence", "Status",
           "Detokenizer", "Tokenizer"]
