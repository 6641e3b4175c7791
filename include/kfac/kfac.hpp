#pragma once
/// \file kfac.hpp
/// \brief The one header users include.

#include "kfac/config.hpp"
#include "kfac/data_parallel.hpp"
#include "kfac/error.hpp"
#include "kfac/factors/factor_policies.hpp"
#include "kfac/inverse/cholesky.hpp"
#include "kfac/inverse/eigendecomposition.hpp"
#include "kfac/inverse/newton_schulz.hpp"
#include "kfac/layers/batch_norm.hpp"
#include "kfac/layers/conv2d.hpp"
#include "kfac/layers/dense.hpp"
#include "kfac/options.hpp"
#include "kfac/precision.hpp"
#include "kfac/preconditioner.hpp"
