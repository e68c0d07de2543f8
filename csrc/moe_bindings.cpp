// Torch glue of the routed-expert kernels (csrc/moe.h): the `native_moe` op and its helpers, in the `vllm_exl3`
// namespace next to the dense ops of bindings.cpp. Fake (shape-only) implementations live in the native backend.
//
//   native_moe(x, topk_weights, topk_ids, expert_map, w13_*, w2_*, w13_keys, w2_keys, w13_plan, w2_plan,
//              activation, router_weight_on_input, inter_offset, inter_size, w13_bias?, w2_bias?,
//              swiglu_limit, swiglu_alpha) -> y [M, hidden]
//   moe_expert_keys(words, codebooks) -> int32 CPU tensor: the kernel key of each (expert, projection)
//   moe_plan(words, codebooks) -> int[]: one projection's distinct kernel keys, [key, bits2, codebook] each, in key
//              order (the launches native_moe makes for it), made once per layer at bind
//   moe_reserve(device, tokens, top_k, experts, hidden_padded, inter_padded) -> workspace bytes
//   moe_prepare(bits, codebook) -> raises the kernels' shared-memory limits (once per layer kind, at load)
//
// Workspace: one buffer per device for all MoE layers (they run one after another on the stream), sized for
// kMoeChunkTokens (moe_planner.h) tokens; longer calls run chunk by chunk. It grows only outside CUDA-graph capture
// (load time reserves it, and vLLM's warm-up runs every size eagerly before capturing); growth requested during
// capture is an error, never an allocation.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "moe.h"
#include "torch_glue.h"

namespace {

using exl3::kMoeChunkTokens;
using exl3::glue::check_cuda, exl3::glue::kHad, exl3::glue::use_pdl;

int activation_id(c10::string_view name) {
  if (name == "silu") return exl3::kActSilu;
  if (name == "gelu") return exl3::kActGelu;
  if (name == "gelu_tanh") return exl3::kActGeluTanh;
  if (name == "swigluoai") return exl3::kActSwigluOai;
  TORCH_CHECK(false, "vllm_exl3: unknown MoE activation '", std::string(name), "' (silu, gelu, gelu_tanh, swigluoai)");
}

// Per-device workspace; leaked on purpose (a static tensor would be freed after the CUDA context at exit).
std::mutex& ws_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<int, at::Tensor*>& workspaces() {
  static auto* m = new std::map<int, at::Tensor*>();
  return *m;
}

char* workspace(const at::Device& device, size_t bytes) {
  std::lock_guard<std::mutex> lock(ws_mutex());
  at::Tensor*& t = workspaces()[device.index()];
  if (t && static_cast<size_t>(t->numel()) >= bytes) return static_cast<char*>(t->data_ptr());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &status), "cudaStreamIsCapturing");
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "vllm_exl3: the MoE workspace must grow to ", bytes,
              " bytes during CUDA-graph capture; reserve it at load (moe_reserve) or warm up eagerly first");
  delete t;
  t = new at::Tensor(at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device)));
  return static_cast<char*>(t->data_ptr());
}

int64_t moe_reserve(c10::Device device, int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden_padded,
                    int64_t inter_padded) {
  TORCH_CHECK(device.is_cuda(), "moe_reserve needs a CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  const size_t bytes = exl3::moe_reserve_bytes(static_cast<int>(tokens), static_cast<int>(top_k),
                                               static_cast<int>(experts), static_cast<int>(hidden_padded),
                                               static_cast<int>(inter_padded));
  workspace(device, bytes);
  std::lock_guard<std::mutex> lock(ws_mutex());
  return workspaces()[device.index()]->numel();
}

at::Tensor moe_expert_keys(at::IntArrayRef words, at::IntArrayRef codebooks) {
  TORCH_CHECK(words.size() == codebooks.size(), "moe_expert_keys: one codebook per weight");
  at::Tensor keys = at::empty({static_cast<int64_t>(words.size())}, at::kInt);
  for (size_t i = 0; i < words.size(); ++i)
    keys.data_ptr<int>()[i] = exl3::moe_weight_key(static_cast<int>(words[i]), static_cast<int>(codebooks[i]));
  return keys;
}

void moe_prepare(int64_t words, int64_t codebook) {
  TORCH_CHECK(words % 8 == 0 && words >= 16 && words <= 128, "moe_prepare: words must be 16 * bits");
  check_cuda(exl3::moe_prepare(static_cast<int>(words / 8), static_cast<int>(codebook)), "MoE kernel preparation");
}

