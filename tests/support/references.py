"""The session-wide reference runs the backend tests compare against: examples/run_glue.py's plain and accumulating
runs (single process, DDP, ZeRO-2), tests/scripts/tiny_train.py's BERT on one process, and TRL's SFTTrainer on the
tiny Llama, each launched when a test first reads it
and once across the xdist workers (in the session's shared folder, under a lock); conftest.py's session fixtures
return these tables."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from .environment import REPO
from .launches import GLUE, TINY_TRAIN, launch
from .shared import shared_once

# Shared runs of examples/run_glue.py (session-wide: the backend tests compare against the same single-process runs).
STEPS = 20
PLAIN = ["--do_train", "--do_eval", "--do_predict", "--max_steps", STEPS, "--max_eval_samples", "64",
         "--max_predict_samples", "37", "--save_strategy", "no"]
# 12 steps, accumulation 2, clipping that bites (grad norms reach ~1.4), linear warmup over 5 steps.
ACCUMULATE = ["--do_train", "--max_steps", "12", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5",
              "--warmup_steps", "5", "--learning_rate", "1e-4"]

# tests/scripts/tiny_train.py (a tiny BERT from a config on seeded ids): 12 steps of 16 samples, every step logged.
TINY = ["--max_steps", 12, "--learning_rate", "1e-3", "--save_strategy", "no", "--seed", 3]

# tests/scripts/tiny_llm.py: a tiny Llama (GQA, SwiGLU, untied embeddings) fine-tuned on seeded chat-like samples of
# 10-49 tokens, completion-only labels, fp32. TRL's SFTTrainer: stock (--stock) or combined with ExtTrainer.
TINY_LLM = REPO / "tests" / "scripts" / "tiny_llm.py"
# 4 steps of 8 samples; eval on 21 samples, whose last global batch accelerate pads on 2 ranks.
TRL = ["--trl", "--do_train", "--max_steps", 4, "--learning_rate", "1e-3", "--save_strategy", "no", "--bf16", "false",
       "--gradient_checkpointing", "false", "--completion_only_loss", "true", "--eval_samples", 21]
TRL_BACKENDS = {"ddp": [], "fsdp2": ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
                                     '{"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}'],
                "simple": ["--sharded_ddp", "simple"], "zero2": ["--deepspeed", "zero2_minimal"],
                "zero3": ["--deepspeed", "zero3"]}


class SharedRuns:
    """Session-wide reference runs, each launched when a test first reads it (`runs / "zero2"` is its output_dir): a
    test starts only the runs it compares with, so its markers stay true when it runs alone (a FairScale test that
    reads the single and DDP runs launches no DeepSpeed). They live in the workers' shared folder: the first worker
    to read a run launches it, another reading it meanwhile waits for it, a failed run fails every reader."""

    def __init__(self, name, runs, script=GLUE):
        self.name, self.runs, self.script = name, runs, script

    def together(self, *names) -> list:
        """Several runs, launched two at a time (each mostly start-up on one core: CI's 2 cores run two)."""
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(self.__truediv__, names))

    def __truediv__(self, name):
        with shared_once(f"{self.name}-{name}") as output_dir:
            failed = output_dir.with_name(output_dir.name + ".failed")
            if failed.exists():
                pytest.fail(f"the shared run {self.name}/{name} failed earlier:\n{failed.read_text()}")
            if not output_dir.exists():
                kind, *flags = self.runs[name]
                try:
                    launch(kind, output_dir, *flags, script=self.script)
                except AssertionError as error:
                    failed.write_text(str(error))
                    raise
        return output_dir


def plain_runs() -> SharedRuns:
    """examples/run_glue.py for 20 steps: single process, DDP and ZeRO-2."""
    return SharedRuns("plain", {
        "single": ["single", *PLAIN, "--per_device_train_batch_size", 16],
        "ddp": ["torchrun", *PLAIN, "--per_device_train_batch_size", 8],
        "zero2": ["deepspeed", *PLAIN, "--per_device_train_batch_size", 8, "--deepspeed",
                  "ds_configs/zero2_minimal.json"],
    })


def accumulate_runs() -> SharedRuns:
    """12 steps with accumulation 2 and clipping: single process, DDP and ZeRO-2."""
    return SharedRuns("accumulate", {
        "single": ["single", *ACCUMULATE, "--per_device_train_batch_size", 8, "--save_strategy", "steps",
                   "--save_steps", 6],
        "ddp": ["launch", *ACCUMULATE, "--per_device_train_batch_size", 4, "--save_strategy", "no"],
        # Every 3 steps: a resume keeps its checkpoint's save_steps, so test_resume_world_size.py's 1-rank
        # continuation of checkpoint-6 saves the 1-rank checkpoint-9 it resumes on 2 ranks.
        "zero2": ["deepspeed", *ACCUMULATE, "--per_device_train_batch_size", 4, "--deepspeed", "zero2_minimal",
                  "--save_strategy", "steps", "--save_steps", 3],
    })


def tiny_runs() -> SharedRuns:
    """tiny_train.py on one process (8 x 2 accumulated): test_train_loss.py's final train_loss, test_elastic.py's
    uninterrupted run."""
    return SharedRuns("tiny", {"single": ["single", *TINY, "--per_device_train_batch_size", 8,
                                          "--gradient_accumulation_steps", 2]}, script=TINY_TRAIN)


def trl_runs() -> SharedRuns:
    """TRL's SFTTrainer on the tiny Llama: stock on one process (also with LoRA), and `ExtSFTTrainer` (ExtTrainer
    combined with it) on 2 ranks under each backend, every one on the same global batch of 8; evaluated with another
    eval batch size each."""
    def on_ranks(backend, eval_batch, *flags):
        kind = "launch" if backend == "simple" else "torchrun"  # ZeRO under torchrun --deepspeed: ~3 s less CPU
        return [kind, *TRL, "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", eval_batch,
                *TRL_BACKENDS[backend], *flags]

    single = ["single", "--stock", *TRL, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 8]
    return SharedRuns("trl", {
        "stock": single, "stock_lora": [*single, "--lora"],
        "fsdp2": on_ranks("fsdp2", 3), "zero2": on_ranks("zero2", 6), "zero3_lora": on_ranks("zero3", 4, "--lora"),
    }, script=TINY_LLM)
