// oxccl's reduction kernels for the cuda-ring backend.
//
// Compiled to PTX by scripts/gen-ptx.py (NVRTC 12.0 from pip, so the PTX
// loads on every driver from CUDA 12.0 on; the driver JIT-compiles it for
// the GPU at hand). The generated files, kernels.sm80.ptx and
// kernels.sm90.ptx, are committed and embedded by build.rs; CI regenerates
// them and fails on any difference.
//
// Every kernel reproduces the host backend's arithmetic bit for bit
// (src/host/reduce.rs), because both backends run the same plans and must
// give the same bits:
//   - integers wrap (computed in the unsigned type), min/max as usual;
//   - f32/f64: one IEEE operation per element (no contraction: each kernel
//     does a single add, multiply or divide), min/max propagate NaN by
//     returning a + b when either is NaN;
//   - f16/bf16: widen both to f32 exactly, apply the f32 operation, round
//     to nearest even once, with the `half` crate's conversions written in
//     integer code (not cvt instructions);
//   - Avg combines as Sum; `divide` is its last step (integers truncate
//     toward zero, floats divide in their own precision, halves in f32).
// The one exception is NaN *payloads*: GPU arithmetic returns a canonical
// NaN where x86 keeps the input's payload and sign, so a NaN result is a
// NaN on both backends but its bits may differ.
//
// No headers: NVRTC from pip ships none, and none are needed.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

// ---- 16-bit floats <-> f32, bit-identical to the `half` crate ----------

__device__ __forceinline__ float f32_from_bits(u32 x) { return __int_as_float((int)x); }
__device__ __forceinline__ u32 bits_from_f32(float x) { return (u32)__float_as_int(x); }

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    u32 v = ((u32)h) << 16;
    u32 quiet = ((v & 0x7fffffffu) > 0x7f800000u) ? 0x00400000u : 0u;
    return f32_from_bits(v | quiet);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = bits_from_f32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    // Adding 0x7fff plus the lowest kept bit carries into bit 16 exactly
    // when rounding to nearest even rounds up.
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = ((u32)(h & 0x8000u)) << 16;
    u32 exp = h & 0x7c00u;
    u32 man = h & 0x03ffu;
    if ((h & 0x7fffu) == 0) {
        return f32_from_bits(sign);
    }
    if (exp == 0x7c00u) {
        return f32_from_bits(man == 0 ? (sign | 0x7f800000u) : (sign | 0x7fc00000u | (man << 13)));
    }
    if (exp == 0) {
        // Subnormal: normalise the mantissa.
        u32 e = (u32)__clz((int)man) - 16u - 6u;
        u32 bits = sign | ((127u - 15u - e) << 23) | ((man << (14u + e)) & 0x007fffffu);
        return f32_from_bits(bits);
    }
    return f32_from_bits(sign | (((exp >> 10) + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = bits_from_f32(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        // Infinity, or NaN made quiet with the top of its payload kept.
        return (u16)(man == 0 ? (sign | 0x7c00u) : (sign | 0x7e00u | (man >> 13)));
    }
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) {
        return (u16)(sign | 0x7c00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (u16)sign;
        }
        u32 m = man | 0x00800000u;
        u32 shift = (u32)(14 - half_exp);
        u32 half_man = m >> shift;
        u32 round_bit = 1u << (shift - 1);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) {
            half_man += 1;
        }
        return (u16)(sign | half_man);
    }
    u32 half_exp_bits = ((u32)half_exp) << 10;
    u32 half_man = man >> 13;
    u32 round_bit = 0x00001000u;
    u32 out = sign | half_exp_bits | half_man;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) {
        out += 1;
    }
    return (u16)out;
}

// ---- the operators, per storage type ------------------------------------

template <typename F> __device__ __forceinline__ F nan_min(F a, F b) {
    if (a != a || b != b) return a + b;
    return b < a ? b : a;
}
template <typename F> __device__ __forceinline__ F nan_max(F a, F b) {
    if (a != a || b != b) return a + b;
    return b > a ? b : a;
}

struct Sum {};
struct Prod {};
struct Min {};
struct Max {};

// Integers: arithmetic in the unsigned type of the same width (wrapping).
template <typename T, typename U> struct IntOps {
    __device__ static __forceinline__ T apply(Sum, T a, T b) { return (T)(U)((U)a + (U)b); }
    __device__ static __forceinline__ T apply(Prod, T a, T b) { return (T)(U)((U)a * (U)b); }
    __device__ static __forceinline__ T apply(Min, T a, T b) { return b < a ? b : a; }
    __device__ static __forceinline__ T apply(Max, T a, T b) { return b > a ? b : a; }
};

