// trtbuild CUDA plugins: KV-cache write with fused rotary embedding, and paged attention over a packed batch in
// which every sequence is a prefill chunk or a decode step (in-flight batching).
//
// The semantics are those of the reference ops in toolchain/engine/ops.py (the single definition); test vectors
// made from them (plugins/make_vectors.py) check these kernels on a GPU (plugins/gpu_check.py).
//
// Compiled by NVRTC (toolchain/plugins/compile.py) without the CUDA include tree, so fp16 / bf16 / fp8
// conversions are written here: PTX cvt for fp16 and bf16 (sm_80+), bit arithmetic for fp8 e4m3 (hardware e4m3
// conversion needs sm_89; one code path for every target).
//
// Kernel parameters follow TensorRT's ahead-of-time plugin convention: inputs, then int32 scalars (floats passed
// as their bit patterns), then outputs. The KV pool [layers, blocks, 2, kv_heads, tokens_per_block, head_size] is
// an input that the KV write updates in place (the engine binds one pool; see toolchain/engine/contract.py).

typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 x; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f)); return x; }
__device__ __forceinline__ float b2f(u16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ u16 f2b(float f) { u16 x; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f)); return x; }

// fp8 e4m3fn (OCP): bias 7, no infinities, 0x7f / 0xff are NaN, largest finite 448.
__device__ __forceinline__ float e4m3_to_f(u8 v) {
    unsigned e = (v >> 3) & 0xF, m = v & 7;
    float r;
    if (e == 0) r = (float)m * 0.001953125f;  // subnormal: m / 8 * 2^-6
    else if (e == 15 && m == 7) r = __int_as_float(0x7fc00000);
    else r = __uint_as_float(((e + 120) << 23) | (m << 20));
    return (v & 0x80) ? -r : r;
}

// Saturating (|x| > 448 -> 448, as the reference clamps before casting), round to nearest even.
__device__ __forceinline__ u8 f_to_e4m3(float f) {
    unsigned sign = (__float_as_uint(f) >> 24) & 0x80;
    float a = fabsf(f);
    if (a != a) return 0x7f;
    if (a >= 448.f) return sign | 0x7e;
    if (a < 0.015625f) return sign | (unsigned)__float2int_rn(a * 512.f);  // subnormal step 2^-9; 8 = 2^-6
    unsigned bits = __float_as_uint(a);
    bits += 0x7FFFF + ((bits >> 20) & 1);  // round the mantissa to 3 bits, ties to even
    unsigned e = (bits >> 23) - 120, m = (bits >> 20) & 7;
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7e;
    return sign | (e << 3) | m;
}

struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T x, float) { return h2f(x); }
    static __device__ __forceinline__ T store(float f, float) { return f2h(f); }
};
struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(T x, float) { return b2f(x); }
    static __device__ __forceinline__ T store(float f, float) { return f2b(f); }
};
struct FP8 {
    typedef u8 T;
    static __device__ __forceinline__ float load(T x, float scale) { return e4m3_to_f(x) * scale; }
    static __device__ __forceinline__ T store(float f, float scale) { return f_to_e4m3(f / scale); }
};
struct INT8 {
    typedef i8 T;
    static __device__ __forceinline__ float load(T x, float scale) { return (float)x * scale; }
    static __device__ __forceinline__ T store(float f, float scale) {
        return (T)max(-128, min(127, __float2int_rn(f / scale)));
    }
};

// The sequence that packed token t belongs to, and where that sequence's tokens start.
__device__ __forceinline__ void find_sequence(const int* new_lens, int num_seqs, int t, int* seq, int* start) {
    int acc = 0;
    for (int s = 0; s < num_seqs; ++s) {
        if (t < acc + new_lens[s]) { *seq = s; *start = acc; return; }
        acc += new_lens[s];
    }
    *seq = -1; *start = acc;
}

// Rotary inverse frequency of pair i, with linear or Llama-3 scaling (toolchain/reference/rope.py).
__device__ __forceinline__ float inv_freq(int i, int head_size, float base, int scaling, float factor, float low,
                                          float high, float original) {
    float freq = powf(base, -2.f * (float)i / (float)head_size);
    if (scaling == 1) return freq / factor;
    if (scaling == 2) {
        float wavelen = 6.283185307179586f / freq;
        if (wavelen > original / low) return freq / factor;
        if (wavelen < original / high) return freq;
        float smooth = (original / wavelen - low) / (high - low);
        return (1.f - smooth) * freq / factor + smooth * freq;
    }
    return freq;
}

