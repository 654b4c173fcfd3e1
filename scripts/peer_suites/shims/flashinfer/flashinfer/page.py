"""``flashinfer.page``: the page-table helpers that cupyrope.compat provides."""

from cupyrope.compat import get_batch_indices_positions, get_seq_lens  # noqa: F401
from peer_shim_support import module_getattr

__getattr__ = module_getattr("flashinfer.page")
