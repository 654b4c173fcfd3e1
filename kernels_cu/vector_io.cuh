// Loads and stores of N consecutive elements.
//
// The vector flavour moves the N elements in 16-byte transactions (or one smaller power-of-two
// transaction when N elements are fewer than 16 bytes); the host only picks it when every pointer,
// stride and offset involved is aligned to that size. The scalar flavour touches one element at a
// time and has no alignment requirement beyond the element's own.
#pragma once

namespace cupyrope {

template <int BYTES> struct Chunk;
template <> struct Chunk<16> { using type = uint4; };
template <> struct Chunk<8> { using type = uint2; };
template <> struct Chunk<4> { using type = unsigned int; };
template <> struct Chunk<2> { using type = unsigned short; };
template <> struct Chunk<1> { using type = unsigned char; };

// A hint that brings the line holding `address` into L2 (no registers, no wait): data a thread
// reads later (another head, another token).
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

template <typename T, int N>
struct VectorBytes {
  static constexpr int total = N * static_cast<int>(sizeof(T));
  static constexpr int chunk = total >= 16 ? 16 : total;
  static constexpr int count = total / chunk;
  using chunk_type = typename Chunk<chunk>::type;
  union Bits {
    chunk_type chunks[count];
    T elements[N];
  };
};

template <bool VECTOR, typename T, int N>
__device__ __forceinline__ void load_elements(T (&dst)[N], const T* src) {
  if constexpr (VECTOR) {
    using V = VectorBytes<T, N>;
    typename V::Bits bits;
    const auto* chunks = reinterpret_cast<const typename V::chunk_type*>(src);
#pragma unroll
    for (int i = 0; i < V::count; ++i) bits.chunks[i] = chunks[i];
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = bits.elements[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

template <bool VECTOR, typename T, int N>
__device__ __forceinline__ void store_elements(T* dst, const T (&src)[N]) {
  if constexpr (VECTOR) {
    using V = VectorBytes<T, N>;
    typename V::Bits bits;
#pragma unroll
    for (int i = 0; i < N; ++i) bits.elements[i] = src[i];
    auto* chunks = reinterpret_cast<typename V::chunk_type*>(dst);
#pragma unroll
    for (int i = 0; i < V::count; ++i) chunks[i] = bits.chunks[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// N table entries spaced `stride` elements apart, converted to the compute type. Contiguous,
// aligned rows (the common case, decided once per launch on the host) take the vector path.
template <typename C, typename TableT, int N, typename Index>
__device__ __forceinline__ void load_table(C (&dst)[N], const TableT* __restrict__ src,
                                           Index stride, bool vector_ok) {
  TableT raw[N];
  if (vector_ok) {
    load_elements<true>(raw, src);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = src[i * stride];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = Convert<C>::from(raw[i]);
}

}  // namespace cupyrope
