"""``flashinfer.diffusion_ops``: only ``fused_qk_rmsnorm_rope`` has a cupyrope adapter."""

from cupyrope.compat import fused_qk_rmsnorm_rope  # noqa: F401
from peer_shim_support import module_getattr

__getattr__ = module_getattr("flashinfer.diffusion_ops")
