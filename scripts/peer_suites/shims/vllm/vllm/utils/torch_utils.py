"""``vllm.utils.torch_utils.set_random_seed``: seeds Python, NumPy and torch."""

from peer_shim_support import module_getattr
from vllm.platforms import current_platform


def set_random_seed(seed) -> None:
    current_platform.seed_everything(seed)


__getattr__ = module_getattr("vllm.utils.torch_utils")
