# Self-tuned K-FAC under mpiexec (examples/CMakeLists.txt, examples_fashion_mnist_adaptive_np2): the same
# run at 1 and at 2 ranks, each rank training on its half of every global batch, must take the same
# first self-tuned step. kfac::SelfTuning sums the quadratic model's scalars over the ranks; a wrong sum
# (each rank's batch counted as the whole, the gradient terms counted twice) changes the step size and
# with it the loss after the first step. Compares the training loss of steps 1 and 2 in log.csv to 4
# significant digits (float summation orders differ; later steps drift apart) and that both runs end.
#   -DRUN1="prog|arg|..."  -DRUN2="mpiexec|-n|2|prog|arg|..."  -DWORKDIR=dir
foreach(n 1 2)
  string(REPLACE "|" ";" command "${RUN${n}}")
  file(REMOVE_RECURSE "${WORKDIR}/np${n}")
  execute_process(COMMAND ${command} --out np${n} WORKING_DIRECTORY "${WORKDIR}" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "'${command}' exited with ${rc}, not 0")
  endif()
  if(NOT out MATCHES "self-tuned: [0-9]+ solves")
    message(FATAL_ERROR "'${command}' printed no self-tuned line")
  endif()
  file(STRINGS "${WORKDIR}/np${n}/log.csv" rows)
  set(loss${n} "")
  foreach(row IN LISTS rows)
    if(row MATCHES "^[^,]+,[^,]+,[^,]+,[^,]+,([12]),[^,]*,([0-9]+\\.[0-9][0-9][0-9])")
      list(APPEND loss${n} "${CMAKE_MATCH_1}:${CMAKE_MATCH_2}")
    endif()
  endforeach()
endforeach()
list(LENGTH loss1 count)
if(NOT count EQUAL 2 OR NOT loss1 STREQUAL loss2)
  message(FATAL_ERROR "training loss of steps 1 and 2: 1 rank ${loss1}, 2 ranks ${loss2} (expected two equal pairs)")
endif()
message("steps 1 and 2 agree: ${loss1}")
