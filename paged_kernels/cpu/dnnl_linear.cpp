// y = x W^T (+ b) in fp32 through oneDNN's C++ API, called directly (paged_kernels/cpu_linear.py says why).
//
// A weight is reordered once into the layout oneDNN's inner product picks for it on this CPU (``dnnl_linear_new``,
// ``dnnl_linear_pack``); a call then runs a primitive for its row count, built at its first use and kept
// (``dnnl_linear_run``). Primitives hold no weights: layers of one shape share them. Every entry returns 0, or -1
// with the reason in ``dnnl_linear_error`` (no C++ exception crosses the C boundary).
#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#if DNNL_VERSION_MAJOR < 3
#error "oneDNN 3 or later is needed (its primitive_desc constructors)"
#endif

namespace {

using dnnl::memory;
using Key = std::tuple<int64_t, int64_t, int64_t, bool>;  // rows, out features, in features, with bias

constexpr int64_t kLayoutRows = 16;  // the row count the weights' layout is chosen for; calls of any count use it
constexpr size_t kMaxPrimitives = 4096;  // rows x shapes kept; past it the cache starts over

struct State {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex lock;
  std::map<Key, dnnl::inner_product_forward> prims;
};

State& state() {
  static State s;
  return s;
}

dnnl::stream& stream() {  // one per calling thread (the executor calls from its torch thread only)
  thread_local dnnl::stream s(state().engine);
  return s;
}

thread_local std::string error;

memory::desc rows(int64_t m, int64_t n) { return {{m, n}, memory::data_type::f32, memory::format_tag::ab}; }

struct Weight {
  int64_t out, in;
  memory::desc layout;
};

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const dnnl::error& e) {
    error = std::string("oneDNN: ") + e.what();
  } catch (const std::exception& e) {
    error = e.what();
  }
  return -1;
}

}  // namespace

extern "C" {

const char* dnnl_linear_error() { return error.c_str(); }

// A weight of [out, in]: its handle, and the bytes its packed copy takes.
int dnnl_linear_new(int64_t out, int64_t in, void** handle, int64_t* bytes) {
  return guarded([&] {
    memory::desc any({out, in}, memory::data_type::f32, memory::format_tag::any);
    dnnl::inner_product_forward::primitive_desc pd(state().engine, dnnl::prop_kind::forward_inference,
                                                   rows(kLayoutRows, in), any, rows(kLayoutRows, out));
    auto* w = new Weight{out, in, pd.weights_desc()};
    *bytes = static_cast<int64_t>(w->layout.get_size());
    *handle = w;
  });
}

void dnnl_linear_free(void* handle) { delete static_cast<Weight*>(handle); }

// ``weight`` [out, in] row-major into ``packed`` (``bytes`` of ``dnnl_linear_new``).
int dnnl_linear_pack(void* handle, const float* weight, float* packed) {
  return guarded([&] {
    auto* w = static_cast<Weight*>(handle);
    auto& s = state();
    memory src(rows(w->out, w->in), s.engine, const_cast<float*>(weight));
    memory dst(w->layout, s.engine, packed);
    dnnl::reorder(src, dst).execute(stream(), src, dst);
    stream().wait();
  });
}

// y [m, out] = x [m, in] W^T (+ bias [out]), every tensor contiguous; ``bias`` may be null.
int dnnl_linear_run(void* handle, const float* x, const float* packed, const float* bias, float* y, int64_t m) {
  return guarded([&] {
    auto* w = static_cast<Weight*>(handle);
    auto& s = state();
    const Key key{m, w->out, w->in, bias != nullptr};
    memory::desc src = rows(m, w->in), dst = rows(m, w->out);
    memory::desc bmd({w->out}, memory::data_type::f32, memory::format_tag::a);
    dnnl::inner_product_forward prim;  // a handle (shared): still valid if another thread clears the cache
    {
      std::lock_guard<std::mutex> g(s.lock);
      auto it = s.prims.find(key);
      if (it == s.prims.end()) {
        if (s.prims.size() >= kMaxPrimitives) s.prims.clear();
        auto kind = dnnl::prop_kind::forward_inference;
        auto pd = bias ? dnnl::inner_product_forward::primitive_desc(s.engine, kind, src, w->layout, bmd, dst)
                       : dnnl::inner_product_forward::primitive_desc(s.engine, kind, src, w->layout, dst);
        it = s.prims.emplace(key, dnnl::inner_product_forward(pd)).first;
      }
      prim = it->second;
    }
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(src, s.engine, const_cast<float*>(x))},
        {DNNL_ARG_WEIGHTS, memory(w->layout, s.engine, const_cast<float*>(packed))},
        {DNNL_ARG_DST, memory(dst, s.engine, y)},
    };
    if (bias) args.emplace(DNNL_ARG_BIAS, memory(bmd, s.engine, const_cast<float*>(bias)));
    prim.execute(stream(), args);
  });
}

}  // extern "C"
