// The only file that knows torch: registers the EXL3 kernels as ops in the `vllm_exl3` namespace (a fragment, so it
// coexists with the Python-defined ops of kernels/ops.py) and builds the Python module `vllm_exl3._C`.
//
// Ops (fake implementations live in plugin/vllm_exl3/kernels/backends/native.py):
//   native_linear(x, trellis, suh, svh, codebook, in_offset, out_offset, out_features, path) -> y
//       path: exl3::Path (planner.h); 0 auto asks plan_linear_path, the others force one path
//   native_linear_group(x, trellis[], suh[], svh[], codebook, path) -> y: 2..4 whole linears of one input (q, k, v)
//       side by side, two launches on the skinny path up to 8 rows (native_linear_group below)
//   reconstruct(trellis, codebook, suh?, svh?, bf16) -> Ŵ (no suh/svh; bit-exact) or W (original basis)
//   small_linear(x, weight, out_fp32) -> x W^T for a 16-bit weight at up to 16 rows (a MoE router's gate)
//   build_info() -> str ; device_check() -> str ("" when the current device can run the kernels)
//   native_linear_traced(same as native_linear) -> (y, trace): bench/kernels.py --trace only, never on the serving
//       path; trace [blocks, warps, {smid, entry, first data, loop end, exit}] per-warp timestamps of the skinny
//       launch ([0, warps, 5] when the call took another path)
// The module object is all this file asks of Python, so it builds against the stable ABI: one `_C.abi3.so` per
// torch build, whatever the Python (setup.py's LIMITED_API_TAG; tools/build-kernels builds it without that Python).
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <algorithm>
#include <climits>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include "env.h"
#include "exl3_kernels.h"
#include "planner.h"
#include "torch_glue.h"

namespace {

using exl3::align256;
using exl3::glue::check_cuda, exl3::glue::kHad, exl3::glue::kTile, exl3::glue::use_pdl;

using exl3::Path;
using exl3::kAuto, exl3::kSkinny, exl3::kReconstruct, exl3::kSkinnySplit, exl3::kSkinnyDirect,
    exl3::kSkinnyPlain, exl3::kPanel, exl3::kReconOriginal;

exl3::TrellisView trellis_view(const at::Tensor& t, int64_t codebook) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kShort && t.dim() == 3, "trellis must be a CUDA int16 [K/16, N/16, 16*bits] tensor");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) % 8 == 0 && t.stride(0) % 8 == 0,
              "trellis tiles must be 16-byte aligned records (stride(2) == 1, other strides multiples of 8)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
  const int64_t words = t.size(2);
  TORCH_CHECK(words % 8 == 0 && words >= 16 && words <= 128, "trellis last dim must be 16*bits (bits 1..8, or 1.5/2.5/3.5)");
  const int bits2 = static_cast<int>(words / 8);
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook index must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  TORCH_CHECK(bits2 % 2 == 0 || (codebook == exl3::kCbMul1 && bits2 <= 7), "half-integer bit widths need mul1, <= 3.5");
  return {t.data_ptr<int16_t>(), t.stride(0), static_cast<int>(t.stride(1)), bits2, static_cast<int>(codebook)};
}

int act_dtype(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "activations must be fp16 or bf16");
  return x.scalar_type() == at::kBFloat16 ? exl3::kActBF16 : exl3::kActF16;
}

// y[M][N] = a[M][K] . W[K][N] (row-major, a's dtype throughout, W with row stride ldw elements, fp32 accumulate)
// == column-major Y^T = W^T . A^T.
void cublas_gemm(const at::Tensor& a, const void* w, int64_t ldw, at::Tensor& y) {
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const cudaDataType_t dt = a.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const int m = static_cast<int>(y.size(1)), n = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1));
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, w, dt, static_cast<int>(ldw),
                                         a.data_ptr(), dt, static_cast<int>(a.stride(0)), &beta, y.data_ptr(), dt,
                                         static_cast<int>(y.stride(0)), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "vllm_exl3: cublasGemmEx failed (status ", static_cast<int>(st), ")");
}