template <typename F> struct FloatOps {
    __device__ static __forceinline__ F apply(Sum, F a, F b) { return a + b; }
    __device__ static __forceinline__ F apply(Prod, F a, F b) { return a * b; }
    __device__ static __forceinline__ F apply(Min, F a, F b) { return nan_min(a, b); }
    __device__ static __forceinline__ F apply(Max, F a, F b) { return nan_max(a, b); }
};

struct Bf16Ops {
    template <typename Op> __device__ static __forceinline__ u16 apply(Op op, u16 a, u16 b) {
        return f32_to_bf16(FloatOps<float>::apply(op, bf16_to_f32(a), bf16_to_f32(b)));
    }
};

struct F16Ops {
    template <typename Op> __device__ static __forceinline__ u16 apply(Op op, u16 a, u16 b) {
        return f32_to_f16(FloatOps<float>::apply(op, f16_to_f32(a), f16_to_f32(b)));
    }
};

// ---- combine: dst[i] = a[i] (+) b[i] -------------------------------------
//
// `a` may equal `dst` (an in-place fold). When all three pointers are 16-byte
// aligned the body moves 16 bytes per load and store (uint4); the tail and
// unaligned calls go element by element. Grid-stride loops: any launch
// size covers any n.

template <typename T, typename Ops, typename Op>
__device__ __forceinline__ void combine(T* dst, const T* a, const T* b, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const int V = 16 / (int)sizeof(T);
    u64 done = 0;
    if ((((u64)dst | (u64)a | (u64)b) & 15u) == 0) {
        const u64 vectors = n / V;
        for (u64 v = first; v < vectors; v += stride) {
            uint4 va = ((const uint4*)a)[v];
            uint4 vb = ((const uint4*)b)[v];
            uint4 out;
            const T* ea = (const T*)&va;
            const T* eb = (const T*)&vb;
            T* eo = (T*)&out;
#pragma unroll
            for (int k = 0; k < V; k++) {
                eo[k] = Ops::apply(Op(), ea[k], eb[k]);
            }
            ((uint4*)dst)[v] = out;
        }
        done = vectors * V;
    }
    for (u64 i = done + first; i < n; i += stride) {
        dst[i] = Ops::apply(Op(), a[i], b[i]);
    }
}

// ---- divide: the last step of Avg -----------------------------------------

template <typename T> __device__ __forceinline__ T divide_one(T x, u64 world);
template <> __device__ __forceinline__ signed char divide_one(signed char x, u64 w) { return (signed char)((i64)x / (i64)w); }
template <> __device__ __forceinline__ unsigned char divide_one(unsigned char x, u64 w) { return (unsigned char)((u64)x / w); }
template <> __device__ __forceinline__ int divide_one(int x, u64 w) { return (int)((i64)x / (i64)w); }
template <> __device__ __forceinline__ u32 divide_one(u32 x, u64 w) { return (u32)((u64)x / w); }
template <> __device__ __forceinline__ i64 divide_one(i64 x, u64 w) { return x / (i64)w; }
template <> __device__ __forceinline__ u64 divide_one(u64 x, u64 w) { return x / w; }
template <> __device__ __forceinline__ float divide_one(float x, u64 w) { return x / (float)w; }
template <> __device__ __forceinline__ double divide_one(double x, u64 w) { return x / (double)w; }

template <typename T> __device__ __forceinline__ void divide(T* x, u64 n, u64 world) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = divide_one<T>(x[i], world);
    }
}

__device__ __forceinline__ void divide_f16(u16* x, u64 n, u64 world) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = f32_to_f16(f16_to_f32(x[i]) / (float)world);
    }
}

__device__ __forceinline__ void divide_bf16(u16* x, u64 n, u64 world) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = f32_to_bf16(bf16_to_f32(x[i]) / (float)world);
    }
}

