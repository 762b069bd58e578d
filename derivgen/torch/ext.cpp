// derivgen's per-call path in C++: a validated plan's C kernels called on tensors, with
// their autograd node, so that an eager call runs no Python beyond the module's forward.
//
// Built on first use by derivgen/torch/ext.py (torch.utils.cpp_extension) and cached. One
// build serves every layer: a kernel is called through its address with its arguments
// in the order derivgen.runtime.abi gives, by class: a run of 64-bit integers (the dims,
// then data pointers), a run of doubles (the options), a run of data pointers, and the
// int thread count. The caller (derivgen/torch/plan.py) checks that a signature has
// this shape and counts each run.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <sys/mman.h>

#include <array>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// the longest runs a kernel call may have (the Python side checks a signature against them)
constexpr size_t MAX_LEAD = 14;  // 4 dims, then x (and dy) and the parameters' pointers
constexpr size_t MAX_OPTS = 6;   // options
constexpr size_t MAX_TAIL = 14;  // buffers, y and statistics; or statistics, dx and parameter gradients

using Caller = int (*)(void*, const int64_t*, const double*, const int64_t*, int);

template <size_t>
using I64 = int64_t;
template <size_t>
using F64 = double;

// one call shape: int f(int64_t x L, double x D, int64_t x T, int); data pointers pass as
// 64-bit integers (the same register or stack slot as a pointer on every 64-bit ABI)
template <size_t... L, size_t... D, size_t... T>
int call_shape(void* fn, const int64_t* lead, const double* opts, const int64_t* tail, int nthreads,
               std::index_sequence<L...>, std::index_sequence<D...>, std::index_sequence<T...>) {
  using Fn = int (*)(I64<L>..., F64<D>..., I64<T>..., int);
  return reinterpret_cast<Fn>(fn)(lead[L]..., opts[D]..., tail[T]..., nthreads);
}

template <size_t L, size_t D, size_t T>
int call_fixed(void* fn, const int64_t* lead, const double* opts, const int64_t* tail, int nthreads) {
  return call_shape(fn, lead, opts, tail, nthreads, std::make_index_sequence<L>{}, std::make_index_sequence<D>{},
                    std::make_index_sequence<T>{});
}

template <size_t L, size_t D, size_t... T>
constexpr std::array<Caller, sizeof...(T)> tails(std::index_sequence<T...>) {
  return {&call_fixed<L, D, T>...};
}

template <size_t L, size_t... D>
constexpr std::array<std::array<Caller, MAX_TAIL + 1>, sizeof...(D)> opts_rows(std::index_sequence<D...>) {
  return {tails<L, D>(std::make_index_sequence<MAX_TAIL + 1>{})...};
}

template <size_t... L>
constexpr auto caller_table(std::index_sequence<L...>) {
  return std::array<std::array<std::array<Caller, MAX_TAIL + 1>, MAX_OPTS + 1>, sizeof...(L)>{
      opts_rows<L>(std::make_index_sequence<MAX_OPTS + 1>{})...};
}

const auto CALLERS = caller_table(std::make_index_sequence<MAX_LEAD + 1>{});

// one kernel: its address and the lengths of its runs
struct Kernel {
  void* fn = nullptr;
  Caller call = nullptr;
  size_t lead = 0, nopts = 0, tail = 0;

  Kernel() = default;
  Kernel(int64_t address, size_t lead_, size_t nopts_, size_t tail_)
      : fn(reinterpret_cast<void*>(address)), lead(lead_), nopts(nopts_), tail(tail_) {
    TORCH_CHECK(lead <= MAX_LEAD && nopts <= MAX_OPTS && tail <= MAX_TAIL, "derivgen: kernel call shape out of range");
    call = CALLERS[lead][nopts][tail];
  }
};