__device__ __forceinline__ size_t pool_offset(int layer, int num_blocks, int block, int kv, int kv_heads, int head,
                                              int tpb, int slot, int head_size) {
    return ((((size_t)layer * num_blocks + block) * 2 + kv) * kv_heads + head) * (size_t)tpb * head_size +
           (size_t)slot * head_size;
}

// One block per new token: rotary on its q and k heads (q written out), k and v stored at its slot.
template <class A, class KV>
__device__ void kv_write(const typename A::T* qkv, const int* position_ids, const int* new_lens,
                         const int* block_tables, int num_seqs, int max_blocks, int num_blocks, int layer, int heads,
                         int kv_heads, int head_size, int tpb, int rotary, float base, int scaling, float factor,
                         float low, float high, float original, float kv_scale, typename A::T* q_out,
                         typename KV::T* pool) {
    __shared__ int seq_s, start_s;
    const int t = blockIdx.x;
    if (threadIdx.x == 0) find_sequence(new_lens, num_seqs, t, &seq_s, &start_s);
    __syncthreads();
    if (seq_s < 0) return;
    const int p = position_ids[t];
    const int block = block_tables[(size_t)seq_s * max_blocks + p / tpb], slot = p % tpb;
    const int half = head_size / 2, width = (heads + 2 * kv_heads) * head_size;
    const typename A::T* row = qkv + (size_t)t * width;
    for (int idx = threadIdx.x; idx < (heads + kv_heads) * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        float x1 = A::load(row[h * head_size + i], 1.f), x2 = A::load(row[h * head_size + i + half], 1.f);
        float y1 = x1, y2 = x2;
        if (rotary) {
            float s, c;
            sincosf((float)p * inv_freq(i, head_size, base, scaling, factor, low, high, original), &s, &c);
            y1 = x1 * c - x2 * s;
            y2 = x2 * c + x1 * s;
        }
        if (h < heads) {
            q_out[(size_t)t * heads * head_size + h * head_size + i] = A::store(y1, 1.f);
            q_out[(size_t)t * heads * head_size + h * head_size + i + half] = A::store(y2, 1.f);
        } else {
            size_t o = pool_offset(layer, num_blocks, block, 0, kv_heads, h - heads, tpb, slot, head_size);
            pool[o + i] = KV::store(y1, kv_scale);
            pool[o + i + half] = KV::store(y2, kv_scale);
        }
    }
    for (int idx = threadIdx.x; idx < kv_heads * head_size; idx += blockDim.x) {
        const int h = idx / head_size, d = idx % head_size;
        float v = A::load(row[(heads + kv_heads + h) * head_size + d], 1.f);
        pool[pool_offset(layer, num_blocks, block, 1, kv_heads, h, tpb, slot, head_size) + d] = KV::store(v, kv_scale);
    }
}

#define WARPS 4
#define MAX_GROUP 8  // query heads per block (4 on the generic path, for registers); larger groups take more blocks

