"""`lmsys.distributed` exports the wrappers and the launcher under their own names, each the object of its module,
and `lmsys.distributed.launch` stays the module."""

import types

import pytest

import lmsys.distributed
from lmsys.distributed import (
    FSDP, DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive, RankError, RankTimeout, ShardedOptimizer,
    init_process_group, launch_ranks,
)
from lmsys.distributed import ddp, fsdp, launch, sharded_optimizer

EXPORTS = [
    (DDPNaive, ddp.DDPNaive), (DDPFlat, ddp.DDPFlat), (DDPIndividualParameters, ddp.DDPIndividualParameters),
    (DDPBucketed, ddp.DDPBucketed), (ShardedOptimizer, sharded_optimizer.ShardedOptimizer), (FSDP, fsdp.FSDP),
    (launch_ranks, launch.launch_ranks), (init_process_group, launch.init_process_group),
    (RankError, launch.RankError), (RankTimeout, launch.RankTimeout),
]


@pytest.mark.parametrize("exported, defined", EXPORTS, ids=[defined.__name__ for _, defined in EXPORTS])
def test_each_export_is_the_object_its_module_defines(exported, defined):
    assert exported is defined
    assert defined.__name__ in lmsys.distributed.__all__


def test_all_lists_exactly_the_exports():
    assert sorted(lmsys.distributed.__all__) == sorted(defined.__name__ for _, defined in EXPORTS)


def test_the_launch_module_is_not_shadowed_by_the_launch_function():
    assert isinstance(lmsys.distributed.launch, types.ModuleType)
    assert lmsys.distributed.launch.launch_ranks is launch_ranks
