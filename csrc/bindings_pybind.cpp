// kvcache._native: the Python face of the native core. Takes raw addresses and integer
// stream handles, never torch objects, so the module is independent of torch's C++ ABI.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "kvc.h"
#include "kvc_cuda.h"
#include "kvc_keys.h"
#include "kvc_lowered.h"

namespace py = pybind11;

namespace {

using IdArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

kvc::TransferSpec make_spec(const IdArray& block_ids, const std::vector<uint64_t>& chunk_ptrs,
                            int64_t blocks_per_chunk, int64_t last_chunk_blocks,
                            int64_t skip_blocks, bool to_chunks) {
  if (block_ids.ndim() != 1) throw std::invalid_argument("block_ids must be one-dimensional");
  kvc::TransferSpec spec;
  spec.block_ids = block_ids.data();
  spec.n_blocks = block_ids.shape(0);
  spec.chunk_ptrs = chunk_ptrs.data();
  spec.n_chunks = static_cast<int64_t>(chunk_ptrs.size());
  spec.blocks_per_chunk = blocks_per_chunk;
  spec.last_chunk_blocks = last_chunk_blocks;
  spec.skip_blocks = skip_blocks;
  spec.to_chunks = to_chunks;
  return spec;
}


// A bytes-like object's buffer, held (and released) for the length of one call.
class HeldBuffer {
 public:
  explicit HeldBuffer(PyObject* obj) {
    if (PyObject_GetBuffer(obj, &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~HeldBuffer() { PyBuffer_Release(&view_); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  kvc::PackedIds ids() const {
    return {static_cast<const uint8_t*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
};

std::vector<uint8_t> exact_bytes(const py::bytes& b, size_t n, const char* what) {
  std::string s = b;
  if (s.size() != n) throw std::invalid_argument(std::string(what) + " must be " + std::to_string(n) + " bytes");
  return {s.begin(), s.end()};
}

py::object key_int(const kvc::Digest& d) {
  PyObject* v = _PyLong_FromByteArray(d.b, kvc::kKeyBytes, /*little_endian=*/1, /*is_signed=*/0);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// kvcache.keys.ChunkHasher.keys_of_run: each prompt's chunk keys (ints, as
// int.from_bytes(digest, "little")) and how many leading chunks it shares with the one before.
py::tuple chain_keys_u32(const py::bytes& root, const py::bytes& person, size_t chunk_tokens,
                         const py::sequence& prompts) {
  kvc::Digest r;
  std::vector<uint8_t> rb = exact_bytes(root, kvc::kKeyBytes, "root");
  std::memcpy(r.b, rb.data(), kvc::kKeyBytes);
  std::vector<uint8_t> pb = exact_bytes(person, 16, "person");
  if (chunk_tokens == 0) throw std::invalid_argument("chunk_tokens must be positive");
  std::vector<std::unique_ptr<HeldBuffer>> held;
  std::vector<kvc::PackedIds> ids;
  const size_t n = py::len(prompts);
  held.reserve(n);
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    held.push_back(std::make_unique<HeldBuffer>(prompts[i].ptr()));
    ids.push_back(held.back()->ids());
  }
  std::vector<std::vector<kvc::Digest>> digests;
  std::vector<size_t> shared;
  {
    // Hashing touches no Python object: other threads run meanwhile (a daemon's I/O thread
    // answers other clients while a worker hashes a prompt of millions of tokens). The views
    // in ``held`` keep every buffer alive and unresized; a caller that writes into its own
    // ids meanwhile gets keys of whatever it wrote, as it would between two calls.
    py::gil_scoped_release unlocked;
    kvc::chain_keys_u32(r, pb.data(), ids, chunk_tokens * 4, digests, shared);
  }
  py::list keys(n);
  py::list same(n);
  py::list before;
  for (size_t i = 0; i < n; ++i) {
    py::list row(digests[i].size());
    for (size_t c = 0; c < digests[i].size(); ++c) {
      row[c] = c < shared[i] ? py::object(before[c]) : key_int(digests[i][c]);
    }
    keys[i] = row;
    same[i] = py::int_(shared[i]);
    before = row;
  }
  return py::make_tuple(keys, same);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvcache native core: layout table, CPU twin and CUDA block-copy kernels";

  static py::exception<kvc::CudaUnavailable> cuda_unavailable(m, "CudaUnavailable",
                                                              PyExc_RuntimeError);
  static py::exception<kvc::BlockIdOutOfRange> block_out_of_range(m, "BlockIdOutOfRange",
                                                                  PyExc_IndexError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvc::BlockIdOutOfRange& e) {
      py::object err =
          py::reinterpret_borrow<py::object>(block_out_of_range.ptr())(py::str(e.what()));
      err.attr("position") = e.position;
      err.attr("block_id") = e.block_id;
      PyErr_SetObject(block_out_of_range.ptr(), err.ptr());
    } catch (const kvc::CudaUnavailable& e) {
      cuda_unavailable(e.what());
    }
  });

  m.def(
      "layout_table",
      []() {
        py::list rows;
        for (const auto& r : kvc::layout_table()) {
          py::dict d;
          d["name"] = r.name;
          d["id"] = r.id;
          d["kv"] = r.kv;
          d["depth"] = r.depth;
          d["rank"] = r.rank;
          rows.append(d);
        }
        return rows;
      },
      "Rows of csrc/layouts.def: name, id, kv, depth (list nesting), rank.");

  m.def(
      "page_placements",
      [](int fmt, int64_t num_layers, int64_t num_blocks) {
        int64_t stride = 0;
        auto places = kvc::page_placements(fmt, num_layers, num_blocks, &stride);
        py::list out;
        for (const auto& p : places) out.append(py::make_tuple(p.tensor, p.offset_pages));
        return py::make_tuple(out, stride);
      },
      py::arg("fmt"), py::arg("num_layers"), py::arg("num_blocks"),
      "([(tensor index, page offset) per layer*kv + k], block stride in pages).");

  m.def("expected_num_tensors", &kvc::expected_num_tensors, py::arg("fmt"),
        py::arg("num_layers"));

  py::class_<kvc::PageTable>(m, "PageTable")
      .def(py::init(&kvc::make_page_table), py::arg("fmt"), py::arg("num_layers"),
           py::arg("num_blocks"), py::arg("page_bytes"), py::arg("tensor_ptrs"), py::arg("tensor_bytes"))
      .def_readonly("fmt", &kvc::PageTable::fmt)
      .def_readonly("num_layers", &kvc::PageTable::num_layers)
      .def_readonly("kv", &kvc::PageTable::kv)
      .def_readonly("num_blocks", &kvc::PageTable::num_blocks)
      .def_readonly("page_bytes", &kvc::PageTable::page_bytes)
      .def_readonly("block_stride_bytes", &kvc::PageTable::block_stride_bytes)
      .def_readonly("base", &kvc::PageTable::base);

  m.def(
      "validate",
      [](const kvc::PageTable& table, const IdArray& block_ids,
         const std::vector<uint64_t>& chunk_ptrs, int64_t blocks_per_chunk,
         int64_t last_chunk_blocks, int64_t skip_blocks) {
        kvc::validate(table, make_spec(block_ids, chunk_ptrs, blocks_per_chunk,
                                       last_chunk_blocks, skip_blocks, true));
      },
      py::arg("table"), py::arg("block_ids"), py::arg("chunk_ptrs"),
      py::arg("blocks_per_chunk"), py::arg("last_chunk_blocks"), py::arg("skip_blocks"));

  m.def(
      "cpu_copy",
      [](const kvc::PageTable& table, const IdArray& block_ids,
         const std::vector<uint64_t>& chunk_ptrs, int64_t blocks_per_chunk,
         int64_t last_chunk_blocks, int64_t skip_blocks, bool to_chunks, int num_threads) {
        auto spec = make_spec(block_ids, chunk_ptrs, blocks_per_chunk, last_chunk_blocks,
                              skip_blocks, to_chunks);
        py::gil_scoped_release release;
        kvc::cpu_copy(table, spec, num_threads);
      },
      py::arg("table"), py::arg("block_ids"), py::arg("chunk_ptrs"),
      py::arg("blocks_per_chunk"), py::arg("last_chunk_blocks"), py::arg("skip_blocks"),
      py::arg("to_chunks"), py::arg("num_threads") = 0,
      "Copy pages between engine blocks and chunks on the CPU; releases the GIL.");

  py::class_<kvc::LoweredCopier>(m, "LoweredCopier")
      .def(py::init<>(), py::call_guard<py::gil_scoped_release>())
      .def(
          "copy",
          [](kvc::LoweredCopier& self, const kvc::PageTable& table, const IdArray& block_ids,
             const std::vector<uint64_t>& chunk_ptrs, int64_t blocks_per_chunk,
             int64_t last_chunk_blocks, int64_t skip_blocks, bool to_chunks, int num_threads) {
            auto spec = make_spec(block_ids, chunk_ptrs, blocks_per_chunk, last_chunk_blocks,
                                  skip_blocks, to_chunks);
            py::gil_scoped_release release;
            self.copy(table, spec, num_threads);
          },
          py::arg("table"), py::arg("block_ids"), py::arg("chunk_ptrs"),
          py::arg("blocks_per_chunk"), py::arg("last_chunk_blocks"), py::arg("skip_blocks"),
          py::arg("to_chunks"), py::arg("num_threads") = 0,
          "cpu_copy on the copier's lowered thread; blocks, with the GIL released, until done.")
      .def_property_readonly("priority", &kvc::LoweredCopier::priority,
                             "The class its thread got: idle, nice, none, or pending (not yet lowered).")
      .def_property_readonly("thread_id", &kvc::LoweredCopier::thread_id,
                             "Its thread's kernel id.");

  m.def(
      "emulate_kernel",
      [](const kvc::PageTable& table, const IdArray& block_ids,
         const std::vector<uint64_t>& chunk_ptrs, int64_t blocks_per_chunk,
         int64_t last_chunk_blocks, int64_t skip_blocks, bool to_chunks) {
        auto spec = make_spec(block_ids, chunk_ptrs, blocks_per_chunk, last_chunk_blocks,
                              skip_blocks, to_chunks);
        py::gil_scoped_release release;
        return kvc::emulate_kernel(table, spec);
      },
      py::arg("table"), py::arg("block_ids"), py::arg("chunk_ptrs"),
      py::arg("blocks_per_chunk"), py::arg("last_chunk_blocks"), py::arg("skip_blocks"),
      py::arg("to_chunks"),
      "The CUDA kernel's body run over its grid on the CPU (tests only); returns the word size.");

  m.def(
      "parallel_memcpy",
      [](uint64_t dst, uint64_t src, int64_t nbytes, int num_threads) {
        py::gil_scoped_release release;
        kvc::parallel_memcpy(dst, src, nbytes, num_threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads") = 0,
      "The CPU ceiling for benchmarks: memcpy of the same bytes with the same threads.");

  m.def("copy_unit_bytes", [](const kvc::PageTable& t, const std::vector<uint64_t>& chunks) {
    return kvc::copy_unit_bytes(t, chunks.data(), static_cast<int64_t>(chunks.size()));
  });
  m.def("chain_keys_u32", &chain_keys_u32, py::arg("root"), py::arg("person"),
        py::arg("chunk_tokens"), py::arg("prompts"),
        "Chunk keys of prompts of one key scope (uint32 ids, packed), hashed in one call.");
  m.def(
      "blake2b_16",
      [](const py::bytes& person, const py::bytes& data) {
        std::vector<uint8_t> pb = exact_bytes(person, 16, "person");
        std::string s = data;
        kvc::Digest d = kvc::blake2b_16(
            pb.data(), {{reinterpret_cast<const uint8_t*>(s.data()), s.size()}});
        return py::bytes(reinterpret_cast<const char*>(d.b), kvc::kKeyBytes);
      },
      py::arg("person"), py::arg("data"), "BLAKE2b, 16-byte digest, personalised (tests).");
  m.def("cuda_compiled", &kvc::cuda_compiled, "True when the CUDA kernels were built.");
  m.def("cuda_device_count", &kvc::cuda_device_count,
        "Visible CUDA devices; 0 without a driver. Never raises.");

  py::class_<kvc::CudaTransfer>(m, "CudaTransfer")
      .def(py::init<const kvc::PageTable&, int, int64_t, int64_t>(), py::arg("table"),
           py::arg("device"), py::arg("max_block_ids"), py::arg("max_chunks"))
      .def(
          "copy",
          [](kvc::CudaTransfer& self, const IdArray& block_ids,
             const std::vector<uint64_t>& chunk_ptrs, int64_t blocks_per_chunk,
             int64_t last_chunk_blocks, int64_t skip_blocks, bool to_chunks, uint64_t stream) {
            auto spec = make_spec(block_ids, chunk_ptrs, blocks_per_chunk, last_chunk_blocks,
                                  skip_blocks, to_chunks);
            py::gil_scoped_release release;
            self.copy(spec, stream);
          },
          py::arg("block_ids"), py::arg("chunk_ptrs"), py::arg("blocks_per_chunk"),
          py::arg("last_chunk_blocks"), py::arg("skip_blocks"), py::arg("to_chunks"),
          py::arg("stream"))
      .def_property_readonly("max_block_ids", &kvc::CudaTransfer::max_block_ids)
      .def_property_readonly("last_copy_unit", &kvc::CudaTransfer::last_copy_unit);
}
