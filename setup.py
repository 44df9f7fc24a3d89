"""Packaging for mover_plugin.

The top-level ``patches/`` and ``launch/`` folders are installed as the subpackages
``mover_plugin.patches`` and ``mover_plugin.launch``; neither becomes a top-level import name.
"""

from setuptools import find_packages, setup

_CORE_PACKAGES = find_packages(include=["mover_plugin", "mover_plugin.*"])

setup(
    name="mover_plugin",
    version="0.1.0",
    description=(
        "Keeps Megatron-Core and DeepSpeed pretraining jobs running through rank failures "
        "and planned maintenance."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=_CORE_PACKAGES + ["mover_plugin.patches", "mover_plugin.launch"],
    package_dir={
        "mover_plugin.patches": "patches",
        "mover_plugin.launch": "launch",
    },
    package_data={"mover_plugin": ["data/corpus/*.jsonl"]},
    # Any torch from 2.4 on; tested with 2.14.1 (CI) and 2.13.0, CPU or CUDA build.
    install_requires=["torch>=2.4", "numpy", "packaging"],
    extras_require={
        "megatron": ["megatron-core>=0.19.2,<0.20"],
        # Megatron-LM's training loop (megatron.training, in the megatron-core wheel): in 0.19.2
        # it imports nothing beyond megatron-core's own requirements (checked in a fresh venv with
        # mock data and NullTokenizer); Megatron-LM's other tokenizers need [megatron-training].
        "megatron-lm": ["megatron-core>=0.19.2,<0.20"],
        # megatron-core's [mlm]: Megatron-LM's tokenizers and loggers (megatron.training).
        "megatron-training": ["megatron-core[mlm]>=0.19.2,<0.20"],
        "deepspeed": ["deepspeed>=0.19.8,<0.20"],
        # Transformers' Trainer with DeepSpeed, through Accelerate (docs/deepspeed.md).
        "hf": ["transformers>=5.25,<6", "accelerate>=1.16,<2"],
        # mover report's timeline picture.
        "report": ["matplotlib>=3.8"],
        # pyyaml: the tests read the Kubernetes manifests (examples/kubernetes/).
        "test": ["pytest>=8", "pyyaml>=6"],
    },
    entry_points={
        "console_scripts": [
            "mover-launch=mover_plugin.launch.cli:main",
            "mover=mover_plugin.launch.jobctl:main",
        ]
    },
)
