"""Distributed training: a rank launcher, collective helpers, four DDP variants, a ZeRO-1 sharded optimizer, FSDP.

One concept per module: `launch` (ranks in fresh processes, `init_process_group` for rank code), `collectives`,
`ddp`, `sharded_optimizer`, `fsdp`. Import from the modules (`from lmsys.distributed.launch import launch`); the
package re-exports nothing, so `lmsys.distributed.launch` stays the module. The wrappers take any `nn.Module` or
optimizer and rely on torch.distributed only: the same code runs under `launch` and under torchrun.
"""
