"""Several processes on one model: tensor parallelism for attention and dense MLPs, expert
parallelism for the routed experts (issue 20; the user's view: README "Several GPUs, or several CPU
ranks"; the ops: abi/README.md section 9).

    launch    starting N ranks (mpirun) and reporting a rank that died
    group     the ranks of this job: the control channel (mpi4py) and the backend's communicator
    shard     which rows / columns / experts of each weight a rank loads, and the local config
    worker    ranks 1..N-1: load their share, then run the steps rank 0 sends

Where the split shows in the model: model.deepseek (all_reduce after o_proj and each MLP, the
expert-parallel MoE layer), model.weights (the loader reads through shard.ShardedCheckpoint),
engine.multi_rank (rank 0 announces each step before running it; the others replay it through
ModelRunner.run_remote).
"""
