// Runs the peer-direct reduction kernels of src/cuda/kernels.cu on the CPU:
// the CUDA source compiled as C++ with a grid of (block, thread) pairs
// played one after another. Checks the kernels' own logic (the fold order,
// the scalar head that aligns commonly misaligned pointers, the two-vector
// body, the tail, every destination written, nothing outside the range)
// against a plain fold with the same operators. The arithmetic itself is
// checked against the host backend on a GPU (tests/cuda_ring_gpu.rs).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__
struct uint4 {
    unsigned x, y, z, w;
};
struct Dim {
    unsigned x;
};
static Dim gridDim, blockDim, blockIdx, threadIdx;
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }

#include KERNELS_CU

typedef void (*Kernel)(Ptrs, u32, Ptrs, u32, u64, u64);

static int failures = 0;

// Every (block, thread) of a grid, one after another: the kernels' threads
// touch disjoint elements, so any order gives the GPU's result.
static void launch(Kernel k, unsigned blocks, unsigned threads, Ptrs s, u32 ns, Ptrs d, u32 nd,
                   u64 n, u64 div) {
    gridDim.x = blocks;
    blockDim.x = threads;
    for (unsigned b = 0; b < blocks; b++) {
        for (unsigned t = 0; t < threads; t++) {
            blockIdx.x = b;
            threadIdx.x = t;
            k(s, ns, d, nd, n, div);
        }
    }
}

// One case: `world` inputs of `n` elements starting `src_skew[r]` elements
// into their allocations, destinations `dst_skew` in; this rank owns chunk
// `owner` and folds owner+1, ..., owner. `Make` turns a double into a T.
template <typename T, typename Ops, typename Op, typename Div, typename Make>
static void check(const char* name, Kernel kernel, Make make, int world, int owner, unsigned n,
                  const int* src_skew, int dst_skew, bool to_all, u64 divide_by) {
    const unsigned pad = 16;
    std::vector<std::vector<T>> in(world, std::vector<T>(n + 2 * pad));
    for (int r = 0; r < world; r++)
        for (unsigned i = 0; i < n + 2 * pad; i++)
            in[r][i] = make(double((r * 131 + i * 17) % 23) - 7.0 + (r + 1) / 3.0);
    const int ndst = to_all ? world : 1;
    T guard = make(99.0);
    std::vector<std::vector<T>> out(ndst, std::vector<T>(n + 2 * pad, guard));
    Ptrs srcs = {}, dsts = {};
    for (int k = 1; k <= world; k++) {
        int r = (owner + k) % world;
        srcs.p[k - 1] = (u64)(in[r].data() + src_skew[r]);
    }
    for (int d = 0; d < ndst; d++) dsts.p[d] = (u64)(out[d].data() + dst_skew);
    launch(kernel, 3, 7, srcs, world, dsts, ndst, n, divide_by);
    for (unsigned i = 0; i < n; i++) {
        T acc = in[(owner + 1) % world][i + src_skew[(owner + 1) % world]];
        for (int k = 2; k <= world; k++) {
            int r = (owner + k) % world;
            acc = Ops::apply(Op(), in[r][i + src_skew[r]], acc);
        }
        if (divide_by != 0) acc = Div::finish(acc, divide_by);
        for (int d = 0; d < ndst; d++) {
            if (memcmp(&out[d][i + dst_skew], &acc, sizeof(T)) != 0 && failures++ < 10)
                printf("%s: world %d n %u element %u of destination %d differs\n", name, world,
                       n, i, d);
        }
    }
    for (int d = 0; d < ndst; d++) {
        for (unsigned i = 0; i < n + 2 * pad; i++) {
            bool inside = i >= (unsigned)dst_skew && i < dst_skew + n;
            if (!inside && memcmp(&out[d][i], &guard, sizeof(T)) != 0 && failures++ < 10)
                printf("%s: world %d n %u wrote outside its range at %u\n", name, world, n, i);
        }
    }
}

template <typename T, typename Ops, typename Op, typename Div, typename Make>
static void every_shape(const char* name, Kernel kernel, Make make, bool divide) {
    const unsigned counts[] = {0, 1, 3, 5, 17, 100, 1000, 4099};
    for (int world = 2; world <= MAX_PEERS; world++) {
        for (unsigned n : counts) {
            for (int skew = 0; skew < 4; skew++) {
                // Every pointer misaligned alike (head, then vectors), or
                // each differently (element by element).
                int same[MAX_PEERS], mixed[MAX_PEERS];
                for (int r = 0; r < MAX_PEERS; r++) {
                    same[r] = skew;
                    mixed[r] = (skew + r) % 3;
                }
                u64 div = divide ? (u64)world : 0;
                int owner = (world + skew) % world;
                check<T, Ops, Op, Div>(name, kernel, make, world, owner, n, same, skew, true, div);
                check<T, Ops, Op, Div>(name, kernel, make, world, owner, n, mixed, 1, false, div);
            }
        }
    }
}

int main() {
    auto f32 = [](double v) { return (float)v; };
    auto f64 = [](double v) { return v; };
    auto i8 = [](double v) { return (signed char)(long)v; };
    auto u64v = [](double v) { return (u64)(long long)v; };
    auto half = [](double v) { return f32_to_f16((float)v); };
    auto bf16 = [](double v) { return f32_to_bf16((float)v); };
    every_shape<float, F32Ops, Sum, DivideOps<float>>("float sum", oxccl_reduce_peers_float_Sum, f32, false);
    every_shape<float, F32Ops, Sum, DivideOps<float>>("float avg", oxccl_reduce_peers_float_Sum, f32, true);
    every_shape<double, F64Ops, Min, DivideOps<double>>("double min", oxccl_reduce_peers_double_Min, f64, false);
    every_shape<signed char, I8Ops, Prod, DivideOps<signed char>>("int8 prod", oxccl_reduce_peers_int8_Prod, i8, false);
    every_shape<u64, U64Ops, Max, DivideOps<u64>>("uint64 max", oxccl_reduce_peers_uint64_Max, u64v, false);
    every_shape<u16, F16Ops, Sum, DivideF16>("half avg", oxccl_reduce_peers_half_Sum, half, true);
    every_shape<u16, Bf16Ops, Prod, DivideBf16>("bfloat16 prod", oxccl_reduce_peers_bfloat16_Prod, bf16, false);
    printf("%d mismatches\n", failures);
    return failures == 0 ? 0 : 1;
}