// The skinny path's workspace, one allocation: the transformed input (xh_bytes), mul1's row sums (rs_bytes, or 0),
// the split-K partials and counters the plan needs; points the input transform and the GEMM at their parts.
at::Tensor skinny_workspace(const at::Tensor& like, size_t xh_bytes, size_t rs_bytes, const exl3::GemmPlan& plan,
                            int parts, exl3::InputTransformArgs& it, exl3::GemmArgs& sa) {
  const size_t part_bytes = align256(plan.partial_bytes), cnt_bytes = align256(plan.counter_bytes);
  at::Tensor ws = at::empty({static_cast<int64_t>(xh_bytes + rs_bytes + part_bytes + cnt_bytes)},
                            like.options().dtype(at::kByte));
  char* base = static_cast<char*>(ws.data_ptr());
  it.xh = base;
  it.xh_dtype = exl3::kActF16;
  it.scale = exl3::kHadScale;
  it.rowsum_parts = rs_bytes ? reinterpret_cast<float*>(base + xh_bytes) : nullptr;
  if (plan.split_k) {  // only the counters need zeros; every partial slot is written before it is read
    sa.partials = reinterpret_cast<float*>(base + xh_bytes + rs_bytes);
    sa.max_slots = plan.max_slots;
    sa.counters = reinterpret_cast<int*>(base + xh_bytes + rs_bytes + part_bytes);
    it.zero = sa.counters;
    it.zero_bytes = cnt_bytes;
  }
  sa.xh = it.xh;
  sa.rowsum_parts = it.rowsum_parts;
  sa.parts = parts;
  return ws;
}

