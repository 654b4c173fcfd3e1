"""``flashinfer.cutile.cutile_common``: FlashInfer's cuTile backend is a second implementation
with its own contract (MLA and interleaved pairing only, NotImplementedError otherwise); the
tests that ask for it count as "no adapter" rather than run against cupyrope's kernel."""

from peer_shim_support import NoAdapter, module_getattr


def is_cuda_tile_available():
    raise NoAdapter("flashinfer.cutile (the cuTile backend of rope_quantize_fp8)")


__getattr__ = module_getattr("flashinfer.cutile.cutile_common")
