// The only translation unit of embserve-server that sees torch: the loader's Model behind runner.h's plain types.
#include "runner.h"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cstring>
#include <iostream>
#include <tuple>

#include "embserve/loader.h"

namespace embserve::server {
namespace {

at::Tensor view(const void* data, int64_t count, int width, at::ScalarType wide, at::ScalarType narrow) {
  // from_blob never owns nor writes: the request's bytes stay the caller's
  auto options = at::TensorOptions().dtype(width == 8 ? wide : narrow);
  return torch::from_blob(const_cast<void*>(data), {count}, options);
}

class ModelRunner : public Runner {
 public:
  explicit ModelRunner(Model model) : model_(std::move(model)) {
    for (const auto& f : model_.features())
      shape_.features.push_back(
          {f.name, f.table, f.num_embeddings, f.embedding_dim, f.pooling, f.column_start, f.column_end});
    shape_.output_dim = model_.output_dim();
    shape_.num_dense_features = model_.num_dense_features();
    shape_.world_size = model_.world_size();
  }

  const ModelShape& shape() const override { return shape_; }
  HotRowCacheInfo cache() const { return model_.hot_row_cache(); }

  void run(Forward forward, const SparseBatch& batch, const std::vector<Destination>& destinations) const override {
    try {
      c10::InferenceMode guard;
      at::Tensor values = view(batch.ids, batch.num_ids, batch.id_width, at::kLong, at::kInt);
      at::Tensor lengths = view(batch.lengths, batch.num_lengths, batch.length_width, at::kLong, at::kInt);
      std::optional<at::Tensor> weights;
      if (batch.weights != nullptr)
        weights = torch::from_blob(const_cast<float*>(batch.weights), {batch.num_ids}, at::kFloat);
      // the server validated every request already (request.cpp, the loader's rules and words): the loader's
      // unchecked entries run it without checking again
      at::Tensor pooled, scores;
      if (forward == Forward::Lookup) {
        pooled = model_.lookup_unchecked(values, lengths, weights);
      } else {
        at::Tensor dense = torch::from_blob(const_cast<float*>(batch.dense),
                                            {batch.batch, shape_.num_dense_features}, at::kFloat);
        // one forward pools once and scores: Both keeps the pooled lookups, Predict the scores only
        std::tie(pooled, scores) = model_.lookup_and_predict_unchecked(dense, values, lengths, weights);
      }
      // a CUDA model answers on its device: the destinations are host memory
      if (!pooled.is_cpu()) pooled = pooled.to(at::kCPU);
      if (scores.defined() && !scores.is_cpu()) scores = scores.to(at::kCPU);
      // a contiguous float32 answer is copied row range by row range from its memory (no tensor op per call)
      const bool flat = pooled.is_contiguous() && pooled.scalar_type() == at::kFloat && pooled.dim() == 2 &&
                        pooled.size(1) == shape_.output_dim;
      for (const auto& d : destinations) {
        if (d.embeddings != nullptr && flat && !d.embeddings_fp16 && d.row_start + d.rows <= pooled.size(0)) {
          const size_t width = static_cast<size_t>(shape_.output_dim);
          std::memcpy(d.embeddings, pooled.data_ptr<float>() + static_cast<size_t>(d.row_start) * width,
                      static_cast<size_t>(d.rows) * width * sizeof(float));
        } else if (d.embeddings != nullptr) {
          at::Tensor rows = pooled.narrow(0, d.row_start, d.rows);
          if (d.embeddings_fp16) rows = rows.to(at::kHalf);
          rows = rows.contiguous();
          std::memcpy(d.embeddings, rows.data_ptr(), static_cast<size_t>(rows.numel() * rows.element_size()));
        }
        if (d.scores != nullptr && scores.is_contiguous() && scores.scalar_type() == at::kFloat && scores.dim() >= 1 &&
                   scores.numel() == scores.size(0) && d.row_start + d.rows <= scores.size(0)) {
          std::memcpy(d.scores, scores.data_ptr<float>() + d.row_start, static_cast<size_t>(d.rows) * sizeof(float));
        } else if (d.scores != nullptr) {
          at::Tensor rows = scores.narrow(0, d.row_start, d.rows).contiguous();
          std::memcpy(d.scores, rows.data_ptr<float>(), static_cast<size_t>(rows.numel()) * sizeof(float));
        }
      }
    } catch (const RequestError& err) {
      throw RunnerRequestError(err.what());
    } catch (const std::exception& err) {
      throw RunnerError(err.what());
    }
  }

 private:
  Model model_;
  ModelShape shape_;
};

}  // namespace

std::unique_ptr<Runner> Runner::load(const std::string& artifact_dir, const RunnerOptions& options) {
  LoadOptions load_options;
  load_options.verify = options.verify_full ? Verify::Full : Verify::None;
  load_options.intra_op_threads = options.intra_op_threads;
  load_options.kernel_threads = options.kernel_threads;
  load_options.backend = options.pt2 ? Backend::Pt2 : Backend::TorchScript;
  try {
    if (!options.hot_rows_file.empty()) load_options.hot_rows = read_hot_rows(options.hot_rows_file);
    load_options.prefetch = options.prefetch == "on" ? Prefetch::On : options.prefetch == "off" ? Prefetch::Off
                                                                                               : Prefetch::Auto;
    auto runner = std::make_unique<ModelRunner>(Model::load(artifact_dir, load_options));
    if (const HotRowCacheInfo cache = runner->cache(); cache.rows > 0)  // the Python server's line (hot_rows.py)
      std::cerr << "hot-row cache: " << cache.rows << " rows of " << cache.tables << " tables resident ("
                << cache.bytes << " bytes)" << std::endl;
    return runner;
  } catch (const ConfigError& err) {  // the load options come from --hot-rows-file and --prefetch
    const std::string flag = std::string(err.what()).rfind("prefetch", 0) == 0 ? "--prefetch: " : "--hot-rows-file: ";
    throw RunnerError(flag + err.what(), "ConfigError");
  } catch (const ManifestError& err) {
    throw RunnerError(err.what(), "ArtifactError(kind=manifest)");
  } catch (const ChecksumError& err) {
    throw RunnerError(err.what(), "ArtifactError(kind=checksum)");
  } catch (const LibraryError& err) {
    throw RunnerError(err.what(), "ArtifactError(kind=library)");
  } catch (const ModelError& err) {
    throw RunnerError(err.what(), "ArtifactError(kind=model)");
  } catch (const std::exception& err) {
    throw RunnerError(err.what());
  }
}

}  // namespace embserve::server
