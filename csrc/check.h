// ATTNKIT_CHECK(cond, parts...): TORCH_CHECK with a message assembled here, as plain string concatenation.
//
// Why not TORCH_CHECK's own formatting: it streams every part into a std::ostringstream, and integers go
// through std::ostream's numeric facets. On a GPU machine whose process held a libstdc++ other than the one
// the extension was compiled against, that printed integers as nothing ("got  at head ") or crashed the
// process, from code compiled by g++ as much as by nvcc (torch 2.11, H100 image, 2026-11). Strings stream
// safely, so the parts are turned into one std::string first: integers with std::to_string, floating-point
// numbers with snprintf, shapes as "[2, 3]", devices and dtypes by their names — the texts TORCH_CHECK
// would have printed.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace attnkit {
namespace check_detail {

inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void append(std::string& s, c10::IntArrayRef r) {
  s += "[";
  for (size_t i = 0; i < r.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(r[i]);
  }
  s += "]";
}
inline void append(std::string& s, bool b) { s += b ? "true" : "false"; }
template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>> append(std::string& s, T x) {
  s += std::to_string(x);
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append(std::string& s, T x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
  s += buf;
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

}  // namespace check_detail
}  // namespace attnkit

#define ATTNKIT_CHECK(cond, ...) TORCH_CHECK(cond, ::attnkit::check_detail::message(__VA_ARGS__))
