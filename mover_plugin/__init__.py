"""mover_plugin: keeps large Megatron-Core and DeepSpeed pretraining jobs running through rank
failures and planned maintenance.

Importing this package is cheap: it imports neither Megatron-Core nor DeepSpeed. Framework
adapters (``mover_plugin.megatron``) import their framework only when used.
"""

from mover_plugin.errors import ConfigError, LaunchError, MoverError, PatchError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LaunchError", "MoverError", "PatchError", "__version__"]
