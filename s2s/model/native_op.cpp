// The CPU kernels of s2s's operators (schemas defined in s2s.model.native):
// torch.ops.s2s.few_query_attention (native_attention.c), and torch.ops.s2s.bf16_pack and
// bf16_linear (native_linear.c).  s2s.model.native compiles this file against torch's headers,
// links it with the C files (compiled by cc) into one library and loads it into the process.
// A scripted decoder step calls them as it calls any of torch's operators, about 2 us a call,
// where an operator implemented in Python cost the step about 35 us a call (the interpreter
// taking the GIL back, boxing the arguments, ctypes; measured on an Intel Xeon with AMX).
//
// few_query_attention:  out = softmax(c q K^T + M) V,  c = 1/sqrt(d_k) with scale, else 1
//
// q (B, heads, G, d_k) fp32 or bf16 (widened here; the output then rounded back to bf16),
// k, v (B, heads, T_k, d_k) both fp32 or both bf16 (widened as the kernel reads them; every sum
// in fp32), each with a contiguous last dimension (any other strides); mask None, or fp32 or
// bf16 broadcastable to (B, heads, G, T_k).  With columns (B, T) int64 (G = 1, no mask): row
// b's keys are only the rows columns[b, :] of k, v (B', heads, capacity, d_k), K/V row
// b / (B / B'): a beam reading its own ancestors' slots (s2s.model.cache).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

extern "C" int s2s_few_query_attention(const float *q, long q_b, long q_h, long q_g, const void *k, long k_b,
                                       long k_h, long k_s, const void *v, long v_b, long v_h, long v_s,
                                       const float *mask, long m_b, long m_h, long m_g, const int64_t *columns,
                                       long group, long capacity, float *out, long B, long H, long G, long S, long D,
                                       float c, int kv_bf16);

extern "C" void s2s_bf16_pack(const uint16_t *W, long w_row, long N, long K, uint16_t *P);
extern "C" int s2s_bf16_linear(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P,
                               const uint16_t *b, int act, uint16_t *y, long y_row);

namespace {

template <typename T> const uint16_t *bits(const at::Tensor &t)
{
    return reinterpret_cast<const uint16_t *>(t.data_ptr<T>());
}

at::Tensor few_query_attention(const at::Tensor &q_in, const at::Tensor &k, const at::Tensor &v,
                               const std::optional<at::Tensor> &mask_in, bool scale,
                               const std::optional<at::Tensor> &columns_in)
{
    TORCH_CHECK_VALUE(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                          (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
                      "s2s::few_query_attention: q ", q_in.sizes(), " ", q_in.scalar_type(), ", k ", k.sizes(),
                      ": q, k and v 4-dimensional, q fp32 or bf16");
    const at::Tensor q = q_in.scalar_type() == at::kBFloat16 ? q_in.to(at::kFloat) : q_in;
    const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
    int64_t S = k.size(2), group = 1, capacity = S; // q rows per K/V row; the keys a row's columns may name
    at::Tensor columns;
    if (columns_in.has_value()) {
        columns = *columns_in;
        TORCH_CHECK_VALUE(G == 1 && !mask_in.has_value() && columns.dim() == 2 && columns.size(0) == B &&
                              columns.scalar_type() == at::kLong && columns.device().is_cpu() && k.size(0) > 0 &&
                              B % k.size(0) == 0,
                          "s2s::few_query_attention: columns ", columns.sizes(), " ", columns.scalar_type(),
                          " for q ", q.sizes(), ", k ", k.sizes(),
                          ": (B, T) int64, one query per row, no mask, B a multiple of k's rows");
        group = B / k.size(0);
        S = columns.size(1);
        columns = columns.contiguous(); // (the kernel checks each column)
    }
    const bool kv_ok = (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                       v.scalar_type() == k.scalar_type() && k.size(1) == H && k.size(2) == capacity &&
                       k.size(3) == D && k.size(0) * group == B && v.sizes() == k.sizes();
    const bool mask_ok = !mask_in.has_value() || ((mask_in->scalar_type() == at::kFloat ||
                                                   mask_in->scalar_type() == at::kBFloat16) &&
                                                  mask_in->device().is_cpu());
    TORCH_CHECK_VALUE(kv_ok && mask_ok && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
                          q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                      "s2s::few_query_attention: q ", q_in.sizes(), " ", q_in.scalar_type(), ", k ", k.sizes(), " ",
                      k.scalar_type(), ", v ", v.sizes(), " ", v.scalar_type(),
                      ": q fp32 or bf16, k and v both fp32 or both bf16, (B, heads, T, d) alike, each with a "
                      "contiguous last dimension, on the CPU");
    at::Tensor m;
    const float *m_ptr = nullptr;
    int64_t m_b = 0, m_h = 0, m_g = 0;
    if (mask_in.has_value()) {
        m = mask_in->scalar_type() == at::kFloat ? *mask_in : mask_in->to(at::kFloat);
        m = m.expand({B, H, G, S}); // broadcast dimensions get stride 0
        if (m.stride(3) != 1)       // one column broadcast over the keys: the kernel reads a column per key
            m = m.contiguous();
        m_ptr = m.data_ptr<float>();
        m_b = m.stride(0), m_h = m.stride(1), m_g = m.stride(2);
    }
    at::Tensor out = at::empty({B, H, G, D}, q.options());
    const float c = scale ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))) : 1.f;
    const int rc = s2s_few_query_attention(
        q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1),
        k.stride(2), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), m_ptr, m_b, m_h, m_g,
        columns.defined() ? columns.data_ptr<int64_t>() : nullptr, group, capacity, out.data_ptr<float>(), B, H, G, S,
        D, c, k.scalar_type() == at::kBFloat16);
    TORCH_CHECK_VALUE(rc != -2, "s2s::few_query_attention: a column outside 0 .. ", capacity - 1);
    TORCH_CHECK(rc == 0, "s2s::few_query_attention: no memory for the scores");
    return q_in.scalar_type() == at::kBFloat16 ? out.to(at::kBFloat16) : out;
}

