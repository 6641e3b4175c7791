#include <kfac/kfac.hpp>

#include <cstdio>

#ifdef KFAC_CONSUMER_PACKAGE_VERSION
constexpr bool same(const char* a, const char* b) { return *a == *b && (*a == '\0' || same(a + 1, b + 1)); }
static_assert(same(KFAC_VERSION_STRING, KFAC_CONSUMER_PACKAGE_VERSION),
              "kfac/config.hpp's KFAC_VERSION_STRING differs from the installed package's version");
#endif

int main(int argc, char* argv[]) {
  Kokkos::initialize(argc, argv);
  int rc = 1;
  {
    kfac::Preconditioner<double> pre(kfac::Options{}.with_kl_clip(0.0));
    pre.register_layer<kfac::Dense>("fc", kfac::Dense(3, 2, false));
    Kokkos::View<double**, Kokkos::LayoutRight> x("x", 4, 3), g("g", 4, 2), w("w", 2, 3);
    Kokkos::deep_copy(x, 1.0);
    Kokkos::deep_copy(g, 0.5);
    Kokkos::deep_copy(w, 1.0);
    pre.observe_input("fc", x);
    pre.observe_output_grad("fc", g);
    pre.set_gradient("fc", w);
    pre.step();
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w);
    std::printf("consumer: preconditioned w(0,0) = %g\n", h(0, 0));
    rc = (h(0, 0) != 1.0 && h(0, 0) == h(0, 0)) ? 0 : 1;
  }
  Kokkos::finalize();
  return rc;
}
