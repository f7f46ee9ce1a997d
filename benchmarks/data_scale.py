"""Benchmark the causal-LM recipe's data path at scale against stock TRL: seeded generated chats (1-3 turns, ~4.6 KB
each), examples/run_clm.py --packing (trainer_ext) and TRL's SFTTrainer (packing=True, its datasets cache) on the same
file, the same 32k byte-level BPE tokenizer (trained on the first 2,000 chats) with a ChatML template and a tiny Llama of
that vocabulary, each on one process and on 2 CPU ranks under torchrun, one after the other in one run. Per run:
seconds from the launch to the end of optimizer step 1 (the first loss line), chats/s of the data preparation (read,
tokenize, pack: trainer_ext's own count; TRL: building SFTTrainer, on rank 0), peak RSS of each rank (/usr/bin/time -v
around each rank), and for trainer_ext a second run on the filled cache (a re-run, resume or search trial). Writes
benchmarks/results/data_scale.md and .json (machine and versions included).

    python benchmarks/data_scale.py                                  # 10k and 100k chats: ~20 min on 2 quiet cores
    python benchmarks/data_scale.py --chats 10000 --only trainer_ext # one size, one side
    python benchmarks/data_scale.py --chats 1000000 --only trainer_ext --ranks 2   # the by-hand 1M run

Generated files, the tokenizer and the model stay in --workdir (reused by later runs); each run gets empty caches."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
RUN_CLM = REPO / "examples" / "run_clm.py"
RESULTS = REPO / "benchmarks" / "results"
MAX_LENGTH = 2048
VOCABULARY = 32_000
SEED = 0


# -- data, tokenizer, model --------------------------------------------------------------------------------------------
def generate(path: Path, chats: int, seed: int = SEED) -> None:
    """`chats` OpenAI-messages conversations of 1-3 turns (30% with a system prompt), 400-900 words each from a
    20,000-word Zipf vocabulary: the same file for the same seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = sorted({"".join(rng.choice(letters, rng.integers(2, 11))) for _ in range(25_000)})[:20_000]
    vocabulary = np.array(words)
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1))
    cdf /= cdf[-1]
    staging = path.with_suffix(".partial")
    with open(staging, "w") as out:
        for _ in range(chats):
            turns = int(rng.integers(1, 4))
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
            per_turn = max(int(rng.integers(400, 900)) // (2 * turns), 5)
            for _ in range(turns):
                for role, count in (("user", per_turn // 2), ("assistant", per_turn * 3 // 2)):
                    text = " ".join(vocabulary[np.searchsorted(cdf, rng.random(count))].tolist())
                    messages.append({"role": role, "content": text + "."})
            out.write(json.dumps({"messages": messages}) + "\n")
    os.rename(staging, path)


def build_model(folder: Path, corpus: Path) -> None:
    """A 32k byte-level BPE trained on the corpus's first 2,000 chats, ChatML, and a 2-layer Llama for it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from trainer_ext.tasks.causal_lm import CHATML_TEMPLATE

    def texts():
        with open(corpus) as lines:
            for number, line in enumerate(lines):
                if number == 2000:
                    return
                yield from (message["content"] for message in json.loads(line)["messages"])

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=VOCABULARY, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=specials[3:], model_max_length=2 * MAX_LENGTH)
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * MAX_LENGTH, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    staging = folder.with_suffix(".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.rename(staging, folder)


# -- TRL's side: this file, run as a training script --------------------------------------------------------------------
def trl_main(model: str, data: str, output_dir: str) -> None:
    """Stock TRL as its docs show it: load_dataset("json"), SFTConfig(packing=True, max_length=2048), SFTTrainer."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    started = time.time()
    config = SFTConfig(output_dir=output_dir, packing=True, max_length=MAX_LENGTH, max_steps=1,
                       per_device_train_batch_size=1, logging_steps=1, report_to="none", save_strategy="no",
                       disable_tqdm=True, bf16=False)  # fp32 as the recipe; transformers refuses bf16 without a GPU
    dataset = load_dataset("json", data_files=data, split="train")
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=config, train_dataset=dataset,
                         processing_class=AutoTokenizer.from_pretrained(model))
    if trainer.is_world_process_zero():
        print(f"DATA_SECONDS {time.time() - started:.2f}", flush=True)
    trainer.train()


# -- one run ------------------------------------------------------------------------------------------------------------
def run(side: str, ranks: int, chats: int, data: Path, model: Path, work: Path, cache: Path, label: str) -> dict:
    """Launch one run (each rank under /usr/bin/time -v); seconds to the first loss line, data seconds, peak RSS."""
    out = work / "runs" / label
    shutil.rmtree(out, ignore_errors=True)
    (out / "rss").mkdir(parents=True)
    wrapper = work / "time_rank.sh"
    wrapper.write_text('#!/bin/sh\nexec /usr/bin/time -v -o "$RSS_DIR/rank${RANK:-0}" "$@"\n')
    wrapper.chmod(0o755)
    if side == "trainer_ext":
        script = [str(RUN_CLM), "--model_name_or_path", str(model), "--train_file", str(data), "--do_train",
                  "--max_steps", "1", "--per_device_train_batch_size", "1", "--packing", "--max_seq_length",
                  str(MAX_LENGTH), "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1",
                  "--disable_tqdm", "true", "--output_dir", str(out / "output")]
    else:
        script = [str(Path(__file__).resolve()), "--trl_run", str(model), str(data), str(out / "output")]
    launcher = ([str(wrapper), sys.executable] if ranks == 1 else
                [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--no-python", str(wrapper), sys.executable])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", RSS_DIR=str(out / "rss"), TRAINER_EXT_CACHE=str(cache),
               HF_DATASETS_CACHE=str(cache / "datasets"))
    started = time.perf_counter()
    first_step, log = None, []
    with subprocess.Popen([*launcher, *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=REPO) as process:
        for line in process.stdout:
            log.append(line)
            if first_step is None and "'loss'" in line:
                first_step = time.perf_counter() - started
        process.wait()
    (out / "log.txt").write_text("".join(log))
    if process.returncode != 0 or first_step is None:
        raise SystemExit(f"{label} failed ({process.returncode}); log: {out / 'log.txt'}\n{''.join(log[-30:])}")
    text = "".join(log)
    rss = {int(path.name[4:]): int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", path.read_text())[1])
           * 1024 for path in (out / "rss").glob("rank*")}
    result = {"side": side, "ranks": ranks, "chats": chats, "label": label, "seconds_to_step_1": round(first_step, 1),
              "peak_rss_bytes": [rss[rank] for rank in sorted(rss)]}
    if side == "trainer_ext":
        built = re.search(r"read and tokenized in ([\d.]+) s.*?(?:packed in ([\d.]+) s)?;", text)
        if built:
            result["data_seconds"] = float(built[1]) + float(built[2] or 0)
        result["cache"] = "reused" if "comes from the cache" in text else "built"
    else:
        result["data_seconds"] = float(re.search(r"DATA_SECONDS ([\d.]+)", text)[1])
    if "data_seconds" in result:
        result["chats_per_second"] = round(chats / max(result["data_seconds"], 1e-3), 1)
    shutil.rmtree(out / "output", ignore_errors=True)
    return result


# -- the report ---------------------------------------------------------------------------------------------------------
def machine() -> dict:
    import importlib.metadata as metadata

    found = {name: metadata.version(name) for name in ("torch", "transformers", "datasets", "tokenizers", "trl",
                                                          "pyarrow")}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "memory_gib": round(memory / 2 ** 30, 1), "python": platform.python_version(), **found,
            "load_average_at_start": os.getloadavg()}


def report(results: list[dict], facts: dict) -> str:
    gib = lambda value: f"{value / 2 ** 30:.2f}"  # noqa: E731
    lines = ["# Causal-LM data at scale: trainer_ext against stock TRL", "",
             "`python benchmarks/data_scale.py` (benchmarks/data_scale.py's docstring says what is measured). Machine: "
             f"{facts['cores']} cores, {facts['memory_gib']} GiB; Python {facts['python']}, torch {facts['torch']}, "
             f"transformers {facts['transformers']}, datasets {facts['datasets']}, tokenizers {facts['tokenizers']}, "
             f"TRL {facts['trl']}, pyarrow {facts['pyarrow']}; load average at the start "
             f"{', '.join(f'{x:.1f}' for x in facts['load_average_at_start'])}.", "",
             "| chats | ranks | run | seconds to step 1 | data prep. chats/s | peak RSS per rank, GiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        name = r["side"] + (" (cache reused)" if r.get("cache") == "reused" else "")
        lines.append(f"| {r['chats']:,} | {r['ranks']} | {name} | {r['seconds_to_step_1']:.1f} | "
                     f"{r.get('chats_per_second', '-') if r.get('cache') != 'reused' else '-'} | "
                     f"{' / '.join(gib(value) for value in r['peak_rss_bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", choices=["trainer_ext", "trl"], nargs="+", default=["trainer_ext", "trl"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trainer_ext_data_scale"))
    parser.add_argument("--results", type=Path, default=RESULTS / "data_scale")
    parser.add_argument("--trl_run", nargs=3, metavar=("MODEL", "DATA", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_run:
        trl_main(*args.trl_run)
        return 0
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    facts, results = machine(), []
    model = work / "tiny-llama-bpe32k"
    for chats in args.chats:
        data = work / f"chats-{chats}-seed{SEED}.jsonl"
        if not data.exists():
            print(f"generating {data}", flush=True)
            generate(data, chats)
        if not model.exists():
            build_model(model, data)
        for ranks in args.ranks:
            for side in args.only:
                cache = work / "cache" / f"{side}-{chats}-{ranks}"
                shutil.rmtree(cache, ignore_errors=True)
                runs = ["first", "again"] if side == "trainer_ext" else ["first"]
                for attempt in runs:
                    label = f"{side}-{chats}-{ranks}rank-{attempt}"
                    print(f"running {label}", flush=True)
                    results.append(run(side, ranks, chats, data, model, work, cache, label))
                    print(json.dumps(results[-1]), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".json").write_text(json.dumps({"machine": facts, "runs": results}, indent=1))
    args.results.with_suffix(".md").write_text(report(results, facts))
    print(report(results, facts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
