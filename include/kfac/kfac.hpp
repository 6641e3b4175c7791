#pragma once
/// \file kfac.hpp
/// \brief The one header users include. (MPI: add kfac/distributed/mpi_comm.hpp; cost
/// planning: kfac/planning/cost_model.hpp.) The raw-pointer adapter (kfac::adapters::from_raw)
/// is included: it needs nothing but Kokkos. The Eigen and LibTorch adapters stay opt-in
/// (kfac/adapters/eigen.hpp, kfac/adapters/torch.hpp), since they pull in their libraries.

#include "kfac/adapters/raw.hpp"
#include "kfac/adaptive/adaptive.hpp"
#include "kfac/adaptive/self_tuning.hpp"
#include "kfac/config.hpp"
#include "kfac/core/options.hpp"
#include "kfac/core/precision.hpp"
#include "kfac/core/traits.hpp"
#include "kfac/distributed/gradient_averager.hpp"
#include "kfac/distributed/independent.hpp"
#include "kfac/distributed/kaisa.hpp"
#include "kfac/distributed/parameter_averager.hpp"
#include "kfac/error.hpp"
#include "kfac/layers/batch_norm.hpp"
#include "kfac/layers/layer_norm.hpp"
#include "kfac/layers/conv2d.hpp"
#include "kfac/layers/dense.hpp"
#include "kfac/layers/embedding.hpp"
#include "kfac/layers/parameter.hpp"
#include "kfac/methods/default_method.hpp"
#include "kfac/methods/diagonal/diagonal_fisher.hpp"
#include "kfac/methods/embedding/embedding_fisher.hpp"
#include "kfac/methods/kfac/kfac_method.hpp"
#include "kfac/methods/ngsgd/ngsgd.hpp"
#include "kfac/methods/unit_wise/unit_wise_fisher.hpp"
#include "kfac/preconditioner.hpp"
#include "kfac/recipes/large_batch.hpp"
