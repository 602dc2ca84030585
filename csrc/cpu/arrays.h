// Checked views of nanobind ndarrays (DLPack): dtype, shape, strides and device, with errors that name
// the function, the argument and what was expected.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

namespace ktae {

namespace nb = nanobind;

using Array = nb::ndarray<>;

struct DType {
  nb::dlpack::dtype code;
  const char* name;
};

inline const DType kInt64{nb::dtype<int64_t>(), "int64"};
inline const DType kFloat64{nb::dtype<double>(), "float64"};
inline const DType kFloat32{nb::dtype<float>(), "float32"};
inline const DType kBool{nb::dtype<bool>(), "bool"};

constexpr int64_t kAny = -1;

// "int32", "float64", "bool", ... of a DLPack dtype.
inline std::string dtype_name(nb::dlpack::dtype d) {
  static const char* const kinds[] = {"int", "uint", "float", "?", "bfloat", "complex", "bool"};
  if (d.code == uint8_t(nb::dlpack::dtype_code::Bool)) return "bool";
  std::string kind = d.code < 7 ? kinds[d.code] : "dtype" + std::to_string(d.code) + "_";
  return kind + std::to_string(d.bits) + (d.lanes > 1 ? "x" + std::to_string(d.lanes) : "");
}

inline int64_t extent(const Array& a, size_t i) { return int64_t(a.shape(i)); }

// Element stride of dimension i (DLPack may omit strides for a compact row-major array).
inline int64_t stride_of(const Array& a, size_t i) {
  if (a.stride_ptr() != nullptr) return a.stride(i);
  int64_t s = 1;
  for (size_t j = i + 1; j < a.ndim(); ++j) s *= extent(a, j);
  return s;
}

inline int64_t row_stride(const Array& a) { return stride_of(a, 0); }

inline std::string describe(const Array& a) {
  std::string shape = "[", strides = "[";
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape += (i ? ", " : "") + std::to_string(extent(a, i));
    strides += (i ? ", " : "") + std::to_string(stride_of(a, i));
  }
  const bool cpu = a.device_type() == nb::device::cpu::value;
  return dtype_name(a.dtype()) + " " + shape + "] (strides " + strides + "]) on " +
         (cpu ? std::string("the CPU") : "device type " + std::to_string(a.device_type()));
}

// Checks of one function's arguments; every failure raises ValueError naming `fn` and the argument.
struct Check {
  const char* fn;

  [[noreturn]] void fail(const char* name, const std::string& expected, const Array& got) const {
    throw nb::value_error((std::string(fn) + ": `" + name + "` must be " + expected + ", got " + describe(got)).c_str());
  }

  // 1-D, unit stride, `dtype`, `n` entries (kAny: any), on the CPU.
  void vector(const char* name, const Array& a, const DType& dtype, int64_t n = kAny) const {
    const bool ok = a.ndim() == 1 && a.dtype() == dtype.code && a.device_type() == nb::device::cpu::value &&
                    (n == kAny || extent(a, 0) == n) && (extent(a, 0) <= 1 || stride_of(a, 0) == 1);
    if (!ok) fail(name, expected(dtype, {n}, "with unit stride"), a);
  }

  // 2-D [rows, cols] with unit column stride and rows at any non-negative stride, on the CPU.
  void matrix(const char* name, const Array& a, const DType& dtype, int64_t rows = kAny, int64_t cols = kAny) const {
    const bool ok = a.ndim() == 2 && a.dtype() == dtype.code && a.device_type() == nb::device::cpu::value &&
                    (rows == kAny || extent(a, 0) == rows) && (cols == kAny || extent(a, 1) == cols) &&
                    (a.size() == 0 || ((extent(a, 1) <= 1 || stride_of(a, 1) == 1) && stride_of(a, 0) >= 0));
    if (!ok) fail(name, expected(dtype, {rows, cols}, "with unit column stride"), a);
  }

  // 2-D row-major contiguous [rows, cols] on the CPU.
  void contiguous_matrix(const char* name, const Array& a, const DType& dtype, int64_t rows = kAny,
                         int64_t cols = kAny) const {
    const bool ok = a.ndim() == 2 && a.dtype() == dtype.code && a.device_type() == nb::device::cpu::value &&
                    (rows == kAny || extent(a, 0) == rows) && (cols == kAny || extent(a, 1) == cols) &&
                    (a.size() == 0 || ((extent(a, 1) <= 1 || stride_of(a, 1) == 1) &&
                                       (extent(a, 0) <= 1 || stride_of(a, 0) == extent(a, 1))));
    if (!ok) fail(name, expected(dtype, {rows, cols}, "and contiguous"), a);
  }

 private:
  static std::string expected(const DType& dtype, std::initializer_list<int64_t> shape, const char* layout) {
    std::string s = std::string("a ") + dtype.name + " CPU array of shape [";
    size_t i = 0;
    for (int64_t n : shape) s += (i++ ? ", " : "") + (n == kAny ? std::string("*") : std::to_string(n));
    return s + "] " + layout;
  }
};

}  // namespace ktae
