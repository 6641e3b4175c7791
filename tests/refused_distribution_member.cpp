// Built only by the ctest test refused_distribution_member (tests/compile_fail.cmake), which
// expects this file NOT to compile, with the distribution contract's static_assert naming the
// missing member as the only error: a strategy whose State leaves out holds() (placement).
#include <kfac/kfac.hpp>

struct NoHolds {
  using distribution_tag = void;
  static constexpr const char* name = "no-holds";
  template <class Exec, class Comm>
  class State : public kfac::impl::LocalAgreement<Comm>,
                public kfac::impl::NoFactorAveraging<Exec, kfac::impl::request_of_t<Comm>>,
                public kfac::impl::NoDecompositionSharing<kfac::impl::request_of_t<Comm>>,
                public kfac::impl::NoGradientSharing<kfac::impl::request_of_t<Comm>> {
   public:
    using request_type = kfac::impl::request_of_t<Comm>;
    State(const NoHolds&, Comm comm) : kfac::impl::LocalAgreement<Comm>(std::move(comm)) {}
    std::string signature(const kfac::Options&) const { return "no-holds;"; }
    void plan(const kfac::Options&, const std::vector<std::vector<kfac::impl::UnitCost>>&) {}
    const kfac::WorkAssignment& assignment() const { return assignment_; }
    bool computes(std::size_t, int) const { return true; }

   private:
    kfac::WorkAssignment assignment_;
  };
};

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kfac::Preconditioner<double, Kokkos::DefaultHostExecutionSpace, kfac::SerialComm, NoHolds> pre;
  pre.register_layer("fc", kfac::Dense(3, 2));
  pre.step();
}
