#pragma once
/// \file bench_util.hpp
/// \brief What the host benchmarks share: statistics of a series of times, comma lists, and
/// the wall or thread-CPU clock.

#include <algorithm>
#include <chrono>
#include <ctime>
#include <string>
#include <vector>

namespace bench {

/// Median of `v` (0 when empty); the mean of the two middle values for an even count.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

inline double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

inline double minimum(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
}

/// "a,b,c" -> {"a", "b", "c"}; "" -> {""}.
inline std::vector<std::string> split(const std::string& list, char sep = ',') {
  std::vector<std::string> items;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(sep, start), list.size());
    items.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return items;
}

/// Milliseconds of the steady wall clock, or (cpu) of the calling thread's CPU time
/// (CLOCK_THREAD_CPUTIME_ID): with one BLAS thread that is the work's whole cost, and time
/// slices given to other processes on shared cores do not count.
inline double now_ms(bool cpu) {
  if (!cpu)
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

}  // namespace bench