// One block per (new token, kv head, chunk of up to MAX_GROUP query heads, split of the key range). Each warp walks
// every WARPS-th key with an online softmax in fp32 for all the block's query heads (K/V read once per kv head);
// the warps merge through shared memory. SPLIT: write the unnormalised partial output and (max, sum) for
// attention_reduce instead of the output. HD: 64 / 128 fast paths, 0 = generic (head_size <= 256). Scores are
// q.k / (sqrt(head_size) * q_scaling), TensorRT-LLM's q_scaling (tensorrt_llm/_torch/modules/attention.py: "qk_scale
// = 1 / (sqrt(head_dim) * q_scaling)"; Gemma: sqrt(query_pre_attn_scalar / head_size)); decode, prefill and split-K
// all come through here.
template <class A, class KV, int HD, bool SPLIT>
__device__ void attention(const typename A::T* q, const int* position_ids, const int* new_lens,
                          const int* block_tables, const typename KV::T* pool, int num_seqs, int max_blocks,
                          int num_blocks, int layer, int heads, int kv_heads, int head_size, int tpb, int window,
                          float kv_scale, float q_scaling, int num_splits, typename A::T* out, float* part_o,
                          float* part_ml) {
    constexpr int E = HD ? HD / 32 : 8;
    constexpr int MG = HD ? MAX_GROUP : MAX_GROUP / 2;
    __shared__ int seq_s, start_s;
    __shared__ float sm_m[WARPS][MAX_GROUP], sm_l[WARPS][MAX_GROUP];
    __shared__ float sm_o[WARPS][MAX_GROUP][HD ? HD : 256];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = heads / kv_heads, chunks = (group + MG - 1) / MG;
    const int kvh = blockIdx.y / chunks, g0 = (blockIdx.y % chunks) * MG;
    const int G = min(MG, group - g0), split = blockIdx.z;
    if (threadIdx.x == 0) find_sequence(new_lens, num_seqs, t, &seq_s, &start_s);
    __syncthreads();
    if (seq_s < 0) return;
    const int p = position_ids[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int per = (p - lo + num_splits) / num_splits;
    const int k_begin = lo + split * per, k_end = min(p + 1, k_begin + per);
    const float scale = rsqrtf((float)head_size) / q_scaling;  // applied to q once (the reference: to the scores)

    float qr[MG][E], acc[MG][E], m[MG], l[MG];
#pragma unroll
    for (int g = 0; g < MG; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane + 32 * e;
            const bool ok = g < G && d < head_size;
            qr[g][e] = ok ? A::load(q[((size_t)t * heads + kvh * group + g0 + g) * head_size + d], 1.f) * scale : 0.f;
            acc[g][e] = 0.f;
        }
    }
    for (int j = k_begin + warp; j < k_end; j += WARPS) {
        const int block = block_tables[(size_t)seq_s * max_blocks + j / tpb], slot = j % tpb;
        const size_t ko = pool_offset(layer, num_blocks, block, 0, kv_heads, kvh, tpb, slot, head_size);
        const size_t vo = pool_offset(layer, num_blocks, block, 1, kv_heads, kvh, tpb, slot, head_size);
        float k[E], v[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane + 32 * e;
            k[e] = d < head_size ? KV::load(pool[ko + d], kv_scale) : 0.f;
            v[e] = d < head_size ? KV::load(pool[vo + d], kv_scale) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < MG; ++g) {
            if (g >= G) break;
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) dot += qr[g][e] * k[e];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            const float m_new = fmaxf(m[g], dot), corr = __expf(m[g] - m_new), w = __expf(dot - m_new);
            l[g] = l[g] * corr + w;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + w * v[e];
            m[g] = m_new;
        }
    }
    // merge the warps
#pragma unroll
    for (int g = 0; g < MG; ++g) {
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane + 32 * e;
            if (d < (HD ? HD : 256)) sm_o[warp][g][d] = acc[g][e];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * head_size; idx += blockDim.x) {
        const int g = idx / head_size, d = idx % head_size;
        float mx = NEG_INF;
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float sum = 0.f, o = 0.f;
        if (mx != NEG_INF) {
            for (int w = 0; w < WARPS; ++w) {
                const float c = __expf(sm_m[w][g] - mx);
                sum += sm_l[w][g] * c;
                o += sm_o[w][g][d] * c;
            }
        }
        const size_t head = (size_t)t * heads + kvh * group + g0 + g;
        if (SPLIT) {
            part_o[(head * num_splits + split) * head_size + d] = o;
            if (d == 0) { part_ml[(head * num_splits + split) * 2] = mx; part_ml[(head * num_splits + split) * 2 + 1] = sum; }
        } else {
            out[head * head_size + d] = A::store(sum > 0.f ? o / sum : 0.f, 1.f);
        }
    }
}

// Merge the splits of each (token, head) by their log-sum-exp.
template <class A>
__device__ void attention_reduce(const float* part_o, const float* part_ml, int num_tokens, int heads, int head_size,
                                 int num_splits, typename A::T* out) {
    const size_t head = blockIdx.x;
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float mx = NEG_INF;
        for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_ml[(head * num_splits + s) * 2]);
        float sum = 0.f, o = 0.f;
        for (int s = 0; s < num_splits; ++s) {
            const float ms = part_ml[(head * num_splits + s) * 2];
            if (ms == NEG_INF) continue;
            const float c = __expf(ms - mx);
            sum += part_ml[(head * num_splits + s) * 2 + 1] * c;
            o += part_o[(head * num_splits + s) * head_size + d] * c;
        }
        out[head * head_size + d] = A::store(sum > 0.f ? o / sum : 0.f, 1.f);
    }
}

// ---- extern "C" entry points, one per (activation, kv cache, head dim) ------------------------------------------

