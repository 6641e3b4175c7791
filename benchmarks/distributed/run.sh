#!/usr/bin/env bash
# Runs bench_distributed with 1 rank and with 2 ranks (one OpenBLAS thread per rank, so 2 ranks
# use the 2 cores), plus 1 rank with 2 OpenBLAS threads for comparison, and prints the 2-vs-1
# speedup of the decomposition phase per model and strategy: against the one-rank baseline that
# the 2-rank job interleaves with its own steps, and against the separate 1-rank jobs.
# Usage: benchmarks/distributed/run.sh [build dir] [extra bench_distributed args]
#   KFAC_BENCH_RANKS4=1 also runs 4 ranks (oversubscribed on 2 cores: bytes and memory are
#   checked against the model; its times say nothing about a 4-core machine).
set -euo pipefail
build=${1:-build}
shift || true
bench=$build/benchmarks/distributed/bench_distributed
[ -x "$bench" ] || bench=$build/distributed/bench_distributed
[ -x "$bench" ] || { echo "run.sh: bench_distributed not found under $build (build it first)" >&2; exit 2; }
mpi=(mpiexec --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)
csv=$(mktemp)
trap 'rm -f "$csv"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "command: ${mpi[*]} -n N $bench --csv FILE $*"
status=0
# The 1-rank jobs observe 2 shards per step: the same global batch, hence the same factors, as 2 ranks.
OPENBLAS_NUM_THREADS=1 "${mpi[@]}" -n 1 "$bench" --csv "$csv" --shards 2 "$@" || status=1
OPENBLAS_NUM_THREADS=2 "${mpi[@]}" -n 1 "$bench" --csv "$csv" --shards 2 "$@" || status=1
OPENBLAS_NUM_THREADS=1 "${mpi[@]}" -n 2 "$bench" --csv "$csv" "$@" || status=1
if [ "${KFAC_BENCH_RANKS4:-0}" = 1 ]; then
  OPENBLAS_NUM_THREADS=1 "${mpi[@]}" -n 4 "$bench" --csv "$csv" "$@" || status=1
fi
echo
echo "Decomposition phase, N ranks vs 1 rank (median ms; target >= 1.8x under MEM-OPT/HYBRID)."
echo "'interleaved' is rank 0 alone, stepping in turns with the distributed run inside the same job;"
echo "'separate' is the 1-rank job above (1 and 2 OpenBLAS threads)."
echo "| model | ranks | strategy | decomposition ms | model ms | 1 rank interleaved ms | speedup | 1 rank separate ms | speedup | 1 rank, 2 threads ms | speedup |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
awk -F, '
  $3 == 1 && $4 == 1 { base[$1] = $6 }
  $3 == 1 && $4 == 2 { threads2[$1] = $6 }
  $3 >= 2 { row[NR] = $0 }
  END {
    for (i in row) {
      split(row[i], f, ",")
      printf "| %s | %d | %s | %.0f | %.0f | %.0f | %.2fx | %.0f | %.2fx | %.0f | %.2fx |\n", f[1], f[3], f[2], f[6], f[7], f[20], f[20] / f[6], base[f[1]], base[f[1]] / f[6], threads2[f[1]], threads2[f[1]] / f[6]
    }
  }' "$csv" | sort
echo
echo "All rows (model,strategy,ranks,threads,f,decomp_ms,model_decomp_ms,plain_step_ms,model_precond_ms,max_factor_bytes,max_decomp_bytes,max_grad_bytes,max_mem_MiB,model_max_mem_MiB,exact,decomp_min_ms,plain_step_min_ms,decomp_cpu_ms,max_own_syevd_ms,baseline_decomp_ms):"
cat "$csv"
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