int64_t address(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// A fresh output like t, advised to take transparent huge pages when it has HUGE_MIN bytes
// or more, before anything touches it (the rule and the reasons: derivgen/torch/tensors.py,
// advise_huge_pages): a page fault per 2 MiB instead of one per 4 KiB page of a large output
// glibc maps fresh on every call. DERIVGEN_HUGE_PAGES=0 (read once) turns it off; where the
// kernel has no transparent huge pages the advice fails and changes nothing.
constexpr int64_t HUGE = int64_t(1) << 21;
constexpr int64_t HUGE_MIN = int64_t(4) << 20;

bool huge_pages_wanted() {
  static const bool on = [] {
    const char* v = std::getenv("DERIVGEN_HUGE_PAGES");
    if (v == nullptr) return true;
    std::string s;
    for (const char* c = v; *c; ++c)
      if (!std::isspace(static_cast<unsigned char>(*c))) s += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    return s != "0" && s != "off" && s != "false" && s != "no";
  }();
  return on;
}

at::Tensor fresh_like(const at::Tensor& t) {
  at::Tensor o = at::empty_like(t);
#ifdef MADV_HUGEPAGE
  const int64_t n = static_cast<int64_t>(o.nbytes());
  if (n >= HUGE_MIN && huge_pages_wanted()) {
    const int64_t p = address(o);
    const int64_t lo = (p + HUGE - 1) / HUGE * HUGE, hi = (p + n) / HUGE * HUGE;
    if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), static_cast<size_t>(hi - lo), MADV_HUGEPAGE);
  }
#endif
  return o;
}

// a validated call signature of one layer and mode (contiguous CPU tensors, no per-group
// inputs, no buffers passed): what a call checks, the two kernels and what they are called with
struct Plan {
  std::string name;
  Kernel fwd, bwd;
  std::array<int64_t, 4> dims{};
  std::vector<std::vector<int64_t>> shapes;  // x, then the parameters
  std::vector<at::ScalarType> dtypes;
  size_t nnull = 0, nstat = 0;
  int64_t n_groups = 0, groups = 0;
  bool serial = true;
  py::object kernel;         // the layer's CKernel: its ``threads`` setting
  py::object slow_backward;  // the differentiable backward (create_graph=True): (dy, *tensors, statistics, options)
  std::vector<double> opts;  // the options of the last validated call
  bool have_opts = false;