#define KV_WRITE(NAME, A, KV)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                          \
        const A::T* qkv, const int* position_ids, const int* context_lens, const int* new_lens,                      \
        const int* block_tables, KV::T* kv, int num_tokens, int num_seqs, int max_blocks, int num_blocks,            \
        int layer, int heads, int kv_heads, int head_size, int tpb, int rotary, int base_bits, int scaling,          \
        int factor_bits, int low_bits, int high_bits, int original, int kv_scale_bits, A::T* q_out) {                \
        kv_write<A, KV>(qkv, position_ids, new_lens, block_tables, num_seqs, max_blocks, num_blocks, layer, heads,    \
                        kv_heads, head_size, tpb, rotary, __int_as_float(base_bits), scaling,                        \
                        __int_as_float(factor_bits), __int_as_float(low_bits), __int_as_float(high_bits),            \
                        (float)original, __int_as_float(kv_scale_bits), q_out, kv);                                   \
    }

#define ATTENTION(NAME, A, KV, HD)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                          \
        const A::T* q, const int* position_ids, const int* context_lens, const int* new_lens,                        \
        const int* block_tables, const KV::T* kv, int num_tokens, int num_seqs, int max_blocks, int num_blocks,      \
        int layer, int heads, int kv_heads, int head_size, int tpb, int window, int kv_scale_bits,                   \
        int q_scaling_bits, A::T* out) {                                                                              \
        attention<A, KV, HD, false>(q, position_ids, new_lens, block_tables, kv, num_seqs, max_blocks, num_blocks,   \
                                    layer, heads, kv_heads, head_size, tpb, window, __int_as_float(kv_scale_bits),   \
                                    __int_as_float(q_scaling_bits), 1, out, nullptr, nullptr);                       \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) NAME##_split(                                                  \
        const A::T* q, const int* position_ids, const int* context_lens, const int* new_lens,                        \
        const int* block_tables, const KV::T* kv, int num_tokens, int num_seqs, int max_blocks, int num_blocks,      \
        int layer, int heads, int kv_heads, int head_size, int tpb, int window, int kv_scale_bits,                   \
        int q_scaling_bits, int num_splits, float* part_o, float* part_ml) {                                          \
        attention<A, KV, HD, true>(q, position_ids, new_lens, block_tables, kv, num_seqs, max_blocks, num_blocks,    \
                                   layer, heads, kv_heads, head_size, tpb, window, __int_as_float(kv_scale_bits),    \
                                   __int_as_float(q_scaling_bits), num_splits, nullptr, part_o, part_ml);            \
    }

#define ALL_HEAD_DIMS(PREFIX, A, KV)     \
    ATTENTION(PREFIX##_hd64, A, KV, 64)   \
    ATTENTION(PREFIX##_hd128, A, KV, 128) \
    ATTENTION(PREFIX##_generic, A, KV, 0)

KV_WRITE(trtbuild_kv_write_f16_f16, F16, F16)
KV_WRITE(trtbuild_kv_write_f16_fp8, F16, FP8)
KV_WRITE(trtbuild_kv_write_f16_int8, F16, INT8)
KV_WRITE(trtbuild_kv_write_bf16_bf16, BF16, BF16)
KV_WRITE(trtbuild_kv_write_bf16_fp8, BF16, FP8)
KV_WRITE(trtbuild_kv_write_bf16_int8, BF16, INT8)

ALL_HEAD_DIMS(trtbuild_attention_f16_f16, F16, F16)
ALL_HEAD_DIMS(trtbuild_attention_f16_fp8, F16, FP8)
ALL_HEAD_DIMS(trtbuild_attention_f16_int8, F16, INT8)
ALL_HEAD_DIMS(trtbuild_attention_bf16_bf16, BF16, BF16)
ALL_HEAD_DIMS(trtbuild_attention_bf16_fp8, BF16, FP8)
ALL_HEAD_DIMS(trtbuild_attention_bf16_int8, BF16, INT8)

extern "C" __global__ void __launch_bounds__(128) trtbuild_attention_reduce_f16(
    const float* part_o, const float* part_ml, int num_tokens, int heads, int head_size, int num_splits, u16* out) {
    attention_reduce<F16>(part_o, part_ml, num_tokens, heads, head_size, num_splits, out);
}
extern "C" __global__ void __launch_bounds__(128) trtbuild_attention_reduce_bf16(
    const float* part_o, const float* part_ml, int num_tokens, int heads, int head_size, int num_splits, u16* out) {
    attention_reduce<BF16>(part_o, part_ml, num_tokens, heads, head_size, num_splits, out);
}
