// Small helpers shared by the server tests: tensors in and out of protos, a config, a local
// single-process engine layer to compare against.
#ifndef MOED_TESTS_SERVER_TEST_UTIL_H_
#define MOED_TESTS_SERVER_TEST_UTIL_H_

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/comm/local_communicator.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/moe_layer.h"
#include "proto/chunking.h"
#include "proto/config_convert.h"
#include "proto/moe.grpc.pb.h"
#include "proto/tensor_convert.h"

namespace moe {

// Resident memory of process `pid` in bytes (0 if it is gone).
inline int64_t ResidentBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

inline std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline v1::Tensor FloatsToProto(const std::vector<int64_t>& shape,
                                const std::vector<float>& values) {
  v1::Tensor t;
  TensorToProto(Tensor::FromFloats(shape, values), &t);
  return t;
}

inline std::vector<float> ProtoToFloats(const v1::Tensor& t) {
  absl::StatusOr<Tensor> tensor = TensorFromProto("t", t);
  if (!tensor.ok()) return {};
  Tensor f = tensor->ConvertTo(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.num_elements());
}

inline std::vector<float> TensorFloats(const Tensor& t) {
  Tensor f = t.ConvertTo(DType::kFloat32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.num_elements());
}

// The tiny reference shape of docs/SPEC.md with both losses on.
inline v1::LayerConfig TinyConfig(uint64_t seed) {
  v1::LayerConfig c;
  c.set_hidden(32);
  c.set_ffn(64);
  c.set_num_experts(8);
  c.set_top_k(2);
  c.set_aux_loss_coeff(1e-2);
  c.set_z_loss_coeff(1e-3);
  c.set_init_seed(seed);
  return c;
}

// A single-process engine layer (EP = 1) with the same config.
struct LocalLayer {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  std::unique_ptr<MoeLayer> layer;
};
inline std::unique_ptr<LocalLayer> MakeLocalLayer(const v1::LayerConfig& proto,
                                                  const MoeLayerOptions& options = {}) {
  auto local = std::make_unique<LocalLayer>();
  absl::StatusOr<LayerConfig> config = ConfigFromProto(proto);
  if (!config.ok()) return nullptr;
  auto layer = MoeLayer::Create(*config, local->backend.get(), local->comm.get(),
                                /*cancelled=*/nullptr, options);
  if (!layer.ok()) return nullptr;
  local->layer = std::move(*layer);
  return local;
}

// Reads a whole chunk stream (GetWeights / GetGradients) into name -> floats.
template <typename Reader>
std::map<std::string, std::vector<float>> ReadChunks(Reader* reader, grpc::Status* status) {
  std::map<std::string, std::vector<float>> out;
  v1::TensorChunk chunk;
  while (reader->Read(&chunk)) {
    std::vector<float>& v = out[chunk.name()];
    const float* data = reinterpret_cast<const float*>(chunk.raw_data().data());
    v.insert(v.end(), data, data + chunk.raw_data().size() / sizeof(float));
  }
  *status = reader->Finish();
  return out;
}

// Largest |a - b| / max(1, |b|).
inline double MaxRelError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = std::abs(double(a[i]) - double(b[i])) / std::max(1.0, std::abs(double(b[i])));
    worst = std::max(worst, d);
  }
  return worst;
}

}  // namespace moe

#endif  // MOED_TESTS_SERVER_TEST_UTIL_H_
