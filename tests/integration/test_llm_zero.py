"""TRL's SFTTrainer combined with ExtTrainer under DeepSpeed ZeRO-2, and ZeRO-3 with LoRA (it crashed at step 1: the
loss probe ran forwards outside the engine), trains like stock SFTTrainer on one process."""

import importlib.util
import json

import pytest

from conftest import logged

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("peft") is None,
                                 reason="needs peft and trl (pip install -e '.[test]')")]


@pytest.mark.parametrize("backend, stock", [("zero2", "stock"), ("zero3_lora", "stock_lora")])
def test_ext_sft_trainer_under_zero_trains_like_stock_sft_trainer(trl_runs, backend, stock):
    """ExtSFTTrainer under ZeRO: stock SFTTrainer's per-step losses on one process, the evaluation loss every target
    token's mean."""
    stock, ours = trl_runs.together(stock, backend)
    theirs, mine = logged(stock), logged(ours)
    assert sorted(mine) == sorted(theirs) == [1, 2, 3, 4]
    assert max(abs(theirs[step] - mine[step]) for step in mine) < 1e-5
    reference = json.loads((stock / "eval_results.json").read_text())["reference_token_loss"]
    assert abs(json.loads((ours / "eval_results.json").read_text())["eval_loss"] - reference) < 1e-6
