"""The benchmarks' table of attention implementations (lmsys.attention.providers), on small CPU inputs."""

import pytest
import torch

from lmsys.attention import naive_attention
from lmsys.attention.providers import attention_function, timed_call


def test_an_unknown_provider_is_named():
    with pytest.raises(ValueError, match="unknown attention provider 'flash_tritn'"):
        attention_function("flash_tritn")


@pytest.mark.parametrize("provider", ["naive", "flash_torch", "sdpa", "sdpa_math"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_each_mode_times_what_it_says(seed, provider, mode):
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=torch.float64) for _ in range(3))
    do = torch.randn_like(q)
    fn, args = timed_call(attention_function(provider), q.clone(), k.clone(), v.clone(), True, mode, do=do)
    got = fn(*args)
    reference = [x.clone().requires_grad_() for x in (q, k, v)]
    out = naive_attention(*reference, True)
    expected = out.detach() if mode == "fwd" else torch.autograd.grad(out, reference, do)
    for a, b in zip(got if mode != "fwd" else (got,), expected if mode != "fwd" else (expected,), strict=True):
        torch.testing.assert_close(a, b)
    if mode == "bwd":  # each call is one more backward through the same graph
        for a, b in zip(fn(*args), expected, strict=True):
            torch.testing.assert_close(a, b)
