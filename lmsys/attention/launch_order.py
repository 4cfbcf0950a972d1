"""Launch order of the attention forwards (the Triton one in flash_triton, the Gluon one in flash_hopper) and of the
Gluon backward's two kernels (flash_hopper_bwd.GROUPED_ORDER: its dK/dV kernel over blocks of keys, heaviest first
without the mask's reversal, since there the first keys are seen by every later query).

Heads go in groups whose keys and values take about half of the H100's 50 MB L2 cache. Within a group, the
programs of one query block of every head run side by side, the block with the most key tiles first: with a
causal mask the work of a block grows with its index, so the launch ends on the shortest programs of the last
group (no long straggler), while a group's keys and values stay few enough to be read from L2 by all its programs.
"""

import triton
import triton.language as tl

# Not watched by lmsys.attention.plans (the kernels read this module, which triton wants of the plain module type):
# the attention wrappers' plans keep the groups worked out from it.
_GROUP_BYTES = 24 * 2**20


def group_heads(k, heads):
    """Heads per group: as many as keep the group's keys and values (`k`'s size each) in L2."""
    kv_bytes = 2 * k.shape[-2] * k.shape[-1] * k.element_size()
    return max(1, min(heads, _GROUP_BYTES // kv_bytes))


@triton.jit
def program_position(N_Q, BH, GROUP_HEADS, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """(batch*head, query block) of this program of a 1-D grid of cdiv(N_Q, BLOCK_M) * BH programs. The Gluon
    forward and the Gluon backward's kernels call it too."""
    n_blocks = tl.cdiv(N_Q, BLOCK_M)
    pid = tl.program_id(0)
    group = pid // (GROUP_HEADS * n_blocks)
    first_bh = group * GROUP_HEADS
    group_heads = tl.minimum(BH - first_bh, GROUP_HEADS)
    rank = pid - group * (GROUP_HEADS * n_blocks)
    off_bh = first_bh + rank % group_heads
    if CAUSAL:
        start_m = n_blocks - 1 - rank // group_heads
    else:
        start_m = rank // group_heads
    return off_bh, start_m