// native_linear's body. `trace`: null on the serving path; native_linear_traced passes a tensor that a skinny launch
// fills with per-warp timestamps (exl3::GemmArgs::trace).
at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                       int64_t codebook, int64_t in_offset, int64_t out_offset, int64_t out_features, int64_t path,
                       at::Tensor* trace) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a 2-D CUDA tensor");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int xdt = act_dtype(x);
  const exl3::TrellisView w = trellis_view(trellis, codebook);
  const int64_t k_in = trellis.size(0) * kTile, n_out = trellis.size(1) * kTile;
  TORCH_CHECK(k_in % kHad == 0 && n_out % kHad == 0, "EXL3 linears are padded to 128 on both sides");
  TORCH_CHECK(suh.scalar_type() == at::kHalf && suh.is_contiguous() && suh.numel() == k_in, "suh must be fp16 [K]");
  TORCH_CHECK(svh.scalar_type() == at::kHalf && svh.is_contiguous() && svh.numel() == n_out, "svh must be fp16 [N]");
  const int64_t rows = x.size(0), in_width = x.size(1);
  TORCH_CHECK(in_offset >= 0 && in_offset + in_width <= k_in, "input columns [", in_offset, ", ", in_offset + in_width,
              ") outside the stored width ", k_in);
  TORCH_CHECK(out_offset >= 0 && out_features >= 0 && out_offset + out_features <= n_out, "output columns outside N");
  TORCH_CHECK(rows < (1LL << 31), "too many rows");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  const int64_t kb0 = in_offset / kHad, kb_count = in_width == 0 ? 0 : (in_offset + in_width + kHad - 1) / kHad - kb0;
  const int64_t g0 = out_offset / kHad, groups = (out_offset + out_features + kHad - 1) / kHad - g0;
  if (kb_count == 0) {
    // A zero input: y = H(0) * svh = 0 (the skinny kernel's split-K path needs at least one k-tile).
    y.zero_();
    return y;
  }
  if (path == kAuto) {
    const int r = static_cast<int>(std::min<int64_t>(rows, 1 << 30));
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    const exl3::LinearShape shape{rows, kb_count * kHad * groups * kHad * 2, groups * kHad, prop->major,
                                  prop->l2CacheSize};
    path = exl3::plan_linear_path(shape,
                                  [&](bool panel) { return exl3::gemm_fits_device(w.codebook, w.bits2, r, panel); });
  }

  const int64_t ka = kb_count * kHad, na = groups * kHad;

  if (path == kReconOriginal) {
    // W in the original basis of the active part, then y = x . W[x's input columns, output columns]: no input
    // transform (when `auto` takes it: planner.cpp).
    at::Tensor w_full = at::empty({ka, na}, x.options());
    exl3::ReconstructArgs ra{w, static_cast<int>(kb0), static_cast<int>(kb_count), static_cast<int>(g0),
                             static_cast<int>(groups), w_full.data_ptr(), xdt, svh.data_ptr(), suh.data_ptr()};
    check_cuda(exl3::launch_reconstruct(ra, false, stream), "reconstruct (original basis)");
    const void* w_sub = static_cast<const char*>(w_full.data_ptr()) +
                        ((in_offset - kb0 * kHad) * na + (out_offset - g0 * kHad)) * x.element_size();
    cublas_gemm(x, w_sub, na, y);
    return y;
  }

  exl3::InputTransformArgs it{};
  it.x = x.data_ptr();
  it.x_dtype = xdt;
  it.x_stride = x.stride(0);
  it.rows = static_cast<int>(rows);
  it.in_width = static_cast<int>(in_width);
  it.in_offset = static_cast<int>(in_offset);
  it.suh = suh.data_ptr();
  it.kb0 = static_cast<int>(kb0);
  it.kb_count = static_cast<int>(kb_count);

  if (path == kReconstruct) {
    // xh in x's dtype, W' = Ŵ H diag(svh) of the active part, then y = xh . W'[:, output columns] straight from
    // cuBLAS: no output transform, no intermediate.
    at::Tensor xh = at::empty({rows, ka}, x.options());
    it.xh_rows = static_cast<int>(rows);
    it.xh = xh.data_ptr();
    it.xh_dtype = xdt;
    it.scale = exl3::kReconInputScale;
    at::Tensor w_out = at::empty({ka, na}, x.options());
    exl3::ReconstructArgs ra{w, static_cast<int>(kb0), static_cast<int>(kb_count), static_cast<int>(g0),
                             static_cast<int>(groups), w_out.data_ptr(), xdt, svh.data_ptr(), nullptr};
    // The two are independent; the second starts behind the first (programmatic dependent launch) and fills the
    // SMs the first leaves idle. Reconstruct first (default): the input transform fills the reconstruct's last wave,
    // a few µs less per call at 128-512 rows than the other order (bench/NOTES.md, "Launch order and PDL";
    // VLLM_EXL3_RECON_FIRST=0 for the comparison).
    if (exl3::env::recon_first()) {
      check_cuda(exl3::launch_reconstruct(ra, false, stream), "reconstruct (output side)");
      check_cuda(exl3::launch_input_transform(it, use_pdl(), stream), "input transform");
    } else {
      check_cuda(exl3::launch_input_transform(it, false, stream), "input transform");
      check_cuda(exl3::launch_reconstruct(ra, use_pdl(), stream), "reconstruct (output side)");
    }
    const void* w_cols = static_cast<const char*>(w_out.data_ptr()) + (out_offset - g0 * kHad) * x.element_size();
    cublas_gemm(xh, w_cols, na, y);
    return y;
  }

  TORCH_CHECK(path == kSkinny || path == kSkinnySplit || path == kSkinnyDirect || path == kSkinnyPlain ||
                  path == kPanel,
              "unknown path ", path);
  exl3::GemmArgs sa{};
  sa.w = w;
  sa.svh = svh.data_ptr();
  sa.y = y.data_ptr();
  sa.y_dtype = xdt;
  sa.y_stride = y.stride(0);
  sa.out_offset = static_cast<int>(out_offset);
  sa.out_features = static_cast<int>(out_features);
  sa.rows = static_cast<int>(rows);
  sa.kb0 = static_cast<int>(kb0);
  sa.kb_count = static_cast<int>(kb_count);
  sa.g0 = static_cast<int>(g0);
  sa.groups = static_cast<int>(groups);
  const exl3::GemmPlan plan = exl3::plan_gemm(sa, path == kSkinnySplit ? 1 : path == kSkinnyDirect ? 0 : -1,
                                                   path == kSkinnyPlain ? 0 : -1, path == kPanel);
  const int64_t xh_rows = static_cast<int64_t>(plan.row_chunks) * plan.rows_per_chunk;
  const int parts = exl3::input_transform_parts(static_cast<int>(kb_count));
  // Per-row sums of xh: only the skinny kernel's mul1 codewords need them (their affine epilogue).
  const bool rowsums = !plan.panel && plan.dup && w.codebook == exl3::kCbMul1;
  it.xh_rows = static_cast<int>(xh_rows);
  const at::Tensor ws = skinny_workspace(x, align256(xh_rows * ka * 2), rowsums ? align256(rows * parts * 4) : 0,
                                         plan, parts, it, sa);
  if (trace != nullptr && !plan.panel) {
    *trace = at::zeros({plan.grid, exl3::kGemmWarps, 5}, x.options().dtype(at::kLong));
    sa.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr());
  }
  check_cuda(exl3::launch_input_transform(it, false, stream), "input transform");
  check_cuda(exl3::launch_gemm(sa, plan, use_pdl(), stream), plan.panel ? "panel GEMM" : "skinny GEMM");
  return y;
}