// ---- reduce_peers: one rank's chunk, read from every rank, written to one
// or all of them ---------------------------------------------------------
//
// The peer-direct all-reduce and reduce-scatter (src/cuda/lower.rs): ranks
// that can address each other's buffers (one process, same GPU or peer
// access) skip the ring's staging. The rank owning chunk c reads it from
// every rank's input, in the ring's order, c+1, c+2, ..., c, folding
// acc = x[c+k] (+) acc exactly as the ring's receive-reduce steps do (local
// operand first, the partial result second, rounded to T at every step), so
// the bits are the ring's. Avg divides the result once, as the ring's owner
// does, then it is written to every destination.

#define MAX_PEERS 8
struct Ptrs {
    u64 p[MAX_PEERS];
};

template <typename T> struct DivideOps {
    __device__ static __forceinline__ T finish(T x, u64 world) { return divide_one<T>(x, world); }
};
struct DivideF16 {
    __device__ static __forceinline__ u16 finish(u16 x, u64 world) {
        return f32_to_f16(f16_to_f32(x) / (float)world);
    }
};
struct DivideBf16 {
    __device__ static __forceinline__ u16 finish(u16 x, u64 world) {
        return f32_to_bf16(bf16_to_f32(x) / (float)world);
    }
};

// srcs.p[0..nsrc) in folding order; dsts.p[0..ndst); divide_by 0 = no divide.
// One element of the fold: what the vector body does per lane, and the
// scalar head and tail.
template <typename T, typename Ops, typename Op, typename Div>
__device__ __forceinline__ T fold_one(const Ptrs& srcs, u32 nsrc, u64 i, u64 divide_by) {
    T acc = ((const T*)srcs.p[0])[i];
#pragma unroll 1
    for (u32 k = 1; k < nsrc; k++) acc = Ops::apply(Op(), ((const T*)srcs.p[k])[i], acc);
    if (divide_by != 0) acc = Div::finish(acc, divide_by);
    return acc;
}

template <typename T, typename Ops, typename Op, typename Div>
__device__ __forceinline__ void reduce_peers(Ptrs srcs, u32 nsrc, Ptrs dsts, u32 ndst, u64 n,
                                             u64 divide_by) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const int V = 16 / (int)sizeof(T);
    // Every rank's chunk sits at the same offset of buffers that are
    // usually allocated alike, so the pointers usually share their
    // misalignment: a scalar head then brings all of them to 16 bytes.
    const u64 mis = srcs.p[0] & 15u;
    bool same = true;
    for (u32 k = 0; k < nsrc; k++) same = same && (srcs.p[k] & 15u) == mis;
    for (u32 k = 0; k < ndst; k++) same = same && (dsts.p[k] & 15u) == mis;
    u64 head = same ? ((16u - mis) & 15u) / sizeof(T) : n;
    if (head > n) head = n;
    const u64 vectors = (n - head) / V;
    const u64 tail = head + vectors * V;
    for (u64 i = first; i < head; i += stride) {
        T acc = fold_one<T, Ops, Op, Div>(srcs, nsrc, i, divide_by);
        for (u32 k = 0; k < ndst; k++) ((T*)dsts.p[k])[i] = acc;
    }
    // Two vectors per thread per pass, a grid apart, so that both loads of
    // each source are in flight together. The launch gives one thread per
    // vector up to 4 blocks per multiprocessor, so the second vector is
    // there only for chunks larger than that grid (≈ 8 MiB on an H200),
    // where the bandwidth is decided.
    for (u64 v = first; v < vectors; v += 2 * stride) {
        const u64 v2 = v + stride;
        const bool two = v2 < vectors;
        const u64 at = head * sizeof(T) + v * 16u;
        const u64 at2 = head * sizeof(T) + v2 * 16u;
        uint4 acc = *(const uint4*)(srcs.p[0] + at);
        uint4 acc2 = acc;
        if (two) acc2 = *(const uint4*)(srcs.p[0] + at2);
        T* ea = (T*)&acc;
        T* ea2 = (T*)&acc2;
        // Not unrolled: nsrc is small and the body, for halves, large.
#pragma unroll 1
        for (u32 k = 1; k < nsrc; k++) {
            uint4 x = *(const uint4*)(srcs.p[k] + at);
            uint4 x2 = x;
            if (two) x2 = *(const uint4*)(srcs.p[k] + at2);
            const T* ex = (const T*)&x;
            const T* ex2 = (const T*)&x2;
#pragma unroll
            for (int i = 0; i < V; i++) {
                ea[i] = Ops::apply(Op(), ex[i], ea[i]);
                ea2[i] = Ops::apply(Op(), ex2[i], ea2[i]);
            }
        }
        if (divide_by != 0) {
#pragma unroll
            for (int i = 0; i < V; i++) {
                ea[i] = Div::finish(ea[i], divide_by);
                ea2[i] = Div::finish(ea2[i], divide_by);
            }
        }
        for (u32 k = 0; k < ndst; k++) {
            *(uint4*)(dsts.p[k] + at) = acc;
            if (two) *(uint4*)(dsts.p[k] + at2) = acc2;
        }
    }
    for (u64 i = tail + first; i < n; i += stride) {
        T acc = fold_one<T, Ops, Op, Div>(srcs, nsrc, i, divide_by);
        for (u32 k = 0; k < ndst; k++) ((T*)dsts.p[k])[i] = acc;
    }
}