// bf16_pack: W (N, K) bf16 -> P (ceil(N/16), ceil(K/32), 512) bf16, native_linear.c's layout
at::Tensor bf16_pack(const at::Tensor &W_in)
{
    TORCH_CHECK_VALUE(W_in.dim() == 2 && W_in.scalar_type() == at::kBFloat16 && W_in.device().is_cpu(),
                      "s2s::bf16_pack: W ", W_in.sizes(), " ", W_in.scalar_type(), ": a bf16 matrix on the CPU");
    const at::Tensor W = W_in.stride(1) == 1 ? W_in : W_in.contiguous();
    const int64_t N = W.size(0), K = W.size(1);
    at::Tensor P = at::empty({(N + 15) / 16, (K + 31) / 32, 512}, W.options());
    s2s_bf16_pack(bits<at::BFloat16>(W), W.stride(0), N, K, reinterpret_cast<uint16_t *>(P.data_ptr<at::BFloat16>()));
    return P;
}

// bf16_linear: y = act(x W^T + b) in bf16, x (..., K) bf16, P = bf16_pack(W), b None or (N),
// K a multiple of 32, on a CPU with AMX (native_linear.c).
// activation and algorithm name oneDNN's post-ops as s2s.model.gemm.POST_OPS does: none and
// relu inside the kernel (before y is rounded to bf16), gelu and swish after it.
at::Tensor bf16_linear(const at::Tensor &x, const at::Tensor &W, const at::Tensor &P,
                       const std::optional<at::Tensor> &b_in, c10::string_view activation,
                       c10::string_view algorithm)
{
    TORCH_CHECK_VALUE(W.dim() == 2 && x.dim() >= 1 && x.size(-1) == W.size(1) && x.scalar_type() == at::kBFloat16 &&
                          x.device().is_cpu(),
                      "s2s::bf16_linear: x ", x.sizes(), " ", x.scalar_type(), ", W ", W.sizes(),
                      ": x bf16 on the CPU, its last dimension W's columns");
    const int64_t N = W.size(0), K = W.size(1);
    TORCH_CHECK_VALUE(P.scalar_type() == at::kBFloat16 && P.is_contiguous() && P.dim() == 3 && P.device().is_cpu() &&
                          P.size(0) == (N + 15) / 16 && P.size(1) == (K + 31) / 32 && P.size(2) == 512,
                      "s2s::bf16_linear: P ", P.sizes(), " is not W ", W.sizes(), " packed by s2s::bf16_pack");
    TORCH_CHECK_VALUE(K > 0 && K % 32 == 0, "s2s::bf16_linear: W ", W.sizes(),
                      ": its columns a positive multiple of 32 (a tile's depth)");
    const bool relu = activation == "relu", none = activation == "none";
    TORCH_CHECK_VALUE(relu || none || activation == "gelu" || activation == "swish",
                      "s2s::bf16_linear: activation ", activation, ": none, relu, gelu or swish");
    TORCH_CHECK_VALUE(activation != "gelu" || algorithm == "none" || algorithm == "tanh",
                      "s2s::bf16_linear: gelu's algorithm ", algorithm, ": none or tanh");
    at::Tensor b;
    if (b_in.has_value()) {
        b = b_in->scalar_type() == at::kBFloat16 ? b_in->contiguous() : b_in->to(at::kBFloat16).contiguous();
        TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == N && b.device().is_cpu(), "s2s::bf16_linear: b ", b.sizes(),
                          " on ", b.device(), " for W ", W.sizes());
    }
    at::Tensor x2 = x.reshape({-1, K});
    if (x2.stride(1) != 1)
        x2 = x2.contiguous();
    const int64_t M = x2.size(0);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M > 0) {
        const int rc = s2s_bf16_linear(bits<at::BFloat16>(x2), x2.stride(0), M, N, K, bits<at::BFloat16>(P),
                                       b.defined() ? bits<at::BFloat16>(b) : nullptr, relu ? 1 : 0,
                                       reinterpret_cast<uint16_t *>(y.data_ptr<at::BFloat16>()), N);
        TORCH_CHECK(rc == 0, "s2s::bf16_linear: no AMX kernel in this library or process (s2s.model.native.linear_isa)");
    }
    if (activation == "gelu")
        y = at::gelu(y, algorithm);
    else if (activation == "swish")
        y = at::silu(y);
    return y.view(shape);
}

} // namespace

TORCH_LIBRARY_IMPL(s2s, CPU, m)
{
    m.impl("few_query_attention", &few_query_attention);
    m.impl("bf16_pack", &bf16_pack);
    m.impl("bf16_linear", &bf16_linear);
}
