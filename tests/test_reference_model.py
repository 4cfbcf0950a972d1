"""The plain-PyTorch reference LM is the same model as lmsys.model.TransformerLM: parameters, initialisation, logits
and gradients."""

import dataclasses

import pytest
import torch

from lmsys.model import SIZES, TransformerLM
from lmsys.reference_model import ReferenceLM
from lmsys.train import cross_entropy

TINY = dataclasses.replace(SIZES["tiny"], attention="sdpa")


@pytest.mark.parametrize("name", list(SIZES))
def test_same_parameter_names_and_shapes(name):
    with torch.device("meta"):
        ours, reference = TransformerLM(SIZES[name]), ReferenceLM(SIZES[name])
    assert {n: p.shape for n, p in reference.named_parameters()} == {n: p.shape for n, p in ours.named_parameters()}
    assert sum(p.numel() for p in reference.parameters()) == ours.num_parameters()


def test_same_initialisation_from_the_same_seed(seed):
    torch.manual_seed(seed)
    ours = TransformerLM(TINY)
    torch.manual_seed(seed)
    reference = ReferenceLM(TINY)
    torch.testing.assert_close(reference.state_dict(), ours.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("batch,T", [(1, 1), (3, 17), (2, 64)])
def test_loads_our_state_dict_and_gives_the_same_logits_and_gradients(seed, batch, T):
    ours = TransformerLM(TINY)
    reference = ReferenceLM(TINY)
    reference.load_state_dict(ours.state_dict())
    tokens = torch.randint(TINY.vocab_size, (batch, T))
    results = []
    for model in (ours, reference):
        logits = model(tokens)
        cross_entropy(logits, tokens.roll(-1, dims=-1)).backward()
        results.append((logits, {name: param.grad for name, param in model.named_parameters()}))
    (logits, grads), (expected_logits, expected_grads) = results
    # The same fp32 operations, in different layouts ((B, T, H, D) against (B, H, T, D)): equal to fp32 rounding.
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-4, atol=1e-6)
