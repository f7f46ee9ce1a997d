"""LoRA variants and the chunked loss on 2 CPU ranks under DeepSpeed ZeRO-3 and FSDP2, against one process taking the
loss over the whole logits (fp32, the same global batch): DoRA adapters, rank-stabilised scaling, 4 tokens the model's
vocabulary lacked (a grown tokenizer's) with embed_tokens and lm_head trained whole and saved with the adapter (the
bug class of axolotl's new-token embeddings under ZeRO-3: partitioned copies saved empty or not trained), label
smoothing with accumulation, ExtTrainer's loss through lm_head in chunks of 13 target tokens (lm_head a peft copy
whose weight ZeRO-3 partitions). Equal per-step losses and adapters (1e-5) say that every one of these trains and
saves as on one process, and that the chunked loss is the full one on both sharding backends. (This run found that a
rank with fewer target tokens ran fewer chunks through the peft copy, each gathering its weight under ZeRO-3: gloo's
"Received data size doesn't match" at the first backward; the ranks now agree on the number of chunks.)"""

import importlib.util
import os

import pytest

from conftest import (EXAMPLES, PYTHON, REPO, TINY_COMMON, TINY_LLM, clean_env, free_port, launch, launcher, logged,
                      run_many, scratch)

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                 reason="needs peft (pip install -e '.[test]')")]

STEPS = 4
VARIANTS = ["--do_train", "--max_steps", STEPS, "--learning_rate", "1e-2", "--lora", "--dora", "--rslora",
            "--modules_to_save", "embed_tokens,lm_head", "--new_tokens", 4, "--label_smoothing_factor", 0.1,
            "--gradient_accumulation_steps", 2, "--save_strategy", "steps", "--save_steps", STEPS,
            "--include_num_input_tokens_seen", "non_padding"]
BACKENDS = {"zero3": ["--deepspeed", "zero3"], "fsdp2": ["--fsdp", "full_shard auto_wrap"]}


@pytest.fixture(scope="module")
def runs(request):
    """One process over the whole logits; ZeRO-3 and FSDP2 on 2 ranks with 13-token chunks, two at a time."""
    root = scratch(request, "variants")
    single = [PYTHON, TINY_LLM, "--output_dir", root / "single", *TINY_COMMON, *VARIANTS,
              "--per_device_train_batch_size", 4, "--chunked_loss", "false"]
    commands = {"single": (single, None)}
    for name, flags in BACKENDS.items():
        commands[name] = ([*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(), TINY_LLM,
                           "--output_dir", root / name, *TINY_COMMON, *VARIANTS, "--per_device_train_batch_size", 2,
                           "--loss_chunk_tokens", 13, *flags], None)
    for name, out in run_many(commands, timeout=900).items():
        assert out.returncode == 0, f"{name}:\n{out.stderr[-4000:]}"
    return root


def adapter(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dora_and_new_token_embeddings_train_and_save_as_on_one_process(runs, backend):
    """Per-step losses (the chunked loss on 2 ranks, the full one on one process) and every saved tensor (q/v LoRA A
    and B, DoRA's magnitudes, the 100-row embeddings and lm_head) of the output and its checkpoint."""
    single, launched = logged(runs / "single"), logged(runs / backend)
    assert sorted(single) == sorted(launched) == list(range(1, STEPS + 1))
    assert max(abs(single[s] - launched[s]) for s in single) < 1e-5
    for where in ("", f"checkpoint-{STEPS}"):
        ours, theirs = adapter(runs / "single" / where), adapter(runs / backend / where)
        assert ours.keys() == theirs.keys() and len(ours) == 14
        assert {tuple(t.shape) for k, t in theirs.items() if "embed_tokens" in k or "lm_head" in k} == {(100, 32)}
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


# bitsandbytes for the QLoRA test's processes only (make setup installs it there): installed in .venv, peft would import
# it at every process's start, ~1.4 s of CPU each (measured), in every launched test.
QLORA_SITE = REPO / ".qlora-site"


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None and not (QLORA_SITE / "bitsandbytes").is_dir(),
                    reason="needs bitsandbytes (make setup puts it in .qlora-site; or pip install -e '.[qlora]')")
def test_qlora_on_2_cpu_ranks_trains_like_one_process(tmp_path):
    """--load_in_4bit (bitsandbytes 0.50's NF4 on CPU) under DDP: the recipe's per-step losses and adapter equal one
    process's (measured also under ZeRO-3 and FSDP2: docs/llm.md). No evaluation: refused on CPU."""
    flags = ["--do_train", "--max_steps", 4, "--learning_rate", "3e-3", "--max_train_samples", 32, "--max_seq_length",
             192, "--lora_r", 4, "--load_in_4bit", "--save_strategy", "no"]
    env = {"TRAINER_EXT_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(QLORA_SITE), clean_env().get("PYTHONPATH")]))}
    launch("single", tmp_path / "single", *flags, "--per_device_train_batch_size", 8, script=EXAMPLES / "run_clm.py",
           env=env)
    launch("torchrun", tmp_path / "ddp", *flags, "--per_device_train_batch_size", 4, script=EXAMPLES / "run_clm.py",
           env=env)
    single, ddp = logged(tmp_path / "single"), logged(tmp_path / "ddp")
    assert sorted(single) == sorted(ddp) == list(range(1, 5)) and max(abs(single[s] - ddp[s]) for s in single) < 1e-5
    ours, theirs = adapter(tmp_path / "single"), adapter(tmp_path / "ddp")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5
