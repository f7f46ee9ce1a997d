"""Packing and padding for causal LMs (data/packing.py) against rows worked out by hand: best-fit decreasing placement,
each sample's own positions and unlabelled first token, and the collator's padding of plain and packed batches."""

import pytest
import torch

from trainer_ext.data.packing import (CausalLMCollator, PackedRows, best_fit_decreasing, pack, pack_dataset,
                                      padded_length)
from trainer_ext.data.tokens import TokenTable, TokenWriter


def test_best_fit_decreasing_places_each_sample_in_the_fullest_row_it_fits():
    """Worked by hand (longest first, ties by index): 9 8 7 5 open rows, the second 5 fills the 5's row, 3 the 7's,
    2 the 8's, 1 the 9's: 4 full rows. A first-fit or next-fit placement leaves other rows."""
    assert pack([9, 2, 7, 3, 5, 5, 1, 8], 10) == [[0, 6], [1, 7], [2, 3], [4, 5]]
    assert pack([6, 5, 4, 1], 10) == [[0, 2], [1, 3]]  # 4 into the 6's row (room 4), not the 5's (room 5)
    assert pack([4, 4, 4], 10) == [[0, 1], [2]]
    assert pack([10, 10], 10) == [[0], [1]] and pack([], 10) == []
    assert pack([0, 3], 4) == [[0, 1]] and pack([0], 4) == [[0]]  # an empty sample (a user's own data) fits anywhere


def test_best_fit_decreasing_reports_progress_every_65536_samples_and_at_the_end():
    """The progress line of a large set's packing: a count per 65536 samples placed and the total, none without a
    callback."""
    import numpy as np

    calls = []
    order, starts = best_fit_decreasing(np.ones(131073, dtype=np.int64), 1, calls.append)
    assert calls == [65536, 131072, 131073] and len(starts) == 131074
    best_fit_decreasing(np.ones(65536, dtype=np.int64), 1)


def test_a_sample_longer_than_a_row_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"^a sample of 11 tokens does not fit a row of 10$"):
        pack([3, 11, 2], 10)


def test_padded_length_is_the_fixed_length_else_the_longest_rounded_up():
    assert padded_length(5, None, None) == 5 and padded_length(5, 8, None) == 8 and padded_length(8, 8, None) == 8
    assert padded_length(9, 8, None) == 16 and padded_length(5, 8, 12) == 12


def test_plain_samples_are_right_padded_with_a_mask_and_unlabelled_padding():
    """Padding must neither be attended nor learnt."""
    batch = CausalLMCollator(pad_id=0, pad_to_multiple_of=4)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                                              {"input_ids": [8], "labels": [8]}])
    assert {key: value.tolist() for key, value in batch.items()} == {
        "input_ids": [[5, 6, 7, 0], [8, 0, 0, 0]], "labels": [[-100, 6, 7, -100], [8, -100, -100, -100]],
        "attention_mask": [[1, 1, 1, 0], [1, 0, 0, 0]]}
    assert {value.dtype for value in batch.values()} == {torch.int64}  # a float mask or ids: the model refuses them


def test_packed_rows_pad_with_positions_of_their_own_and_flatten_into_one_row():
    """A packed row carries position ids (no attention mask: transformers builds each sample's mask from them); its
    padding is a sample of its own (positions from 0); flattened, the rows are one row of batch size 1."""
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0]},
            {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1]}]
    batch = CausalLMCollator(pad_id=1, length=5)(rows)
    assert {key: value.tolist() for key, value in batch.items()} == {
        "input_ids": [[5, 6, 7, 1, 1], [8, 9, 1, 1, 1]], "labels": [[-100, 6, 7, -100, -100], [-100, 9, -100, -100, -100]],
        "position_ids": [[0, 1, 0, 0, 1], [0, 1, 0, 1, 2]]}
    flat = CausalLMCollator(pad_id=1, flatten=True)(rows)
    assert {key: value.tolist() for key, value in flat.items()} == {
        "input_ids": [[5, 6, 7, 8, 9, 1]], "labels": [[-100, 6, 7, -100, 9, -100]], "position_ids": [[0, 1, 0, 0, 1, 0]]}
    assert CausalLMCollator(pad_id=1, length=2)(rows)["input_ids"].shape == (2, 3)  # never cut below the longest
    assert {value.dtype for value in (*batch.values(), *flat.values())} == {torch.int64}  # float positions: refused


def test_pack_dataset_packs_a_datasets_dataset_into_rows():
    """Packing in a user's own script (docs/llm.md): best-fit rows of its samples, other columns dropped."""
    import datasets

    samples = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
                                          "labels": [[1, 2, 3], [-100, 5], [6, 7, 8, 9], [10]],
                                          "text": ["a", "b", "c", "d"]})
    assert pack_dataset(samples, 5).to_list() == PACKED


PACKED = [  # the longest sample opened the first row
    {"input_ids": [6, 7, 8, 9, 10], "labels": [-100, 7, 8, 9, -100], "position_ids": [0, 1, 2, 3, 0]},
    {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "position_ids": [0, 1, 2, 0, 1]}]


def test_packed_rows_of_a_token_table_are_best_fit_rows_built_when_read(tmp_path):
    """The recipe's packing of a tokenized set (a memory-mapped table): best-fit rows of its samples, each sample's
    first label dropped and its positions restarting at 0."""
    import numpy as np

    samples = [([1, 2, 3], [1, 2, 3]), ([4, 5], [-100, 5]), ([6, 7, 8, 9], [6, 7, 8, 9]), ([10], [10])]
    writer = TokenWriter(tmp_path / "tokens.arrow")
    writer.write(np.array([t for ids, _ in samples for t in ids]), np.array([t for _, labels in samples for t in labels]),
                 np.array([len(ids) for ids, _ in samples]))
    writer.close()
    table = TokenTable(tmp_path / "tokens.arrow")
    rows = PackedRows(table, *best_fit_decreasing(table.lengths(), 5))
    assert [rows[i] for i in range(len(rows))] == PACKED
    assert rows[-1] == rows[1] and rows[-2] == rows[0]
    for index in (2, -3):
        with pytest.raises(IndexError, match=rf"^row {index} of 2$"):
            rows[index]