  ~Plan() {  // the last owner may be an autograd node freed without the GIL
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      kernel = py::object();
      slow_backward = py::object();
    }
  }

  // the threads of a kernel call (the caller holds the GIL): one for a small x, else the
  // layer's own setting or torch's, as derivgen.torch.plan.plan_threads
  int threads() const {
    if (serial) return 1;
    const int own = py::cast<int>(kernel.attr("threads"));
    return own ? own : at::get_num_threads();
  }

  // the tensors of a call (a list: x, then the parameters), when they fit this plan
  bool fits(PyObject* list, std::vector<at::Tensor>& out) const {
    if (!PyList_CheckExact(list) || static_cast<size_t>(PyList_GET_SIZE(list)) != shapes.size()) return false;
    out.reserve(shapes.size());
    for (size_t k = 0; k < shapes.size(); ++k) {
      PyObject* o = PyList_GET_ITEM(list, k);
      if (!THPVariable_Check(o)) return false;
      const at::Tensor& t = THPVariable_Unpack(o);
      if (t.layout() != at::kStrided || !t.device().is_cpu() || t.scalar_type() != dtypes[k] || !t.is_contiguous() ||
          t.sizes() != c10::IntArrayRef(shapes[k]))
        return false;
      out.push_back(t);
    }
    return true;
  }

  // the options of a call (a tuple of floats) are the validated ones
  bool same_options(PyObject* tuple) const {
    if (!have_opts || !PyTuple_CheckExact(tuple) || static_cast<size_t>(PyTuple_GET_SIZE(tuple)) != opts.size())
      return false;
    for (size_t k = 0; k < opts.size(); ++k) {
      PyObject* o = PyTuple_GET_ITEM(tuple, k);
      if (!PyFloat_Check(o) || PyFloat_AS_DOUBLE(o) != opts[k]) return false;
    }
    return true;
  }

  // y and the statistics (one (statistics, groups) float64 tensor) by the forward kernel;
  // the caller holds the GIL, released around a kernel that may run threads
  void forward(const std::vector<at::Tensor>& tens, at::Tensor& y, at::Tensor& st) const {
    const int nthreads = threads();
    y = fresh_like(tens[0]);
    st = at::empty({static_cast<int64_t>(nstat), n_groups}, at::TensorOptions().dtype(at::kDouble));
    std::array<int64_t, MAX_LEAD> lead{};
    std::array<double, MAX_OPTS> o{};
    std::array<int64_t, MAX_TAIL> tail{};
    size_t i = 0;
    for (int64_t d : dims) lead[i++] = d;
    for (const auto& t : tens) lead[i++] = address(t);
    std::copy(opts.begin(), opts.end(), o.begin());
    size_t j = nnull;  // the buffers this mode does not read: NULL
    tail[j++] = address(y);
    const int64_t base = address(st);
    for (size_t s = 0; s < nstat; ++s) tail[j++] = base + static_cast<int64_t>(8 * n_groups * s);
    int rc;
    if (serial) {
      rc = fwd.call(fwd.fn, lead.data(), o.data(), tail.data(), nthreads);
    } else {
      py::gil_scoped_release nogil;
      rc = fwd.call(fwd.fn, lead.data(), o.data(), tail.data(), nthreads);
    }
    if (rc != 0) {
      PyErr_SetString(PyExc_MemoryError, (name + ": forward kernel could not allocate its work buffer").c_str());
      throw py::error_already_set();
    }
  }

  // (dx, dparams...) by the backward kernel on the forward's tensors; runs without the GIL
  variable_list backward(const at::Tensor& dy_in, const std::vector<at::Tensor>& tens, const at::Tensor& st,
                         const std::vector<double>& options, int nthreads) const {
    const at::Tensor dy = dy_in.is_contiguous() ? dy_in : dy_in.contiguous();
    variable_list out;
    out.reserve(tens.size());
    for (const auto& t : tens) out.push_back(fresh_like(t));
    std::array<int64_t, MAX_LEAD> lead{};
    std::array<int64_t, MAX_TAIL> tail{};
    size_t i = 0;
    for (int64_t d : dims) lead[i++] = d;
    lead[i++] = address(tens[0]);
    lead[i++] = address(dy);
    for (size_t k = 1; k < tens.size(); ++k) lead[i++] = address(tens[k]);
    size_t j = 0;
    const int64_t base = address(st);
    for (size_t s = 0; s < nstat; ++s) tail[j++] = base + static_cast<int64_t>(8 * n_groups * s);
    for (const auto& g : out) tail[j++] = address(g);
    if (bwd.call(bwd.fn, lead.data(), options.data(), tail.data(), nthreads) != 0) {
      py::gil_scoped_acquire gil;
      PyErr_SetString(PyExc_MemoryError, (name + ": backward kernel could not allocate its work buffer").c_str());
      throw python_error();
    }
    return out;
  }
};

// the autograd node of one eager call: the backward kernel on the saved tensors, or the
// differentiable backward operator when the graph must be differentiable (create_graph=True)
struct DerivgenBackward : public Node {
  std::shared_ptr<const Plan> plan;
  std::vector<SavedVariable> saved;  // x, then the parameters (version counters checked)
  at::Tensor st;
  std::vector<double> opts;

  std::string name() const override { return "DerivgenBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved) s.reset_data();
    st.reset();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<at::Tensor> tens;
    tens.reserve(saved.size());
    for (auto& s : saved) tens.push_back(s.unpack());  // raises after the graph was freed
    // y's gradient (zeros where none flowed back, as a Python autograd.Function materializes it)
    const at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(tens[0]);
    if (c10::GradMode::is_enabled()) return differentiable(dy, tens);
    int nthreads = 1;
    if (!plan->serial) {
      py::gil_scoped_acquire gil;
      nthreads = plan->threads();
    }
    return plan->backward(dy, tens, st, opts, nthreads);
  }

