"""The planner's activation bytes of a model known only by its size (trainer_ext.planner.activation_bytes), against
Korthikanti et al. 2022 eq. 1 worked out by hand for a tiny model (issue 45: these mutants survived the unit run)."""
import pytest

from trainer_ext.planner import DecoderShape, LoRA, ModelSize, activation_bytes, decoder_activation_bytes


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


def test_a_decoders_defaults_are_no_autocast_sdpa_and_one_byte_dropout_masks():
    """decoder_activation_bytes' defaults would count autocast's copies, eager attention's softmax or 2-byte dropout
    masks (CUDA's native dropout keeps 1 byte an element) for a caller that gives none of them."""
    shape = DecoderShape("llama", 32, 2, 4, 2, 8, 64, 96, False)
    lora = LoRA(4, ("q_proj", "v_proj"), 0.1)
    assert decoder_activation_bytes(shape, 2, 16, 4, lora=lora) == decoder_activation_bytes(
        shape, 2, 16, 4, False, lora, False, "sdpa", False, 1, False)


def test_the_chunked_loss_keeps_lm_heads_input_and_one_chunk_of_logits():
    """The chunked loss per token keeps lm_head's input (the stream's bytes) and the target (8); one chunk of logits
    keeps 12 bytes a logit (log-softmax and its gradients, fp32), its own dtype's, and in 16-bit the fp32 upcast (4):
    fp32 16 bytes a logit, bf16 18."""
    from trainer_ext.training.chunked_loss import chunk_tokens

    shape = DecoderShape("llama", 32, 2, 4, 2, 8, 64, 96, False)
    tokens, chunk = 32, min(32, chunk_tokens(96))
    assert decoder_activation_bytes(shape, 2, 16, 4, chunked_loss=True).loss == (4 * 32 + 8) * tokens + 16 * chunk * 96
    assert decoder_activation_bytes(shape, 2, 16, 2, chunked_loss=True).loss == (2 * 32 + 8) * tokens + 18 * chunk * 96


def test_under_zero3_a_linear_keeps_its_input_whenever_that_input_needs_a_gradient():
    """ZeRO-3's linear function keeps every Linear's input that needs a gradient, trained or not
    (linears_keep_inputs). A LoRA on up_proj alone, bf16, 2 × 16 tokens: the first layer's down_proj input needs one
    (up's output does, gate's does not: one side of SwiGLU's product is enough), and the second layer's q/k/v input
    and down_proj input; the other inputs are kept already. Counted as an `and` of the two sides, the first layer's
    down_proj input would be missing."""
    shape = DecoderShape("llama", 32, 2, 4, 2, 8, 64, 96, False)
    lora = LoRA(4, ("up_proj",))
    keeps, plain = (decoder_activation_bytes(shape, 2, 16, 2, False, lora, False, "sdpa", keep).layers
                    for keep in (True, False))
    tokens, h, i = 32, 32, 64
    assert keeps - plain == tokens * (2 * i + 2 * h + 2 * i)
