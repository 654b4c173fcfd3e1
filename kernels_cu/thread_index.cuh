// A thread's coordinates in its block. Kernels read them through these functions, not the
// threadIdx / blockDim builtins, so that one build can run them from a one-dimensional block:
// XLA's kernel call (jaxlib's gpu_triton, cupyrope/frontends/jax/native.py) launches blocks of whole warps
// along x only. That build defines CUPYROPE_FLAT_BLOCK_X / _Y / _Z, the block shape the launch
// was planned for (a whole number of warps), and a flat thread index t is the thread
// (t % X, t / X % Y, t / (X * Y)): the same warps, lane for lane, as a three-dimensional launch
// of that shape. Every other build reads the builtins (no instruction added).
#pragma once

namespace cupyrope {

#ifdef CUPYROPE_FLAT_BLOCK_X
__device__ __forceinline__ unsigned tid_x() { return threadIdx.x % CUPYROPE_FLAT_BLOCK_X; }
__device__ __forceinline__ unsigned tid_y() {
  return threadIdx.x / CUPYROPE_FLAT_BLOCK_X % CUPYROPE_FLAT_BLOCK_Y;
}
__device__ __forceinline__ unsigned tid_z() {
  return threadIdx.x / (CUPYROPE_FLAT_BLOCK_X * CUPYROPE_FLAT_BLOCK_Y);
}
__device__ __forceinline__ unsigned ntid_x() { return CUPYROPE_FLAT_BLOCK_X; }
__device__ __forceinline__ unsigned ntid_y() { return CUPYROPE_FLAT_BLOCK_Y; }
__device__ __forceinline__ unsigned ntid_z() { return CUPYROPE_FLAT_BLOCK_Z; }
#else
__device__ __forceinline__ unsigned tid_x() { return threadIdx.x; }
__device__ __forceinline__ unsigned tid_y() { return threadIdx.y; }
__device__ __forceinline__ unsigned tid_z() { return threadIdx.z; }
__device__ __forceinline__ unsigned ntid_x() { return blockDim.x; }
__device__ __forceinline__ unsigned ntid_y() { return blockDim.y; }
__device__ __forceinline__ unsigned ntid_z() { return blockDim.z; }
#endif

}  // namespace cupyrope
