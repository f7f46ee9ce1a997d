"""Tiny models built from configs, seeded, for tests that must not need the 83 MB model package: a user's own small
BERT model folder with its WordPiece tokenizer, a 1-layer BERT classifier for in-process tests, and a BART config
file."""

import json
import re
from collections import Counter
from pathlib import Path

import torch

from .environment import REPO


def build_tiny_bert(folder, max_position_embeddings=512):
    """A 2-layer BERT base model (no head) with a fast WordPiece tokenizer over the shipped classification set's words
    and characters, saved as a user's model folder (~200 kB): the examples run on it without the 83 MB package."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = Counter()
    for line in (REPO / "data" / "classification" / "train.jsonl").read_text().splitlines():
        words.update(re.findall(r"\w+|[^\w\s]", json.loads(line)["sentence"].lower()))
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-()"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
             *(word for word, _ in words.most_common(200) if word not in chars)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)  # transformers 5 ignores vocab_file
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=max_position_embeddings,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(config).save_pretrained(folder)
    return folder


def tiny_bert(num_labels=2):
    """A 1-layer BERT classifier from a config (seeded, dropout off) for in-process tests."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=num_labels, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).eval()


def tiny_bart_config(path):
    from transformers import BartConfig

    BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64).to_json_file(path)
    return path
