import math

import pytest
import torch

from graphattn.functional import dropout, dropout_mask


@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mask_is_zero_with_probability_p_else_inverse_keep(p, dtype):
    torch.manual_seed(0)
    n = 200_000
    mask = dropout_mask((n,), p, dtype=dtype)
    assert mask.dtype == dtype and mask.shape == (n,)
    kept = mask != 0
    expected = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
    assert (mask[kept] == expected).all()
    # Fraction dropped: within 5 standard deviations of the binomial mean.
    dropped = 1.0 - kept.double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_dropout_gradient_is_the_mask_and_eval_is_identity():
    torch.manual_seed(1)
    x = torch.randn(50, 7, requires_grad=True)
    torch.manual_seed(2)
    y = dropout(x, 0.3)
    g = torch.randn_like(y)
    y.backward(g)
    torch.manual_seed(2)
    mask = dropout_mask((50, 7), 0.3)
    assert torch.equal(y, x.detach() * mask)
    assert torch.equal(x.grad, g * mask)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mask_drops_the_same_entries_in_every_dtype(dtype):
    # the triton backend draws its mask in fp32, the others in v's dtype: one seed, one draw
    torch.manual_seed(4)
    fp32 = dropout_mask((100_000,), 0.3)
    torch.manual_seed(4)
    assert torch.equal(dropout_mask((100_000,), 0.3, dtype=dtype) != 0, fp32 != 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_keeps_the_dtype_of_x(dtype):
    x = torch.randn(50, 7).to(dtype)
    torch.manual_seed(2)
    y = dropout(x, 0.3)
    torch.manual_seed(2)
    assert y.dtype == dtype
    assert torch.equal(y, x * dropout_mask((50, 7), 0.3, dtype=dtype))


@pytest.mark.parametrize("p", [-0.5, 1.0, 1.5, float("nan"), "0.5"])
def test_probability_outside_zero_one_is_refused(p):
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout(x, p)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout(x, p, training=False)  # as F.dropout: refused in eval too
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout_mask((4,), p)


@pytest.mark.parametrize("p", [True, "0.5", torch.tensor(0.5)], ids=["bool", "str", "tensor"])
def test_probability_that_is_not_a_number_is_refused_by_its_type(p):
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got .* \(a (bool|str|Tensor), "
                                         r"not a number\)"):
        dropout(torch.ones(4), p)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_under_vmap_follows_its_randomness(randomness):
    """Under torch.func.vmap, one mask for every sample with ``randomness="same"`` (the mask
    of a plain call from the same seed), one per sample with ``"different"``, as F.dropout."""
    x = torch.randn(4, 50, 7)
    torch.manual_seed(2)
    y = torch.func.vmap(lambda x: dropout(x, 0.3), randomness=randomness)(x)
    masks = y / x  # (4, 50, 7): 0 or 1 / 0.7
    assert ((masks == 0) | torch.isclose(masks, torch.tensor(1 / 0.7))).all()
    assert [torch.equal(masks[0] != 0, m != 0) for m in masks[1:]] == [randomness == "same"] * 3
    if randomness == "same":
        torch.manual_seed(2)
        assert torch.equal(y[0], dropout(x[0], 0.3))