struct Slices {
  const int16_t* data;
  long long slice_stride, row_stride;
  int tile_stride;
};
// [E, (projs,) K/16, N/16, W] int16, contiguous: (expert, proj) slices one after another.
Slices slices(const at::Tensor& t, int projs, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kShort && t.is_contiguous() && t.dim() == (projs == 2 ? 5 : 4),
              "vllm_exl3: ", name, " must be a contiguous CUDA int16 expert stack");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  const int d = t.dim();
  return {t.data_ptr<int16_t>(), t.stride(projs == 2 ? 1 : 0), t.stride(d - 3), static_cast<int>(t.stride(d - 2))};
}

// A kind of (expert, projection) weight: its kernel key and the width/codebook the key stands for. One launch per
// kind a projection holds.
struct Key {
  int key, bits2, codebook;
  bool operator<(const Key& o) const { return key < o.key; }
};
// The kind of a weight of `words` trellis words per tile; refuses widths/codebooks no kernel is built for.
Key weight_key(int64_t words, int64_t cb) {
  TORCH_CHECK(words % 8 == 0 && words >= 16 && words <= 128, "vllm_exl3: expert trellis words ", words,
              " is not 16 * bits (bits 1..8, or 1.5/2.5/3.5)");
  TORCH_CHECK(cb >= 0 && cb <= 2, "vllm_exl3: codebook index ", cb, " is not 0..2");
  const int bits2 = static_cast<int>(words / 8);
  TORCH_CHECK(bits2 % 2 == 0 || (cb == exl3::kCbMul1 && bits2 <= 7),
              "vllm_exl3: half-integer bit widths need mul1, <= 3.5");
  return {exl3::moe_weight_key(static_cast<int>(words), static_cast<int>(cb)), bits2, static_cast<int>(cb)};
}

// Made once per layer at bind, so that a call launches without walking every expert (3 x experts entries): the
// distinct kinds of one projection's weights, flattened for the op's int[] argument, in key order (the order of
// the launches).
std::vector<int64_t> moe_plan(at::IntArrayRef words, at::IntArrayRef codebooks) {
  TORCH_CHECK(words.size() == codebooks.size(), "moe_plan: one codebook per weight");
  std::set<Key> kinds;
  for (size_t i = 0; i < words.size(); ++i) kinds.insert(weight_key(words[i], codebooks[i]));
  std::vector<int64_t> plan;
  for (const Key& k : kinds) plan.insert(plan.end(), {k.key, k.bits2, k.codebook});
  return plan;
}

// A plan back from its int[] form, per call: a list of a few ints, so checking it costs nothing beside the launches,
// and a hand-made one cannot launch a kernel that does not exist or launch a kind twice.
std::vector<Key> plan_keys(at::IntArrayRef plan, const char* name) {
  TORCH_CHECK(!plan.empty() && plan.size() % 3 == 0, "vllm_exl3: ", name,
              " must be a moe_plan: one or more (key, bits2, codebook) triples");
  std::vector<Key> keys;
  for (size_t i = 0; i < plan.size(); i += 3) {
    TORCH_CHECK(plan[i + 1] >= 2 && plan[i + 1] <= 16, "vllm_exl3: ", name, " holds width ", plan[i + 1],
                " (bits2 2..16)");
    const Key k = weight_key(8 * plan[i + 1], plan[i + 2]);
    TORCH_CHECK(plan[i] == k.key && (keys.empty() || keys.back().key < k.key), "vllm_exl3: ", name,
                " is not a moe_plan (each key must match its width and codebook, in ascending order)");
    keys.push_back(k);
  }
  return keys;
}

// An input transform, once per layout its projection's GEMMs read (moe.h moe_xdup): plain into args.xh, duplicated
// fragment order into dup_xh; both only where one projection mixes mul1 with 3inst/mcg weights.
template <typename Args, typename Launch>
void transform_inputs(Args args, Launch launch, void* dup_xh, const std::vector<Key>& keys, int rows, bool pdl,
                      cudaStream_t stream, const char* what) {
  bool plain = false, dup = false;
  for (const Key& key : keys) (exl3::moe_xdup(key.codebook, rows) ? dup : plain) = true;
  if (plain) check_cuda(launch(args, pdl, stream), what);
  if (dup) {
    args.xh = dup_xh;
    args.dup = true;
    check_cuda(launch(args, pdl, stream), what);
  }
}

