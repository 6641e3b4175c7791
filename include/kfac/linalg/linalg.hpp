#pragma once
// Every linear-algebra entry of kfac, one header per operation (docs/backends.md lists them and
// the vendor paths behind each).
#include "kfac/linalg/common.hpp"
#include "kfac/linalg/eigh.hpp"
#include "kfac/linalg/gemm.hpp"
#include "kfac/linalg/newton_schulz.hpp"
#include "kfac/linalg/spd_inverse.hpp"
#include "kfac/linalg/squared_norm.hpp"
#include "kfac/linalg/symmetric.hpp"
#include "kfac/linalg/syrk.hpp"
#include "kfac/linalg/vendor.hpp"
