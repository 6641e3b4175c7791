# Runs tests/watchdog_exit.cpp at 2 ranks under mpiexec and checks how every rank ended (issue 46):
# after the watchdog fires, no rank crashes (no signal, no core) or hangs, whether the late peer
# arrives ("late") or never does ("absent"), and each rank that ends by itself prints the error.
#   cmake -DMPIEXEC=... "-DFLAGS=..." -DDRIVER=... -DSCENARIO=late|absent -DTIMEOUT=s -P watchdog_exit.cmake
set(ENV{KFAC_COMM_TIMEOUT} ${TIMEOUT})
if(SCENARIO STREQUAL "late")
  # OpenMPI's mpiexec ends the other ranks as soon as one exits non-zero: let each finish, so
  # that every rank's own ending is seen (mpiexec then returns 0; each rank prints its code).
  set(ENV{OMPI_MCA_orte_abort_on_non_zero_status} 0)
endif()
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} ${FLAGS} -n 2 ${DRIVER} ${SCENARIO} ${LATE}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT ${LIMIT})
string(TIMESTAMP t1 "%s")
math(EXPR seconds "${t1} - ${t0}")
set(all "${out}\n${err}")
message(STATUS "mpiexec returned '${rc}' after ${seconds} s; output:\n${all}")
set(failures "")
# Appends `what` to the failures unless `text` contains (want = 1) or lacks (want = 0) `part`.
function(expect_text text part want what)
  string(FIND "${text}" "${part}" at)
  if((want AND at EQUAL -1) OR (NOT want AND NOT at EQUAL -1))
    set(failures "${failures}  ${what}\n" PARENT_SCOPE)
  endif()
endfunction()
if(NOT rc MATCHES "^[0-9]+$")
  string(APPEND failures "  mpiexec ends within ${LIMIT} s with an exit code (got '${rc}')\n")
endif()
foreach(bad "Segmentation fault" "signal 11" "signal 6" "core dumped" "SIGSEGV" "Aborted")
  expect_text("${all}" "${bad}" 0 "no '${bad}' in the output")
endforeach()
expect_text("${all}" "rank 0: kfac::Error: kfac: MpiComm: MPI_Allreduce" 1 "rank 0 prints the watchdog's kfac::Error")
if(SCENARIO STREQUAL "late")
  # Rank 1 arrives after the deadline: it learns that rank 0 gave up, and both end cleanly.
  expect_text("${all}" "rank 1: kfac::Error: kfac: MpiComm:" 1 "rank 1 prints a kfac::Error")
  foreach(r 0 1)
    expect_text("${all}" "rank ${r}: finalized, exit code 1" 1 "rank ${r} finalizes and exits with code 1")
  endforeach()
else()
  # Rank 1 never arrives: rank 0 cannot finalize with it, ends itself, and mpiexec ends the job.
  expect_text("${all}" "kfac: MPI_Finalize did not complete within" 1 "rank 0 says why it ends inside MPI_Finalize")
  if(NOT rc STREQUAL "1")  # not a signal's 128 + n
    string(APPEND failures "  mpiexec's exit code is rank 0's, 1 (got '${rc}')\n")
  endif()
endif()
if(failures)
  message(FATAL_ERROR "watchdog_exit ${SCENARIO}: expected\n${failures}")
endif()
