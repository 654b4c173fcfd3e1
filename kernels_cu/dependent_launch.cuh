// Programmatic dependent launch (cupyrope/cuda/dependent_launch.py decides which launches use it; sm_90
// and later): a grid launched with it may be dispatched while the previous kernel of its stream is
// still finishing. wait_for_previous_grid lets the next such launch start early too, then waits for
// the previous kernel's completion and memory; a kernel calls it before its first global memory
// access, so its results are those of an ordinary launch. Without the launch attribute (or on
// older GPUs) it returns at once.
#pragma once

namespace cupyrope {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cupyrope
