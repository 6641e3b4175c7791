# Installs kfac from the build tree into a scratch prefix, then configures, builds and runs the
# consumer project against that prefix. Variables: BUILD_DIR, SOURCE_DIR, WORK_DIR, WITH_EIGEN
# (the build installs kfac::eigen: the consumer must find it and run consumer_eigen too),
# CXX_COMPILER and CXX_FLAGS (kfac's, e.g. nvcc_wrapper and -arch=sm_80 for a CUDA Kokkos).
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: command failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
if(WITH_EIGEN)
  set(eigen_flag -DKFAC_CONSUMER_EIGEN=ON)
else()
  set(eigen_flag -DKFAC_CONSUMER_EIGEN=OFF)
endif()
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/install_consumer" -B "${WORK_DIR}/build"
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release ${eigen_flag}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --parallel 2)
run("${WORK_DIR}/build/consumer")
if(WITH_EIGEN)
  run("${WORK_DIR}/build/consumer_eigen")
endif()
