"""Measuring machinery for cupyrope's benchmarks, apart from the library: nothing in cupyrope's
own modules imports it. Shared by the pytest-benchmark suite in ``benchmarks/`` and by
``python -m cupyrope bench``.

- :mod:`.clocks`: GPU time from CUDA events (a pytest-benchmark timer too), CUDA graphs of N calls,
  host time per eager call, input sets that keep every call reading DRAM;
- :mod:`.workloads`: the reference shape and its data, one workload per implementation, the SM
  copy of the same bytes, the agreement check;
- :mod:`.peers`: Hugging Face (eager, torch.compile), Liger-Kernel, FlashInfer;
- :mod:`.cases`: what the op benchmarks share (data one shape at a time, torch.compile of an
  unfused sequence, the guard telling a peer that cannot run from a failure of cupyrope's);
- :mod:`.fused`: the fused serving ops against their unfused sequences; :mod:`.shapes`: more head
  shapes (head_dim, GQA) for apply_rope and serving shapes (M-RoPE, head_dim 256 / 512, partial
  rotary, speculative decoding) for the fused ops;
- :mod:`.sweep`: the reference sweep, its table and plot; :mod:`.cli`: its command line, whose
  options are :mod:`.options`'s; :mod:`.progress`: the sweeps' progress bar and notes;
- :mod:`.jax_steps`: apply_rope under ``jax.jit`` (native XLA call, Python callback) against
  XLA's fusion of the Hugging Face formulation: wall time per jitted step, GPU time per call in a
  jitted loop of 20, accuracy (JAX is imported only when used).

Everything runs on torch CUDA tensors on torch's current stream; torch, matplotlib, tqdm, tabulate
and the peers are optional (``pip install "cupyrope[bench]"``): the package imports without them.

>>> from cupyrope import bench                                                # doctest: +SKIP
>>> data = bench.RopeData(bench.RopeShape(tokens=65536))                      # doctest: +SKIP
>>> work = bench.make_workload("cupyrope-cache", data)                        # doctest: +SKIP
>>> bench.gpu_time_us(work.fn, rotate_inputs=work.arg_sets)                   # doctest: +SKIP
318.4
"""

from . import cases, shapes
from .clocks import (GPU_CLOCK, GRAPH_CALLS, HOST_LOOP, capture_graph, device_name, gpu_time_us,
                     graph_time_us, host_time_us, input_sets_for, plan_batches, synced_wall_clock)
from .peers import Unavailable, compiled_hf_rope, hf_rope, liger_rope, peer_status
from .sweep import Row, format_table, reference_sweep
from .workloads import (ALL_IMPLS, CHECK_TOLERANCE, COMPAT_IMPLS, CUPYROPE_IMPLS,
                        DECODE_TARGET_RATIO, DECODE_TOKENS, HOST_TARGET_RATIO, PEER_IMPLS,
                        REFERENCE_TOKENS, RopeData, RopeShape, Workload, decode_target_ratio,
                        error_is_acceptable, host_target_ratio, make_workload, max_abs_error,
                        sm_copy)

__all__ = [
    "ALL_IMPLS", "CHECK_TOLERANCE", "COMPAT_IMPLS", "CUPYROPE_IMPLS", "DECODE_TARGET_RATIO",
    "DECODE_TOKENS", "GPU_CLOCK", "GRAPH_CALLS", "HOST_LOOP", "HOST_TARGET_RATIO", "PEER_IMPLS",
    "REFERENCE_TOKENS", "cases", "capture_graph", "compiled_hf_rope", "decode_target_ratio", "device_name",
    "error_is_acceptable", "format_table", "gpu_time_us", "graph_time_us", "hf_rope",
    "host_target_ratio", "host_time_us", "input_sets_for", "liger_rope", "make_workload",
    "max_abs_error", "peer_status", "plan_batches", "reference_sweep", "RopeData", "RopeShape",
    "Row", "shapes", "sm_copy", "synced_wall_clock", "Unavailable", "Workload",
]