at::Tensor native_linear(const at::Tensor& x, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                         int64_t codebook, int64_t in_offset, int64_t out_offset, int64_t out_features, int64_t path) {
  return linear_impl(x, trellis, suh, svh, codebook, in_offset, out_offset, out_features, path, nullptr);
}

std::tuple<at::Tensor, at::Tensor> native_linear_traced(const at::Tensor& x, const at::Tensor& trellis,
                                                        const at::Tensor& suh, const at::Tensor& svh, int64_t codebook,
                                                        int64_t in_offset, int64_t out_offset, int64_t out_features,
                                                        int64_t path) {
  at::Tensor trace = at::zeros({0, exl3::kGemmWarps, 5}, x.options().dtype(at::kLong));
  at::Tensor y = linear_impl(x, trellis, suh, svh, codebook, in_offset, out_offset, out_features, path, &trace);
  return {y, trace};
}

// y [rows, sum N_s] = the shards' native_linear outputs side by side, for 2..kMaxGroupShards whole linears that share
// x (width K), K, the codebook and the bit width, each with its own trellis, suh and svh (attention q, k, v). Up to 8
// rows on the skinny path (path auto when the planner gives the skinny kernel to one linear of the total width, or a
// skinny path forced; duplicated-activation codewords): two launches for all shards, the input transform of each
// shard (gridDim.z) and one skinny GEMM whose stream-K work spans every shard's column groups. Otherwise (more rows:
// skinny.cuh says why not 9-16 yet; another path; VLLM_EXL3_SKINNY_DUP=0) one native_linear per shard.
at::Tensor native_linear_group(const at::Tensor& x_in, at::TensorList trellis, at::TensorList suh,
                               at::TensorList svh, int64_t codebook, int64_t path) {
  const int64_t shards = static_cast<int64_t>(trellis.size());
  TORCH_CHECK(shards >= 2 && shards <= exl3::kMaxGroupShards, "native_linear_group takes 2..",
              exl3::kMaxGroupShards, " shards, got ", shards);
  TORCH_CHECK(static_cast<int64_t>(suh.size()) == shards && static_cast<int64_t>(svh.size()) == shards,
              "one suh and one svh per trellis");
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a 2-D CUDA tensor");
  const int64_t k_in = trellis[0].size(0) * kTile;
  std::vector<exl3::TrellisView> views;
  std::vector<int64_t> n_out;
  int64_t n_total = 0;
  for (int64_t s = 0; s < shards; ++s) {
    views.push_back(trellis_view(trellis[s], codebook));
    n_out.push_back(trellis[s].size(1) * kTile);
    n_total += n_out.back();
    TORCH_CHECK(trellis[s].size(0) * kTile == k_in, "every shard must have the same input width");
    TORCH_CHECK(views[s].bits2 == views[0].bits2 && views[s].tile_stride == views[0].tile_stride,
                "every shard must have the same bit width and tile stride");
    TORCH_CHECK(trellis[s].device() == x_in.device(), "shards must be on x's device");
    TORCH_CHECK(views[s].row_stride * exl3::kGemmWarps < INT_MAX, "trellis row stride too large for the grouped kernel");
    TORCH_CHECK(suh[s].scalar_type() == at::kHalf && suh[s].is_contiguous() && suh[s].numel() == k_in,
                "suh must be fp16 [K]");
    TORCH_CHECK(svh[s].scalar_type() == at::kHalf && svh[s].is_contiguous() && svh[s].numel() == n_out[s],
                "svh must be fp16 [N]");
  }
  TORCH_CHECK(k_in % kHad == 0, "EXL3 linears are padded to 128 on both sides");
  TORCH_CHECK(x_in.size(1) == k_in, "x must be [rows, K] (the shards' whole input width)");
  const int64_t rows = x_in.size(0);
  TORCH_CHECK(rows < (1LL << 31), "too many rows");
  const int64_t kb_count = k_in / kHad, groups = n_total / kHad;
  const c10::cuda::CUDAGuard guard(x_in.device());
  const bool skinny_path = path == kAuto || path == kSkinny || path == kSkinnySplit || path == kSkinnyDirect;
  bool grouped = rows > 0 && rows <= 8 && skinny_path && exl3::env::skinny_dup() &&
                 exl3::gemm_group_fits_device(static_cast<int>(codebook), views[0].bits2, static_cast<int>(rows));
  if (grouped && path == kAuto) {
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    const exl3::LinearShape shape{rows, k_in * n_total * 2, n_total, prop->major, prop->l2CacheSize};
    const int r = static_cast<int>(rows);
    const Path planned = exl3::plan_linear_path(
        shape, [&](bool panel) { return exl3::gemm_fits_device(views[0].codebook, views[0].bits2, r, panel); });
    grouped = planned == kSkinny;
  }
  if (!grouped) {
    std::vector<at::Tensor> outs;
    for (int64_t s = 0; s < shards; ++s)
      outs.push_back(native_linear(x_in, trellis[s], suh[s], svh[s], codebook, 0, 0, n_out[s], path));
    return at::cat(outs, 1);
  }

  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int xdt = act_dtype(x);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor y = at::empty({rows, n_total}, x.options());

  exl3::GemmArgs sa{};
  sa.w = views[0];  // codebook, bits2 and tile stride (common); the trellises themselves come from the shard table
  sa.y = y.data_ptr();
  sa.y_dtype = xdt;
  sa.y_stride = y.stride(0);
  sa.out_offset = 0;
  sa.out_features = static_cast<int>(n_total);
  sa.rows = static_cast<int>(rows);
  sa.kb0 = 0;
  sa.kb_count = static_cast<int>(kb_count);
  sa.g0 = 0;
  sa.groups = static_cast<int>(groups);
  const exl3::GemmPlan plan =
      exl3::plan_gemm_group(sa, path == kSkinnySplit ? 1 : path == kSkinnyDirect ? 0 : -1);
  const int64_t xh_rows = static_cast<int64_t>(plan.row_chunks) * plan.rows_per_chunk;
  const int parts = exl3::input_transform_parts(static_cast<int>(kb_count));
  const bool rowsums = views[0].codebook == exl3::kCbMul1;  // mul1's affine epilogue (dup codewords)
  exl3::InputTransformArgs it{};
  it.x = x.data_ptr();
  it.x_dtype = xdt;
  it.x_stride = x.stride(0);
  it.rows = static_cast<int>(rows);
  it.xh_rows = static_cast<int>(xh_rows);
  it.in_width = static_cast<int>(k_in);
  it.in_offset = 0;
  it.kb0 = 0;
  it.kb_count = static_cast<int>(kb_count);
  const at::Tensor ws = skinny_workspace(x, align256(shards * xh_rows * k_in * 2),
                                         rowsums ? align256(shards * rows * parts * 4) : 0, plan, parts, it, sa);

  exl3::GemmShards sh{};
  const void* suh_ptrs[exl3::kMaxGroupShards] = {};
  int end = 0;
  for (int s = 0; s < exl3::kMaxGroupShards; ++s) {
    if (s < shards) {
      end += static_cast<int>(n_out[s] / kHad);
      sh.group_end[s] = end;
      sh.data[s] = views[s].data;
      sh.row_stride[s] = views[s].row_stride;
      sh.svh[s] = svh[s].data_ptr();
      suh_ptrs[s] = suh[s].data_ptr();
    } else {  // past the last shard: no column group reaches these
      sh.group_end[s] = INT_MAX;
      sh.data[s] = views[0].data;
      sh.row_stride[s] = views[0].row_stride;
      sh.svh[s] = svh[0].data_ptr();
    }
  }
  sh.xh_shard = xh_rows * k_in;
  sh.rowsum_shard = static_cast<int>(rows * parts);
  check_cuda(exl3::launch_input_transform_group(it, suh_ptrs, static_cast<int>(shards), false, stream),
             "input transform (grouped)");
  check_cuda(exl3::launch_gemm_group(sa, sh, plan, use_pdl(), stream), "skinny GEMM (grouped)");
  return y;
}

