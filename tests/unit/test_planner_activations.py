"""The planner's activation bytes of a model known only by its size (trainer_ext.planner.activation_bytes), against
Korthikanti et al. 2022 eq. 1 worked out by hand for a tiny model (issue 45: these mutants survived the unit run)."""
import pytest

from trainer_ext.planner import ModelSize, activation_bytes


def size(**fields):
    return ModelSize(100, "test", hidden_size=4, num_layers=2, num_heads=2, **fields)


def test_eager_attention_without_dropout_keeps_the_softmax_only():
    """Eager attention without dropout would not add a·s²·b·2 alone (the softmax): 2·(3·4·32 + 2·9·2)·2, fp32."""
    assert activation_bytes(size(dropout=False, attention_dropout=False), 1, 3, False, "eager") == 1680


def test_eager_attention_dropout_adds_its_mask_and_output():
    """Attention dropout would not add a·s²·b·3 to eager attention's softmax: 2·(3·4·32 + 2·9·5), 16-bit."""
    assert activation_bytes(size(dropout=False, attention_dropout=True), 1, 3, True, "eager") == 948


def test_hidden_dropout_adds_two_mask_bytes_and_sdpa_is_the_default():
    """Hidden dropout would not add s·b·h·2, or the default attention would keep the O(s²) softmax: 2·3·4·34."""
    assert activation_bytes(size(dropout=True, attention_dropout=True), 1, 3, True) == 816


@pytest.mark.parametrize("missing", ["hidden_size", "num_layers", "num_heads"])
def test_unknown_shape_gives_no_activation_estimate(missing):
    """A model without hidden size, layers or heads would get a made-up activation figure instead of none."""
    fields = dict(hidden_size=4, num_layers=2, num_heads=2)
    fields[missing] = None
    assert activation_bytes(ModelSize(100, "test", **fields), 1, 3, True) is None
