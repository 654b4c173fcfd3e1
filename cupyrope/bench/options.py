"""The options of the benchmark command line, apart from :mod:`.cli` that runs them: ``python -m
cupyrope bench`` checks its arguments with this parser before it looks for a GPU."""

from __future__ import annotations

import argparse

from .fused import FUSED_TOKENS
from .jax_steps import JAX_TOKENS
from .shapes import GQA_RATIOS, HEAD_DIMS, SERVING_LAYOUTS, SERVING_TOKENS
from .workloads import ALL_IMPLS, REFERENCE_TOKENS


def positive_int(text: str) -> int:
    """An argparse type: ``text`` as an int of at least 1; errors in argparse's own words."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive integer value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser(*, prog: str, default_out: str) -> argparse.ArgumentParser:
    """The benchmark command's parser, shown as ``prog``, writing into ``default_out``."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Reference sweep (bf16 q [T,32,128], k [T,8,128], fp32 cache, NeoX): cupyrope against an "
        "SM copy of the same bytes and the peers installed; prints the table and writes it with a "
        "bandwidth plot."))
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=None,
                        help="values of T (default: " + " ".join(map(str, REFERENCE_TOKENS))
                        + "; with --fused: " + " ".join(map(str, FUSED_TOKENS))
                        + "; with --serving: " + " ".join(map(str, SERVING_TOKENS))
                        + "; with --jax: " + " ".join(map(str, JAX_TOKENS)) + ")")
    parser.add_argument("--fused", action="store_true",
                        help="the fused ops (rms_norm_rope; rope_and_cache into NHD, HND and fp8 "
                        "caches, and with the norm; fp8 out) against the unfused sequences, eager "
                        "and torch.compile, apply_rope in place and an SM copy of their bytes "
                        "(T <= 512 in CUDA graphs); writes fused_sweep.{md,json,png}")
    parser.add_argument("--shapes", action="store_true",
                        help="apply_rope from a cache, out of place and in place, over head_dim "
                        + "/".join(map(str, HEAD_DIMS)) + " and GQA ratios "
                        + "/".join(map(str, GQA_RATIOS)) + " (32 q heads) at T = 65536 (less "
                        "for large heads: at most 1 GiB of traffic) against an SM copy, "
                        "torch.compile and Liger; writes shapes_sweep.{md,json}")
    parser.add_argument("--serving", action="store_true",
                        help="rms_norm_rope and rope_and_cache on served models' heads ("
                        + ", ".join(SERVING_LAYOUTS) + ") against an SM copy and torch.compile "
                        "of the unfused sequence (default T: " + " ".join(map(str, SERVING_TOKENS))
                        + "; speculative decoding at 64 x 4 tokens, in CUDA graphs); writes "
                        "serving_sweep.{md,json}")
    parser.add_argument("--jax", action="store_true",
                        help="apply_rope under jax.jit (native XLA call and Python callback) "
                        "against XLA's fusion of the Hugging Face formulation and a jnp copy: wall "
                        "time per jitted step, GPU time per call against the torch path's, "
                        "accuracy; writes jax_sweep.{md,json,png}")
    impls = [i for i in ALL_IMPLS if i != "copy"]
    parser.add_argument("--impls", nargs="+", default=None, choices=impls, metavar="IMPL",
                        help="implementations besides the SM copy, among " + ", ".join(impls)
                        + " (default: cupyrope's angle sources and every peer)")
    parser.add_argument("--repeats", type=positive_int, default=10,
                        help="timed batches per case; each time reported is their median "
                        "(default 10)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the agreement check before timing")
    parser.add_argument("--out", default=default_out,
                        help="folder for the table, its JSON and its plot (reference_sweep, "
                        "fused_sweep, shapes_sweep, serving_sweep or jax_sweep .md, .json, .png; "
                        f"default: {default_out})")
    return parser