at::Tensor reconstruct(const at::Tensor& trellis, int64_t codebook, const std::optional<at::Tensor>& suh,
                       const std::optional<at::Tensor>& svh, bool bf16) {
  const exl3::TrellisView w = trellis_view(trellis, codebook);
  const int64_t k = trellis.size(0) * kTile, n = trellis.size(1) * kTile;
  TORCH_CHECK(k % kHad == 0 && n % kHad == 0, "EXL3 linears are padded to 128 on both sides");
  TORCH_CHECK(suh.has_value() == svh.has_value(), "give both suh and svh (original basis) or neither (Ŵ)");
  const c10::cuda::CUDAGuard guard(trellis.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kHalf;
  if (!suh.has_value()) {
    at::Tensor out = at::empty({k, n}, trellis.options().dtype(dtype));
    exl3::ReconstructArgs ra{w, 0, static_cast<int>(k / kHad), 0, static_cast<int>(n / kHad), out.data_ptr(),
                             bf16 ? exl3::kActBF16 : exl3::kActF16, nullptr, nullptr};
    check_cuda(exl3::launch_reconstruct(ra, false, stream), "reconstruct");
    return out;
  }
  TORCH_CHECK(suh->scalar_type() == at::kHalf && suh->is_contiguous() && suh->numel() == k, "suh must be fp16 [K]");
  TORCH_CHECK(svh->scalar_type() == at::kHalf && svh->is_contiguous() && svh->numel() == n, "svh must be fp16 [N]");
  at::Tensor out = at::empty({k, n}, trellis.options().dtype(dtype));
  exl3::ReconstructArgs ra{w, 0, static_cast<int>(k / kHad), 0, static_cast<int>(n / kHad), out.data_ptr(),
                           bf16 ? exl3::kActBF16 : exl3::kActF16, svh->data_ptr(), suh->data_ptr()};
  check_cuda(exl3::launch_reconstruct(ra, false, stream), "reconstruct (original basis)");
  return out;
}

// y = x W^T for a 16-bit (unquantized) weight at decode sizes (exl3_kernels.h launch_small_linear): y fp32
// (out_fp32, what vLLM's MoE gate hands its router) or x's dtype.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, bool out_fp32) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16),
              "vllm_exl3: small_linear takes 2-D fp16/bf16 CUDA activations");
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 2 && weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "vllm_exl3: small_linear's weight must be a contiguous [out, in] CUDA tensor of x's dtype");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "vllm_exl3: small_linear: x has ", k, " columns, the weight ", weight.size(1));
  TORCH_CHECK(rows >= 1 && rows <= exl3::kSmallLinearMaxRows, "vllm_exl3: small_linear takes 1..",
              exl3::kSmallLinearMaxRows, " rows, got ", rows);
  TORCH_CHECK(k % 8 == 0 && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "vllm_exl3: small_linear needs 16-byte aligned rows (in_features and x's row stride multiples of 8)");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({rows, n}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  exl3::SmallLinearArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w = weight.data_ptr();
  a.dtype = x.scalar_type() == at::kBFloat16 ? exl3::kActBF16 : exl3::kActF16;
  a.rows = static_cast<int>(rows);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.y = y.data_ptr();
  a.y_fp32 = out_fp32;
  check_cuda(exl3::launch_small_linear(a, at::cuda::getCurrentCUDAStream()), "small linear");
  return y;
}