  variable_list differentiable(const at::Tensor& dy, const std::vector<at::Tensor>& tens) {
    py::gil_scoped_acquire gil;
    try {
      py::tuple args(tens.size() + 3);
      args[0] = py::reinterpret_steal<py::object>(THPVariable_Wrap(dy));
      for (size_t k = 0; k < tens.size(); ++k) args[k + 1] = py::reinterpret_steal<py::object>(THPVariable_Wrap(tens[k]));
      args[tens.size() + 1] = py::reinterpret_steal<py::object>(THPVariable_Wrap(st));
      args[tens.size() + 2] = py::cast(opts);
      py::object got = plan->slow_backward(*args);
      variable_list out;
      for (py::handle g : got) out.push_back(g.is_none() ? at::Tensor() : THPVariable_Unpack(g.ptr()));
      return out;
    } catch (py::error_already_set& e) {
      e.restore();
      throw python_error();
    }
  }
};

// the Python face of a plan
struct PyPlan {
  std::shared_ptr<Plan> plan;

  // (y, statistics) of a call whose tensors, options and groups fit; None otherwise
  py::object call(py::handle tens_list, py::handle opts_tuple, int64_t groups) {
    Plan& p = *plan;
    std::vector<at::Tensor> tens;
    if (groups != p.groups || !p.same_options(opts_tuple.ptr()) || !p.fits(tens_list.ptr(), tens)) return py::none();
    at::Tensor y, st;
    bool need_grad = false;
    if (c10::GradMode::is_enabled())
      for (const auto& t : tens) need_grad = need_grad || t.requires_grad();
    p.forward(tens, y, st);
    if (need_grad) {
      auto node = c10::make_intrusive<DerivgenBackward>();
      node->plan = plan;
      node->set_next_edges(torch::autograd::collect_next_edges(at::TensorList(tens)));
      node->saved.reserve(tens.size());
      for (const auto& t : tens) node->saved.emplace_back(t, false);
      node->st = st;
      node->opts = p.opts;
      torch::autograd::set_history(y, node);
    }
    return py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y))),
                          py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(st))));
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("MAX_LEAD") = MAX_LEAD;
  m.attr("MAX_OPTS") = MAX_OPTS;
  m.attr("MAX_TAIL") = MAX_TAIL;
  py::class_<PyPlan>(m, "Plan")
      .def(py::init([](std::string name, py::tuple fwd, py::tuple bwd, std::vector<int64_t> dims,
                       std::vector<std::vector<int64_t>> shapes, std::vector<at::ScalarType> dtypes, size_t nnull, size_t nstat,
                       int64_t n_groups, int64_t groups, bool serial, py::object kernel, py::object slow_backward) {
        auto p = std::make_shared<Plan>();
        p->name = std::move(name);
        p->fwd = Kernel(fwd[0].cast<int64_t>(), fwd[1].cast<size_t>(), fwd[2].cast<size_t>(), fwd[3].cast<size_t>());
        p->bwd = Kernel(bwd[0].cast<int64_t>(), bwd[1].cast<size_t>(), bwd[2].cast<size_t>(), bwd[3].cast<size_t>());
        TORCH_CHECK(dims.size() == 4, "derivgen: four dims");
        std::copy(dims.begin(), dims.end(), p->dims.begin());
        TORCH_CHECK(dtypes.size() == shapes.size(), "derivgen: a dtype per tensor");
        p->shapes = std::move(shapes);
        p->dtypes = std::move(dtypes);
        p->nnull = nnull;
        p->nstat = nstat;
        p->n_groups = n_groups;
        p->groups = groups;
        p->serial = serial;
        p->kernel = std::move(kernel);
        p->slow_backward = std::move(slow_backward);
        return PyPlan{p};
      }))
      .def("set_options",
           [](PyPlan& self, std::vector<double> opts) {
             TORCH_CHECK(opts.size() == self.plan->fwd.nopts, "derivgen: ", self.plan->fwd.nopts, " options expected");
             self.plan->opts = std::move(opts);
             self.plan->have_opts = true;
           })
      .def("__call__", &PyPlan::call);
}