// ---- the entry points: oxccl_combine_<dtype>_<op>, oxccl_divide_<dtype>,
// oxccl_reduce_peers_<dtype>_<op>
//
// dtype names are oxccl's (DType::name in src/types.rs): int8 uint8 int32
// uint32 int64 uint64 half float double bfloat16.

#define COMBINE(NAME, T, OPS, OP)                                                     \
    extern "C" __global__ void oxccl_combine_##NAME##_##OP(T* dst, const T* a,        \
                                                          const T* b, u64 n) {        \
        combine<T, OPS, OP>(dst, a, b, n);                                            \
    }

#define REDUCE_PEERS(NAME, T, OPS, OP, DIV)                                            \
    extern "C" __global__ void oxccl_reduce_peers_##NAME##_##OP(                        \
        Ptrs srcs, u32 nsrc, Ptrs dsts, u32 ndst, u64 n, u64 divide_by) {               \
        reduce_peers<T, OPS, OP, DIV>(srcs, nsrc, dsts, ndst, n, divide_by);            \
    }

#define ALL_OPS(NAME, T, OPS, DIV)          \
    COMBINE(NAME, T, OPS, Sum)              \
    COMBINE(NAME, T, OPS, Prod)             \
    COMBINE(NAME, T, OPS, Min)              \
    COMBINE(NAME, T, OPS, Max)              \
    REDUCE_PEERS(NAME, T, OPS, Sum, DIV)    \
    REDUCE_PEERS(NAME, T, OPS, Prod, DIV)   \
    REDUCE_PEERS(NAME, T, OPS, Min, DIV)    \
    REDUCE_PEERS(NAME, T, OPS, Max, DIV)

typedef IntOps<signed char, unsigned char> I8Ops;
typedef IntOps<unsigned char, unsigned char> U8Ops;
typedef IntOps<int, u32> I32Ops;
typedef IntOps<u32, u32> U32Ops;
typedef IntOps<i64, u64> I64Ops;
typedef IntOps<u64, u64> U64Ops;
typedef FloatOps<float> F32Ops;
typedef FloatOps<double> F64Ops;

ALL_OPS(int8, signed char, I8Ops, DivideOps<signed char>)
ALL_OPS(uint8, unsigned char, U8Ops, DivideOps<unsigned char>)
ALL_OPS(int32, int, I32Ops, DivideOps<int>)
ALL_OPS(uint32, u32, U32Ops, DivideOps<u32>)
ALL_OPS(int64, i64, I64Ops, DivideOps<i64>)
ALL_OPS(uint64, u64, U64Ops, DivideOps<u64>)
ALL_OPS(half, u16, F16Ops, DivideF16)
ALL_OPS(float, float, F32Ops, DivideOps<float>)
ALL_OPS(double, double, F64Ops, DivideOps<double>)
ALL_OPS(bfloat16, u16, Bf16Ops, DivideBf16)

#define DIVIDE(NAME, T)                                                                \
    extern "C" __global__ void oxccl_divide_##NAME(T* x, u64 n, u64 world) {           \
        divide<T>(x, n, world);                                                        \
    }

DIVIDE(int8, signed char)
DIVIDE(uint8, unsigned char)
DIVIDE(int32, int)
DIVIDE(uint32, u32)
DIVIDE(int64, i64)
DIVIDE(uint64, u64)
DIVIDE(float, float)
DIVIDE(double, double)

extern "C" __global__ void oxccl_divide_half(u16* x, u64 n, u64 world) { divide_f16(x, n, world); }
extern "C" __global__ void oxccl_divide_bfloat16(u16* x, u64 n, u64 world) { divide_bf16(x, n, world); }
