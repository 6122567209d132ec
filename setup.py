"""Installable package for megatron_rl.

Pins follow the platform the CI runs on (Python 3.11, CPU torch 2.13.0, megatron-core 0.16.1).
GPU clusters run megatron-core 0.19.x on Python 3.12; the code accepts both (see
megatron_rl/megatron_backend/platform/mcore_compat.py).
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = {}
exec((ROOT / "megatron_rl" / "__init__.py").read_text(), VERSION)

setup(
    name="megatron-rl",
    version=VERSION["__version__"],
    description="RL post-training (GRPO, DAPO, GSPO, SAPO) of Mixture-of-Experts LLMs on Megatron-Core",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=[
        "torch>=2.6",
        # 0.16.1 is the newest release pip accepts on Python 3.11; 0.19.x needs Python 3.12.
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "packaging>=24.2",
        "psutil",  # megatron.core.dist_checkpointing uses it without declaring it
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "pyyaml",
        "tqdm",
        "wandb",
        "tensorboard",
        "matplotlib",
        "pyseccomp>=0.1.2",  # the python tool's seccomp filter (ctypes bindings of the system's libseccomp.so.2)
    ],
    extras_require={
        # GPU-only; never installable on a CPU-only machine (needs a CUDA build of torch).
        "gpu": ["transformer-engine[pytorch]>=2.8", "triton>=3.3"],
        "sglang": ["sglang==0.5.23", "sglang-router"],
        "data": ["pyarrow>=15"],  # Parquet / Arrow / `datasets`-folder prompt datasets
        "math": ["math-verify>=0.9"],  # the `math` reward (and `dapo`'s / `math_answer`'s equivalence checks)
        "bench": ["trl==1.16.0"],  # benchmarks/bench_vs_trl.py: the peer it is timed against
        # triton runs the kernels' tests under its CPU interpreter (TRITON_INTERPRET=1); 3.7.1 is the version
        # torch 2.13's CUDA build pins.
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",  # the suite runs on two workers (pyproject.toml addopts)
            "ruff>=0.6",
            "mypy==2.4.1",  # pyproject.toml [tool.mypy]: `python -m mypy` checks megatron_rl
            "triton==3.7.1; platform_machine == 'x86_64'",
            "pyarrow>=15",
            "math-verify>=0.9",
            "peft==0.21.2",  # LoRA: the exported adapter is loaded with peft in the tests
        ],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