std::string build_info() { return std::string("archs=") + exl3::built_archs(); }

std::string device_check() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device";
  }
  const cudaError_t err = exl3::probe_device_support();
  if (err == cudaSuccess) return "";
  cudaGetLastError();
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return "no kernel image for sm_" + std::to_string(major) + std::to_string(minor) + " (built for " +
         exl3::built_archs() + "): " + cudaGetErrorString(err);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_exl3, m) {
  m.def("native_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, int in_offset, "
        "int out_offset, int out_features, int path=0) -> Tensor");
  m.def("native_linear_group(Tensor x, Tensor[] trellis, Tensor[] suh, Tensor[] svh, int codebook, int path=0) "
        "-> Tensor");
  m.def("reconstruct(Tensor trellis, int codebook, Tensor? suh=None, Tensor? svh=None, bool bf16=False) -> Tensor");
  m.def("small_linear(Tensor x, Tensor weight, bool out_fp32) -> Tensor");
  m.def("build_info() -> str", &build_info);
  m.def("device_check() -> str", &device_check);
  m.def("native_linear_traced(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, int in_offset, "
        "int out_offset, int out_features, int path=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_exl3, CUDA, m) {
  m.impl("native_linear", &native_linear);
  m.impl("native_linear_traced", &native_linear_traced);
  m.impl("native_linear_group", &native_linear_group);
  m.impl("reconstruct", &reconstruct);
  m.impl("small_linear", &small_linear);
}

// `import vllm_exl3._C` loads this library (and with it the registrations above); the module itself is empty.
static struct PyModuleDef exl3_module = {PyModuleDef_HEAD_INIT, "_C", "EXL3 CUDA kernels (ops in torch.ops.vllm_exl3)",
                                         -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&exl3_module); }
