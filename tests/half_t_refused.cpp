// Built only by the ctest test half_t_refused, which expects this file NOT to compile where
// Kokkos' half_t is float in disguise, and checks that the compiler names the reason.
#include <kfac/kfac.hpp>

#if defined(KOKKOS_HALF_T_IS_FLOAT) && !KOKKOS_HALF_T_IS_FLOAT
#error "kfac_half_check: real half type: Precision<KokkosHalf, float> stores binary16 here"
#else
using Refused = kfac::Precision<kfac::KokkosHalf, float>;
static_assert(sizeof(Refused::factor_type) == 2, "unreachable: the Precision check fires first");
#endif

int main() { return 0; }
