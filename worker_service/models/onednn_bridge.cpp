// oneDNN's packed GEMM as a plain C callback, for native code that runs a whole decode step
// (decode_layers.h) at row counts where oneDNN's GEMM beats Tessera's own kernels.
//
// oneDNN is linked into libtorch without its C API exported, so the GEMM is reached the way
// torch's Python reaches it: the `mkldnn::_linear_pointwise` operator through the dispatcher,
// over the weight layers.Linear.pack already packed (the same tensor, held by reference). This
// library is built against the running torch's headers and libraries (onednn_bridge.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>

namespace {

// One Linear's GEMM: its packed weight [N, K] and bias [N] in the compute dtype (float32
// over a bf16 model where the CPU lacks bf16 arithmetic), and the model dtype of x and out.
struct Gemm {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  int64_t K, N;
  c10::ScalarType model;
};

const c10::OperatorHandle& linear_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

// A new reference to the tensor whose TensorImpl is at `impl` (Python's Tensor._cdata).
at::Tensor borrow(int64_t impl) {
  return at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(
      reinterpret_cast<c10::TensorImpl*>(impl)));
}

}  // namespace

extern "C" {

// A GEMM context over the tensors at weight_impl / bias_impl (0: no bias), held until
// tessera_onednn_release. model_dtype: 0 float32, 1 bf16. Null where it cannot be made.
void* tessera_onednn_context(int64_t weight_impl, int64_t bias_impl, int64_t K, int64_t N,
                             int model_dtype) {
  try {
    auto* gemm = new Gemm{borrow(weight_impl), std::nullopt, K, N,
                          model_dtype ? at::kBFloat16 : at::kFloat};
    if (bias_impl) gemm->bias = borrow(bias_impl);
    return gemm;
  } catch (const std::exception&) {
    return nullptr;
  }
}

void tessera_onednn_release(void* gemm) { delete static_cast<Gemm*>(gemm); }

// out [rows, N] = x [rows, K] @ weight.T + bias, x and out in the model dtype (as
// layers.linear_onednn, with x cast to the compute dtype and the result cast back).
// Status: 0 ok, 1 the operator failed.
int tessera_onednn_gemm(void* context, const void* x, void* out, int64_t rows) {
  try {
    const auto& g = *static_cast<const Gemm*>(context);
    at::Tensor input = at::from_blob(const_cast<void*>(x), {rows, g.K}, at::dtype(g.model));
    input = input.to(g.weight.scalar_type());
    c10::Stack stack{input, g.weight, g.bias, "none", c10::List<std::optional<c10::Scalar>>(),
                     ""};
    linear_op().callBoxed(&stack);
    const at::Tensor result = stack[0].toTensor().to(g.model).contiguous();
    std::memcpy(out, result.data_ptr(), rows * g.N * result.element_size());
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}

}  // extern "C"
