"""The runner's side of a tensor / expert parallel job: joining it, and stepping every rank together.

Every rank builds the same runner. Rank 0 schedules; before it runs a step it announces the step's
plan key and host inputs to the others, which run the same plan on the same inputs, so that the
collectives inside the step (model.deepseek) meet. The channel between the ranks is
parallel.group (mpi4py for this control traffic, the backend's communicator for the collectives).
"""
from __future__ import annotations

from ..errors import ConfigError
from .plan_key import PlanKey


class RankSteps:
    """One rank of a job (group: a parallel.group.ParallelGroup of more than one rank)."""

    def __init__(self, group, backend, cfg, expert_cache) -> None:
        """Check that the model can be split this way and create the backend's communicator
        (before loading: a backend without collectives fails fast)."""
        self.group = group
        group.shard.check(cfg)
        if expert_cache is not None:
            raise ConfigError("expert_cache with several ranks: expert parallelism already spreads the experts "
                              "over the ranks; drop expert_cache, or run on one rank")
        group.connect(backend)

    def agree_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank has (rank 0's block manager hands out blocks on all of them)."""
        return self.group.agree_min(num_blocks)

    def announce(self, plan) -> None:
        """Rank 0: the plan about to run and its filled host inputs, to the other ranks."""
        self.group.send_step(plan.key, {name: plan.host_input(name) for name in plan.inputs})

    @staticmethod
    def replay(runner, key, inputs: dict) -> None:
        """Ranks other than 0: run the step rank 0 announced (key: its plan key's values)."""
        p = runner.plan(*PlanKey(*key))
        for name, a in inputs.items():
            p.host_input(name)[...] = a
        runner.execute(p)
