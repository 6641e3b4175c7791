#pragma once
/// \file command_line.hpp
/// \brief What the example programs share about their command lines.

#include <string>
#include <vector>

namespace nn {

/// \brief Splits argv: Kokkos gets only its own --kokkos-* options (it would also claim plain ones
/// like --threads), after the program name; the program gets the rest, without its name.
inline void split_kokkos_options(int argc, char** argv, std::vector<char*>& kokkos, std::vector<std::string>& own) {
  kokkos.assign(1, argv[0]);
  own.clear();
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind("--kokkos-", 0) == 0) kokkos.push_back(argv[i]);
    else own.emplace_back(argv[i]);
  }
}

}  // namespace nn
