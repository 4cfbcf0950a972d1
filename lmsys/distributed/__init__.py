"""Distributed training: a rank launcher, collective helpers, four DDP variants, a ZeRO-1 sharded optimizer, FSDP.

The package exports what training code uses, each under its own name:

    from lmsys.distributed import DDPBucketed, FSDP, ShardedOptimizer, init_process_group, launch_ranks

    def train(steps):                       # rank code: runs under launch_ranks and under torchrun alike
        device = init_process_group()       # the rank's device: its GPU under NCCL, the CPU under gloo
        model = DDPBucketed(TransformerLM(SIZES["tiny"]).to(device), bucket_size_mb=100)  # or FSDP(...)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)     # ZeRO-1
        for _ in range(steps):
            cross_entropy(model(inputs), targets).backward()
            model.finish_gradient_synchronization(); optimizer.step(); optimizer.zero_grad()

    launch_ranks(train, 2, 100)             # two ranks in fresh processes; each rank's return value, in rank order

One concept per module: `launch` (launch_ranks, init_process_group, RankError, RankTimeout), `collectives`, `ddp`
(DDPNaive, DDPFlat, DDPIndividualParameters, DDPBucketed), `sharded_optimizer` (ShardedOptimizer), `fsdp` (FSDP).
The launch function is `launch_ranks` so that `lmsys.distributed.launch` stays the module. The wrappers take any
`nn.Module` or optimizer and rely on torch.distributed only: the same code runs under `launch_ranks` and under
torchrun.
"""

from lmsys.distributed.ddp import DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive
from lmsys.distributed.fsdp import FSDP
from lmsys.distributed.launch import RankError, RankTimeout, init_process_group, launch_ranks
from lmsys.distributed.sharded_optimizer import ShardedOptimizer

__all__ = [
    "DDPBucketed", "DDPFlat", "DDPIndividualParameters", "DDPNaive", "FSDP", "RankError", "RankTimeout",
    "ShardedOptimizer", "init_process_group", "launch_ranks",
]
