// Which cuBLASLt configurations of one GEMM shape run fastest, beyond the heuristic's own list:
// for y[m, n] = x[m, k] w[n, k]^T (bf16, fp32 accumulation, the layouts of cuda::Gemm; with
// --splits S > 1 its K split: S strided batches over K ranges into fp32 slabs), the heuristic's
// candidates for m, and each of them re-tiled (CUBLASLT_ALGO_CONFIG_TILE_ID
// from --tiles) and re-clustered (--clusters), kept where cublasLtMatmulAlgoCheck accepts them.
// Each runs over enough weight copies (>= 256 MiB) that weights stream from HBM; prints µs
// (median of 5 rounds of 20 launches), waves and whether its output has the bits of the
// heuristic's first pick (the row-invariance families of cuda::Gemm need that).
//   cuda_gemm_tiles_bench --n 28672 --k 4096 --m 65 [--splits 1] [--tiles 317,399,455,492]
//       [--clusters 2,3,4]
// A diagnostic for the GPU host (bench/history/), not a test.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

void Die(const char* what) {
  std::fprintf(stderr, "cuda_gemm_tiles_bench: %s\n", what);
  std::exit(1);
}

std::vector<int> Ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  }
  return out;
}

template <typename T>
T Config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v = {};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 28672, k = 4096, m = 65, splits = 1;
  std::vector<int> tiles = {317, 399, 455, 492}, clusters = {0};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--n") n = std::atoll(v.c_str());
    else if (a == "--k") k = std::atoll(v.c_str());
    else if (a == "--m") m = std::atoll(v.c_str());
    else if (a == "--splits") splits = std::max<int64_t>(1, std::atoll(v.c_str()));
    else if (a == "--tiles") tiles = Ints(v);
    else if (a == "--clusters") clusters = Ints(v);
    else Die("unknown flag");
  }
  cublasLtHandle_t handle;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) Die("cublasLtCreate");
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  if (k % splits != 0) Die("--splits must divide k");
  const int64_t part = k / splits;
  const cudaDataType_t y_type = splits > 1 ? CUDA_R_32F : CUDA_R_16BF;
  const size_t y_elem = splits > 1 ? 4 : 2;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, part, n, k);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, part, m, k);
  cublasLtMatrixLayoutCreate(&ld, y_type, n, m, n);
  if (splits > 1) {
    const int32_t count = static_cast<int32_t>(splits);
    const int64_t offsets[3] = {part, part, m * n};
    cublasLtMatrixLayout_t layouts[3] = {la, lb, ld};
    for (int i = 0; i < 3; ++i) {
      cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                       sizeof(count));
      cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                       &offsets[i], sizeof(offsets[i]));
    }
  }
  const size_t ws_bytes = size_t{128} << 20;
  void* ws = nullptr;
  cudaMalloc(&ws, ws_bytes);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t wsb = ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof(wsb));
  cublasLtMatmulHeuristicResult_t res[32] = {};
  int returned = 0;
  cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 32, res, &returned);
  if (returned == 0) Die("no heuristic result");

  // Candidates: the heuristic's (without a K split), then their re-tiled / re-clustered forms.
  std::vector<cublasLtMatmulAlgo_t> cands;
  std::vector<std::string> origin;
  const auto add = [&](const cublasLtMatmulAlgo_t& a, const std::string& why) {
    for (const auto& c : cands) {
      if (std::memcmp(&c, &a, sizeof(a)) == 0) return;
    }
    cublasLtMatmulHeuristicResult_t chk = {};
    if (cublasLtMatmulAlgoCheck(handle, desc, la, lb, ld, ld, &a, &chk) != CUBLAS_STATUS_SUCCESS ||
        chk.workspaceSize > ws_bytes) {
      return;
    }
    cands.push_back(a);
    origin.push_back(why);
  };
  for (int i = 0; i < returned; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (Config<int32_t>(res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) continue;
    add(res[i].algo, "heuristic " + std::to_string(i));
  }
  const size_t heuristic = cands.size();
  for (size_t i = 0; i < heuristic; ++i) {
    for (int tile : tiles) {
      for (int cluster : clusters) {
        cublasLtMatmulAlgo_t a = cands[i];
        const uint32_t t = static_cast<uint32_t>(tile);
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof(t));
        if (cluster > 0) {
          const uint16_t c = static_cast<uint16_t>(cluster);
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c,
                                               sizeof(c));
        }
        add(a, "heuristic " + std::to_string(i) + " tile " + std::to_string(tile) +
                   (cluster > 0 ? " cluster " + std::to_string(cluster) : ""));
      }
    }
  }

  // Data: random weights tiled over >= 256 MiB of copies, random x.
  const size_t w_elems = static_cast<size_t>(n) * k;
  const int copies = static_cast<int>(((size_t{256} << 20) + w_elems * 2 - 1) / (w_elems * 2));
  std::vector<__nv_bfloat16> host(w_elems);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (auto& v : host) v = __float2bfloat16(u(rng));
  __nv_bfloat16 *w = nullptr, *x = nullptr;
  void *y = nullptr, *y0 = nullptr;
  if (cudaMalloc(&w, w_elems * 2 * copies) != cudaSuccess) Die("cudaMalloc");
  for (int c = 0; c < copies; ++c) {
    cudaMemcpy(w + w_elems * c, host.data(), w_elems * 2, cudaMemcpyHostToDevice);
  }
  std::vector<__nv_bfloat16> hx(static_cast<size_t>(m) * k);
  for (auto& v : hx) v = __float2bfloat16(u(rng) * 20);
  cudaMalloc(&x, hx.size() * 2);
  cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
  const size_t y_bytes = static_cast<size_t>(splits * m * n) * y_elem;
  cudaMalloc(&y, y_bytes);
  cudaMalloc(&y0, y_bytes);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const float alpha = 1.0f, beta = 0.0f;
  const auto run = [&](const cublasLtMatmulAlgo_t& a, const __nv_bfloat16* wp, void* out) {
    return cublasLtMatmul(handle, desc, &alpha, wp, la, x, lb, &beta, out, ld, out, ld, &a, ws,
                          ws_bytes, stream);
  };
  std::vector<unsigned char> ref(y_bytes), got(y_bytes);
  if (run(cands[0], w, y0) != CUBLAS_STATUS_SUCCESS) Die("first pick failed");
  cudaMemcpy(ref.data(), y0, y_bytes, cudaMemcpyDeviceToHost);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::printf(
      "# n %lld k %lld m %lld splits %lld: %zu candidates (%zu from the heuristic), %d weight "
      "copies\n",
      static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m),
      static_cast<long long>(splits), cands.size(), heuristic, copies);
  struct Row {
    double us;
    std::string text;
  };
  std::vector<Row> rows;
  for (size_t i = 0; i < cands.size(); ++i) {
    const cublasLtMatmulAlgo_t& a = cands[i];
    if (run(a, w, y) != CUBLAS_STATUS_SUCCESS || cudaStreamSynchronize(stream) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    cudaMemcpy(got.data(), y, y_bytes, cudaMemcpyDeviceToHost);
    const bool same = std::memcmp(got.data(), ref.data(), y_bytes) == 0;
    std::vector<double> us;
    int next = 0;
    for (int r = 0; r < 5; ++r) {
      cudaEventRecord(e0, stream);
      for (int j = 0; j < 20; ++j) {
        run(a, w + w_elems * next, y);
        next = (next + 1) % copies;
      }
      cudaEventRecord(e1, stream);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      us.push_back(ms * 1000.0 / 20);
    }
    std::sort(us.begin(), us.end());
    cublasLtMatmulHeuristicResult_t chk = {};
    cublasLtMatmulAlgoCheck(handle, desc, la, lb, ld, ld, &a, &chk);
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "%8.2f us  waves %.2f  bits %s  tile %u stages %u cluster %u custom %u  (%s)",
                  us[2], chk.wavesCount, same ? "same" : "DIFFER",
                  Config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  Config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  Config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                  Config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), origin[i].c_str());
    rows.push_back({us[2], buf});
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.us < b.us; });
  for (const Row& r : rows) std::printf("%s\n", r.text.c_str());
  return 0;
}
