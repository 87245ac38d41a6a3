"""The engine, in the shape of nano-vllm's: one file per job.

    llm_engine.py    Engine: add_request / step / abort, and generate / stream / chat on top
    scheduler.py     waiting and running queues, chunked prefill, preemption by recompute
    block_manager.py KV cache blocks: reference counts, prefix caching of full blocks
    sequence.py      a request's tokens, computed positions and blocks
    model_runner.py  the model on a backend, one step at a time: plan -> fill -> run -> logits
    runner_config.py RunnerConfig: how a runner is sized and typed
    runner_factory.py load_runner: a runner from an EngineConfig (precision resolved)
    plan_key.py      PlanKey (what a traced plan depends on) and the buckets
    kv_sizing.py     KV cache bytes per block, what fits in free memory, allocating it
    spec_store.py    hidden-state and draft stores that outlive a step (MTP, speculation)
    multi_rank.py    the runner's side of a multi-rank job: rank 0 announces steps, others replay
    offline.py       forward / free / score / mtp_logits by caller-chosen sequence ids
    sampling.py      SamplingParams, per-token seeds, the Sampler over the backend's sample op
    speculative.py   MTP speculative decoding: drafting and verification (spec_schedule.py: the scheduler; the option is config.SpecConfig)
    tokenizer.py     tokenizer, chat template, incremental detokenizer
"""
from .block_manager import BlockManager
from .llm_engine import Engine, QueueFullError, RequestOutput, default_model_dir, resolve_model_dir
from .model_runner import ModelRunner
from .plan_key import PlanKey, bucket
from .runner_config import RunnerConfig
from .runner_factory import load_runner
from .sampling import SamplingParams, step_seed
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .tokenizer import Detokenizer, Tokenizer

__all__ = ["Engine", "QueueFullError", "RequestOutput", "default_model_dir", "resolve_model_dir", "ModelRunner",
           "RunnerConfig", "PlanKey", "bucket", "load_runner", "SamplingParams", "step_seed", "Scheduler", "BlockManager", "Sequence", "Status",
           "Detokenizer", "Tokenizer"]
