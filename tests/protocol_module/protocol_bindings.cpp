// gemm_ar_protocol: the tile-protocol functions of csrc/include/gemm_ar exposed to Python, so the tests can check
// the very code the engines and kernels compile against independent Python formulations. A module of the tests
// (tests/protocol_module_build.py builds it), not of the product.
#include <pybind11/pybind11.h>

#include "gemm_ar/protocol.hpp"
#include "gemm_ar/sequence_parallel.hpp"

namespace py = pybind11;

namespace gemm_ar {

namespace {

py::tuple pair(const int64_t (&v)[2]) { return py::make_tuple(v[0], v[1]); }

void bind_tile_plan(py::module_& m) {
  py::class_<TilePlan>(m, "TilePlan", "Tile grid of one problem (read-only); built by make_tile_plan.")
      .def_readonly("m", &TilePlan::m)
      .def_readonly("n", &TilePlan::n)
      .def_readonly("k", &TilePlan::k)
      .def_readonly("base_m", &TilePlan::base_m)
      .def_readonly("base_n", &TilePlan::base_n)
      .def_readonly("base_k", &TilePlan::base_k)
      .def_readonly("k_step", &TilePlan::k_step)
      .def_readonly("m_tiles", &TilePlan::m_tiles)
      .def_readonly("n_tiles", &TilePlan::n_tiles)
      .def_readonly("tiles", &TilePlan::tiles)
      .def_readonly("pad_m", &TilePlan::pad_m)
      .def_readonly("pad_n", &TilePlan::pad_n)
      .def_readonly("pad_k", &TilePlan::pad_k)
      .def_readonly("sub_m", &TilePlan::sub_m)
      .def_readonly("stripes", &TilePlan::stripes);

  // The C++ bool result becomes "a TilePlan or None".
  m.def(
      "make_tile_plan",
      [](int64_t m_, int64_t n, int64_t k, int64_t base_m, int64_t base_n, int64_t base_k, int64_t k_slices,
         int64_t sub_m) -> py::object {
        TilePlan plan{};
        if (!make_tile_plan(&plan, m_, n, k, base_m, base_n, base_k, k_slices, sub_m)) return py::none();
        return py::cast(plan);
      },
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("base_m"), py::arg("base_n"), py::arg("base_k"),
      py::arg("k_slices"), py::arg("sub_m"), "TilePlan, or None when the arguments are rejected.");
  m.def(
      "tile_row", [](const TilePlan& p, int64_t t) { return tile_row(p, t); }, py::arg("plan"), py::arg("t"));
  m.def(
      "tile_col", [](const TilePlan& p, int64_t t) { return tile_col(p, t); }, py::arg("plan"), py::arg("t"));
  m.def(
      "tile_rows", [](const TilePlan& p, int64_t mi) { return tile_rows(p, mi); }, py::arg("plan"), py::arg("mi"));
  m.def(
      "tile_cols", [](const TilePlan& p, int64_t ni) { return tile_cols(p, ni); }, py::arg("plan"), py::arg("ni"));
  m.def(
      "stripe_rows", [](const TilePlan& p, int64_t mi, int64_t s) { return stripe_rows(p, mi, s); }, py::arg("plan"),
      py::arg("mi"), py::arg("stripe"));
  m.def("ceil_div", &ceil_div, py::arg("a"), py::arg("b"));
}

void bind_partition_and_swizzle(py::module_& m) {
  m.def(
      "block_range",
      [](int64_t items, int64_t blocks, int64_t b) {
        const Range r = block_range(items, blocks, b);
        return py::make_tuple(r.begin, r.end);
      },
      py::arg("items"), py::arg("blocks"), py::arg("b"), "(begin, end) of block b.");
  m.def("max_block_items", &max_block_items, py::arg("items"), py::arg("blocks"));
  m.def("zigzag_tile", &zigzag_tile, py::arg("linear"), py::arg("n_tiles"));
  m.def("zigzag_linear", &zigzag_linear, py::arg("t"), py::arg("n_tiles"));
}

void bind_ownership_and_schedule(py::module_& m) {
  m.def("owner_of", &owner_of, py::arg("t"), py::arg("world"));
  m.def("owned_tile_count", &owned_tile_count, py::arg("tiles"), py::arg("world"), py::arg("rank"));
  m.def("max_owned_tile_count", &max_owned_tile_count, py::arg("tiles"), py::arg("world"));
  m.def("local_subtile", &local_subtile, py::arg("t"), py::arg("stripe"), py::arg("world"), py::arg("stripes"));
  m.def("subtile_tile", &subtile_tile, py::arg("l"), py::arg("owner"), py::arg("world"), py::arg("stripes"));
  m.def("subtile_stripe", &subtile_stripe, py::arg("l"), py::arg("stripes"));
  m.def("owned_subtile_count", &owned_subtile_count, py::arg("tiles"), py::arg("world"), py::arg("rank"),
        py::arg("stripes"));
  m.def("max_owned_subtile_count", &max_owned_subtile_count, py::arg("tiles"), py::arg("world"), py::arg("stripes"));
  m.def("run_owner_of", &run_owner_of, py::arg("t"), py::arg("world"), py::arg("run"));
  m.def("run_owned_tile_count", &run_owned_tile_count, py::arg("tiles"), py::arg("world"), py::arg("rank"),
        py::arg("run"));
  m.def("run_max_owned_subtile_count", &run_max_owned_subtile_count, py::arg("tiles"), py::arg("world"),
        py::arg("stripes"), py::arg("run"));
  m.def("run_local_subtile", &run_local_subtile, py::arg("t"), py::arg("stripe"), py::arg("world"), py::arg("stripes"),
        py::arg("run"));
  m.def("run_subtile_tile", &run_subtile_tile, py::arg("l"), py::arg("owner"), py::arg("world"), py::arg("stripes"),
        py::arg("run"));

  py::class_<RowChunks>(m, "RowChunks", "Row chunks of a row-chunked plan (read-only).")
      .def_readonly("count", &RowChunks::count)
      .def_readonly("rows", &RowChunks::rows)
      .def_readonly("m_tiles", &RowChunks::m_tiles);
  // The C++ bool result becomes "(TilePlan, RowChunks) or None".
  m.def(
      "make_row_chunked_plan",
      [](int64_t count, int64_t rows, int64_t n, int64_t k, int64_t base_m, int64_t base_n, int64_t base_k,
         int64_t k_slices, int64_t sub_m) -> py::object {
        TilePlan plan{};
        RowChunks chunks{};
        if (!make_row_chunked_plan(&plan, &chunks, count, rows, n, k, base_m, base_n, base_k, k_slices, sub_m)) {
          return py::none();
        }
        return py::make_tuple(plan, chunks);
      },
      py::arg("count"), py::arg("rows"), py::arg("n"), py::arg("k"), py::arg("base_m"), py::arg("base_n"),
      py::arg("base_k"), py::arg("k_slices"), py::arg("sub_m"));
  m.def("chunk_of_tile_row", &chunk_of_tile_row, py::arg("chunks"), py::arg("mi"));
  m.def("chunk_tile_count", &chunk_tile_count, py::arg("plan"), py::arg("chunks"));
  m.def("chunk_tile_row", &chunk_tile_row, py::arg("chunks"), py::arg("g"), py::arg("i"));
  m.def("chunk_tile", &chunk_tile, py::arg("plan"), py::arg("chunks"), py::arg("g"), py::arg("t"));
  m.def("chunked_owner_rows", &chunked_owner_rows, py::arg("chunks"), py::arg("world"), py::arg("rank"));
  m.def("chunked_owner_padded_row0", &chunked_owner_padded_row0, py::arg("plan"), py::arg("chunks"), py::arg("mi"),
        py::arg("world"));
  m.def("chunked_tile_row0", &chunked_tile_row0, py::arg("plan"), py::arg("chunks"), py::arg("mi"));
  m.def("chunked_owner_row0", &chunked_owner_row0, py::arg("plan"), py::arg("chunks"), py::arg("mi"), py::arg("world"));
  m.def("chunked_tile_rows", &chunked_tile_rows, py::arg("plan"), py::arg("chunks"), py::arg("mi"));
  m.def("chunked_stripe_rows", &chunked_stripe_rows, py::arg("plan"), py::arg("chunks"), py::arg("mi"),
        py::arg("stripe"));
  m.def("chunk_ownership_run", &chunk_ownership_run, py::arg("plan"), py::arg("chunks"));

  m.def("queue_comm_block", &queue_comm_block, py::arg("q"), py::arg("comm_blocks"));
  m.def("comm_block_queue_count", &comm_block_queue_count, py::arg("c"), py::arg("compute_blocks"),
        py::arg("comm_blocks"));
  m.def("comm_block_queue", &comm_block_queue, py::arg("c"), py::arg("j"), py::arg("comm_blocks"));
  m.def("ag_block_of", &ag_block_of, py::arg("l"), py::arg("comm_blocks"));
  m.def("ag_subtile", &ag_subtile, py::arg("c"), py::arg("j"), py::arg("comm_blocks"));
  m.def("ag_subtile_count", &ag_subtile_count, py::arg("c"), py::arg("owned_subtiles"), py::arg("comm_blocks"));
  m.def("rotated_peer", &rotated_peer, py::arg("me"), py::arg("l"), py::arg("i"), py::arg("world"));

  m.def("counter_reached", &counter_reached, py::arg("value"), py::arg("target"));
  m.def("call_bank", &call_bank, py::arg("call"));
}

void bind_layout(py::module_& m) {
  m.attr("kWindowAlign") = kWindowAlign;
  m.attr("kCacheLine") = kCacheLine;
  m.attr("kCounterBytes") = kCounterBytes;
  m.def("align_up", &align_up, py::arg("x"), py::arg("a"));

  py::class_<LayoutParams>(m, "LayoutParams", "Inputs of make_window_layout (read-only once built).")
      .def(py::init([](int64_t pad_m, int64_t pad_n, int64_t elem_bytes, int64_t partial_elem_bytes, int64_t world,
                       int64_t tiles, int64_t max_owned_subtiles, int64_t compute_blocks, int64_t comm_blocks,
                       int64_t queue_capacity) {
             return LayoutParams{pad_m,       pad_n,         elem_bytes,         partial_elem_bytes,
                                 world,       tiles,         max_owned_subtiles, compute_blocks,
                                 comm_blocks, queue_capacity};
           }),
           py::arg("pad_m"), py::arg("pad_n"), py::arg("elem_bytes"), py::arg("partial_elem_bytes"), py::arg("world"),
           py::arg("tiles"), py::arg("max_owned_subtiles"), py::arg("compute_blocks"), py::arg("comm_blocks"),
           py::arg("queue_capacity"))
      .def_readonly("pad_m", &LayoutParams::pad_m)
      .def_readonly("pad_n", &LayoutParams::pad_n)
      .def_readonly("elem_bytes", &LayoutParams::elem_bytes)
      .def_readonly("partial_elem_bytes", &LayoutParams::partial_elem_bytes)
      .def_readonly("world", &LayoutParams::world)
      .def_readonly("tiles", &LayoutParams::tiles)
      .def_readonly("max_owned_subtiles", &LayoutParams::max_owned_subtiles)
      .def_readonly("compute_blocks", &LayoutParams::compute_blocks)
      .def_readonly("comm_blocks", &LayoutParams::comm_blocks)
      .def_readonly("queue_capacity", &LayoutParams::queue_capacity);

  py::class_<WindowLayout>(m, "WindowLayout", "Byte offsets/sizes of the window regions (read-only).")
      .def_readonly("partial_offset", &WindowLayout::partial_offset)
      .def_readonly("partial_bytes", &WindowLayout::partial_bytes)
      .def_property_readonly("reduced_offset", [](const WindowLayout& w) { return pair(w.reduced_offset); })
      .def_readonly("reduced_bytes", &WindowLayout::reduced_bytes)
      .def_readonly("tile_flag_offset", &WindowLayout::tile_flag_offset)
      .def_readonly("tile_flag_bytes", &WindowLayout::tile_flag_bytes)
      .def_readonly("final_offset", &WindowLayout::final_offset)
      .def_readonly("final_bytes", &WindowLayout::final_bytes)
      .def_readonly("queue_offset", &WindowLayout::queue_offset)
      .def_readonly("queue_stride", &WindowLayout::queue_stride)
      .def_readonly("total_bytes", &WindowLayout::total_bytes);

  m.def("layout_params_valid", &layout_params_valid, py::arg("params"));
  m.def("make_layout_params", &make_layout_params, py::arg("plan"), py::arg("elem_bytes"),
        py::arg("partial_elem_bytes"), py::arg("world"), py::arg("compute_blocks"), py::arg("comm_blocks"));
  m.def("queue_stride_bytes", &queue_stride_bytes, py::arg("queue_capacity"));
  m.def("make_window_layout", &make_window_layout, py::arg("params"));
  m.def("reduced_entry_offset", &reduced_entry_offset, py::arg("layout"), py::arg("bank"), py::arg("row"),
        py::arg("col"), py::arg("pad_n"), py::arg("elem_bytes"));
  m.def("partial_entry_offset", &partial_entry_offset, py::arg("layout"), py::arg("row"), py::arg("col"),
        py::arg("pad_n"), py::arg("partial_elem_bytes"));
  m.def("tile_flag_entry_offset", &tile_flag_entry_offset, py::arg("layout"), py::arg("t"));
  m.def("final_entry_offset", &final_entry_offset, py::arg("layout"), py::arg("l"));
  m.def("queue_count_offset", &queue_count_offset, py::arg("layout"), py::arg("b"));
  m.def("queue_entry_offset", &queue_entry_offset, py::arg("layout"), py::arg("b"), py::arg("j"));
}

// The NPU sequence-parallel kernels' walk over a row-chunked plan (sequence_parallel.hpp).
void bind_sequence_parallel(py::module_& m) {
  m.attr("kOpGemmReduceScatter") = static_cast<uint32_t>(kOpGemmReduceScatter);
  m.attr("kOpAllgatherGemm") = static_cast<uint32_t>(kOpAllgatherGemm);
  m.def("sp_chunks_usable", &sp_chunks_usable, py::arg("chunks"), py::arg("world"));
  m.def("sp_item_tile", &sp_item_tile, py::arg("plan"), py::arg("chunks"), py::arg("me"), py::arg("op"),
        py::arg("item"));
  m.def("sp_block_item_count", &sp_block_item_count, py::arg("plan"), py::arg("compute_blocks"), py::arg("b"));
  m.def("sp_block_item", &sp_block_item, py::arg("plan"), py::arg("chunks"), py::arg("me"), py::arg("op"),
        py::arg("compute_blocks"), py::arg("b"), py::arg("j"));
}

}  // namespace

}  // namespace gemm_ar

PYBIND11_MODULE(gemm_ar_protocol, m) {
  m.doc() = "Tile-protocol math shared by the CPU engine and NPU kernels (csrc/include/gemm_ar), for the tests.";
  gemm_ar::bind_tile_plan(m);
  gemm_ar::bind_partition_and_swizzle(m);
  gemm_ar::bind_ownership_and_schedule(m);
  gemm_ar::bind_layout(m);
  gemm_ar::bind_sequence_parallel(m);
}