at::Tensor native_moe(const at::Tensor& x_in, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                      const at::Tensor& expert_map, const at::Tensor& w13_trellis, const at::Tensor& w13_suh,
                      const at::Tensor& w13_svh, const at::Tensor& w2_trellis, const at::Tensor& w2_suh,
                      const at::Tensor& w2_svh, const at::Tensor& w13_keys, const at::Tensor& w2_keys,
                      at::IntArrayRef w13_plan, at::IntArrayRef w2_plan,
                      c10::string_view activation, bool router_weight_on_input, int64_t inter_offset,
                      int64_t inter_size, const std::optional<at::Tensor>& w13_bias,
                      const std::optional<at::Tensor>& w2_bias, double swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "vllm_exl3: x must be a 2-D CUDA tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16,
              "vllm_exl3: activations must be fp16 or bf16");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int xdt = x.scalar_type() == at::kBFloat16 ? exl3::kActBF16 : exl3::kActF16;
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t experts = w13_trellis.size(0);
  const int64_t hp = w13_trellis.size(2) * 16, ip = w13_trellis.size(3) * 16;
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_ids.is_cuda() &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "vllm_exl3: topk_ids must be CUDA int32/int64 [tokens, top_k]");
  const int64_t top_k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_cuda(),
              "vllm_exl3: topk_weights must match topk_ids");
  TORCH_CHECK(experts >= 1 && experts <= exl3::kMoeMaxExperts, "vllm_exl3: 1..", exl3::kMoeMaxExperts,
              " local experts per layer, got ", experts);
  TORCH_CHECK(hp % kHad == 0 && ip % kHad == 0, "vllm_exl3: expert dims are padded to 128");
  TORCH_CHECK(hidden <= hp, "vllm_exl3: x has ", hidden, " columns, the experts take at most ", hp);
  TORCH_CHECK(w2_trellis.size(0) == experts && w2_trellis.size(1) * 16 == ip && w2_trellis.size(2) * 16 == hp,
              "vllm_exl3: w2_trellis does not match w13_trellis");
  auto fp16_of = [](const at::Tensor& t, std::vector<int64_t> shape, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kHalf && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
                "vllm_exl3: ", name, " must be contiguous CUDA fp16 ", at::IntArrayRef(shape));
  };
  fp16_of(w13_suh, {experts, 2, hp}, "w13_suh");
  fp16_of(w13_svh, {experts, 2, ip}, "w13_svh");
  fp16_of(w2_suh, {experts, ip}, "w2_suh");
  fp16_of(w2_svh, {experts, hp}, "w2_svh");
  TORCH_CHECK(inter_offset >= 0 && inter_size >= 0 && inter_offset + inter_size <= ip,
              "vllm_exl3: intermediate slice outside the stored block range");
  const int act = activation_id(activation);
  auto fp32_of = [](const std::optional<at::Tensor>& t, std::vector<int64_t> shape, const char* name) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == at::IntArrayRef(shape),
                "vllm_exl3: ", name, " must be contiguous CUDA fp32 ", at::IntArrayRef(shape));
    return t->data_ptr<float>();
  };
  const float* bias13 = fp32_of(w13_bias, {experts, 2, ip}, "w13_bias");
  // the down bias: [experts][hidden], or as the layer stores it, padded to the block ([experts][hidden_padded])
  const int64_t bias2_stride = w2_bias.has_value() && w2_bias->dim() == 2 ? w2_bias->size(1) : hidden;
  TORCH_CHECK(bias2_stride == hidden || bias2_stride == hp, "vllm_exl3: w2_bias must have ", hidden, " or ", hp,
              " columns, got ", bias2_stride);
  const float* bias2 = fp32_of(w2_bias, {experts, bias2_stride}, "w2_bias");
  const bool has_map = expert_map.numel() > 0;
  if (has_map)
    TORCH_CHECK(expert_map.is_cuda() && expert_map.scalar_type() == at::kInt && expert_map.dim() == 1,
                "vllm_exl3: expert_map must be a CUDA int32 vector");

  const std::vector<Key> keys13 = plan_keys(w13_plan, "w13_plan"), keys2 = plan_keys(w2_plan, "w2_plan");
  if (keys13.size() > 1)
    TORCH_CHECK(w13_keys.is_cuda() && w13_keys.scalar_type() == at::kInt && w13_keys.numel() == 2 * experts,
                "vllm_exl3: mixed gate/up widths need w13_keys (moe_expert_keys) on the device");
  if (keys2.size() > 1)
    TORCH_CHECK(w2_keys.is_cuda() && w2_keys.scalar_type() == at::kInt && w2_keys.numel() == experts,
                "vllm_exl3: mixed down widths need w2_keys (moe_expert_keys) on the device");

  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor y = at::empty({tokens, hidden}, x.options());
  if (tokens == 0 || hidden == 0) return y;
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const Slices s13 = slices(w13_trellis, 2, "w13_trellis"), s2 = slices(w2_trellis, 1, "w2_trellis");
  char* base = workspace(x.device(), exl3::moe_reserve_bytes(static_cast<int>(tokens), static_cast<int>(top_k),
                                                         static_cast<int>(experts), static_cast<int>(hp),
                                                         static_cast<int>(ip)));
  const bool pdl = use_pdl();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;

  for (int64_t t0 = 0; t0 < tokens; t0 += kMoeChunkTokens) {
    const int tc = static_cast<int>(std::min<int64_t>(kMoeChunkTokens, tokens - t0));
    const int pairs = tc * static_cast<int>(top_k);
    const exl3::MoeChunkPlan plan = exl3::moe_chunk_plan(pairs, static_cast<int>(experts), static_cast<int>(hp),
                                                         static_cast<int>(ip), sms);
    const int rows = plan.rows_per_chunk, chunk_bound = plan.chunk_bound;
    const int splits13 = plan.splits13, splits2 = plan.splits2;
    const exl3::MoeWorkspace L = exl3::moe_workspace_layout(tc, static_cast<int>(top_k), static_cast<int>(experts),
                                                            static_cast<int>(hp), static_cast<int>(ip), rows, splits13,
                                                            splits2);
    auto at_ = [&](size_t off) { return base + off; };
    int* pair_expert = reinterpret_cast<int*>(at_(L.pair_expert));
    int* sorted = reinterpret_cast<int*>(at_(L.sorted_pairs));
    int* chunk_expert = reinterpret_cast<int*>(at_(L.chunk_expert));
    int* chunk_start = reinterpret_cast<int*>(at_(L.chunk_start));
    int* chunk_count = reinterpret_cast<int*>(at_(L.chunk_count));
    int* num_chunks = reinterpret_cast<int*>(at_(L.num_chunks));
    const float* pair_w = weights.data_ptr<float>() + t0 * top_k;

    exl3::MoeRouteArgs ra{};
    ra.ids.topk_ids = static_cast<const char*>(ids.data_ptr()) + t0 * top_k * ids.element_size();
    ra.ids.ids64 = ids.scalar_type() == at::kLong;
    ra.ids.expert_map = has_map ? expert_map.data_ptr<int>() : nullptr;
    ra.ids.global_experts = has_map ? static_cast<int>(expert_map.numel()) : static_cast<int>(experts);
    ra.ids.experts = static_cast<int>(experts);
    ra.pairs = pairs;
    ra.rows_per_chunk = rows;
    ra.pair_expert = pair_expert;
    ra.sorted_pairs = sorted;
    ra.chunk_expert = chunk_expert;
    ra.chunk_start = chunk_start;
    ra.chunk_count = chunk_count;
    ra.num_chunks = num_chunks;
    check_cuda(exl3::launch_moe_route(ra, stream), "MoE routing");

    exl3::MoeGatherArgs ga{};
    ga.ids = ra.ids;
    ga.x = static_cast<const char*>(x.data_ptr()) + t0 * x.stride(0) * x.element_size();
    ga.x_dtype = xdt;
    ga.x_stride = x.stride(0);
    ga.hidden = static_cast<int>(hidden);
    ga.hidden_padded = static_cast<int>(hp);
    ga.pairs = pairs;
    ga.top_k = static_cast<int>(top_k);
    ga.suh = w13_suh.data_ptr();
    ga.pair_weight = router_weight_on_input ? pair_w : nullptr;
    ga.xh = at_(L.xh13);
    transform_inputs(ga, exl3::launch_moe_gather_transform, at_(L.xh13_dup), keys13, rows, pdl, stream,
                     "MoE gate/up input transform");

    auto gemm = [&](const Slices& s, const std::vector<Key>& keys, const at::Tensor& key_tensor, int projs,
                    const at::Tensor& svh, int n, const void* xh, long long xh_row, long long xh_proj, int k,
                    int splits, float* out, long long out_row, long long out_split, const float* out_w,
                    bool table_early, const char* what) {
      for (const Key& key : keys) {
        exl3::MoeGemmArgs a{};
        a.trellis = s.data;
        a.slice_stride = s.slice_stride;
        a.row_stride = s.row_stride;
        a.tile_stride = s.tile_stride;
        a.bits2 = key.bits2;
        a.codebook = key.codebook;
        a.keys = keys.size() > 1 ? key_tensor.data_ptr<int>() : nullptr;
        a.want_key = key.key;
        a.projs = projs;
        a.svh = svh.data_ptr();
        a.n_padded = n;
        a.xh = xh;
        a.xh_row_stride = xh_row;
        a.xh_proj_stride = xh_proj;
        if (exl3::moe_xdup(key.codebook, rows)) {  // the copy in duplicated order: rows twice as wide
          a.xh = at_(projs == 2 ? L.xh13_dup : L.xh2_dup);
          a.xh_row_stride *= 2;
          a.xh_proj_stride *= 2;
        }
        a.kb_count = k / static_cast<int>(kHad);
        a.groups = n / static_cast<int>(kHad);
        a.chunk_expert = chunk_expert;
        a.chunk_start = chunk_start;
        a.chunk_count = chunk_count;
        a.num_chunks = num_chunks;
        a.sorted_pairs = sorted;
        a.chunk_bound = chunk_bound;
        a.splits = splits;
        a.table_early = table_early;
        a.y = out;
        a.y_row_stride = out_row;
        a.y_split_stride = out_split;
        a.pair_weight = out_w;
        check_cuda(exl3::launch_moe_gemm(a, rows, pdl, stream), what);
      }
    };
    float* gu = reinterpret_cast<float*>(at_(L.gu));
    gemm(s13, keys13, w13_keys, 2, w13_svh, static_cast<int>(ip), at_(L.xh13), 2 * hp, hp, static_cast<int>(hp),
         splits13, gu, splits13 * 2 * ip, 2 * ip, nullptr, false, "MoE gate/up GEMM");

    exl3::MoeActArgs aa{};
    aa.gu = gu;
    aa.splits = splits13;
    aa.inter_padded = static_cast<int>(ip);
    aa.inter_offset = static_cast<int>(inter_offset);
    aa.inter_size = static_cast<int>(inter_size);
    aa.activation = act;
    aa.limit = static_cast<float>(swiglu_limit);
    aa.alpha = static_cast<float>(swiglu_alpha);
    aa.bias = bias13;
    aa.pairs = pairs;
    aa.pair_expert = pair_expert;
    aa.suh = w2_suh.data_ptr();
    aa.xh = at_(L.xh2);
    transform_inputs(aa, exl3::launch_moe_act_transform, at_(L.xh2_dup), keys2, rows, pdl, stream,
                     "MoE down input transform");

    float* slots = reinterpret_cast<float*>(at_(L.slots));
    gemm(s2, keys2, w2_keys, 1, w2_svh, static_cast<int>(hp), at_(L.xh2), ip, 0, static_cast<int>(ip), splits2, slots,
         splits2 * hp, hp, router_weight_on_input ? nullptr : pair_w, pdl, "MoE down GEMM");

    exl3::MoeReduceArgs rd{};
    rd.slots = slots;
    rd.splits = splits2;
    rd.hidden_padded = static_cast<int>(hp);
    rd.hidden = static_cast<int>(hidden);
    rd.tokens = tc;
    rd.top_k = static_cast<int>(top_k);
    rd.pair_expert = pair_expert;
    rd.bias = bias2;
    rd.bias_stride = bias2_stride;
    rd.pair_weight = router_weight_on_input ? nullptr : pair_w;
    rd.y = static_cast<char*>(y.data_ptr()) + t0 * y.stride(0) * y.element_size();
    rd.y_dtype = xdt;
    rd.y_stride = y.stride(0);
    check_cuda(exl3::launch_moe_reduce(rd, pdl, stream), "MoE top-k reduction");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_exl3, m) {
  m.def("native_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor expert_map, Tensor w13_trellis, "
        "Tensor w13_suh, Tensor w13_svh, Tensor w2_trellis, Tensor w2_suh, Tensor w2_svh, Tensor w13_keys, "
        "Tensor w2_keys, int[] w13_plan, int[] w2_plan, str activation, bool router_weight_on_input, "
        "int inter_offset, int inter_size, Tensor? w13_bias, Tensor? w2_bias, float swiglu_limit, "
        "float swiglu_alpha) -> Tensor");
  m.def("moe_expert_keys(int[] words, int[] codebooks) -> Tensor", &moe_expert_keys);
  m.def("moe_plan(int[] words, int[] codebooks) -> int[]", &moe_plan);
  m.def("moe_reserve(Device device, int tokens, int top_k, int experts, int hidden_padded, int inter_padded) -> int",
        &moe_reserve);
  m.def("moe_prepare(int words, int codebook) -> ()", &moe_prepare);
}

TORCH_LIBRARY_IMPL(vllm_exl3, CUDA, m) { m.impl("native_moe", &native_moe); }
