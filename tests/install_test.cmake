# Installs kfac from the build tree into a scratch prefix, then configures, builds and runs the
# consumer project against that prefix. Variables: BUILD_DIR, SOURCE_DIR, WORK_DIR, WITH_EIGEN
# (the build installs kfac::eigen: the consumer must find it and run consumer_eigen too),
# WITH_MPI (kfac was built with MPI), CXX_COMPILER and CXX_FLAGS (kfac's, e.g. nvcc_wrapper and
# -arch=sm_80 for a CUDA Kokkos), CXX_LAUNCHER (kfac's compiler launcher, e.g. ccache; may be empty).
# The consumer is compiled at -O1: it tests the package and the documentation's programs, not
# speed, and its eleven units took 118 s of the Serial suite at -O3 (2 cores, 2026-12-06).
#
# The documentation's programs are built and run as printed: every ```cpp block of README.md's
# "## Using it" section, of docs/usage.md's first section, of docs/transformers.md's "## C++"
# section, of docs/self_tuning.md's "## Example" section and of the "## Examples" section of
# each method page (docs/methods/*.md; a page without one fails the test) is copied verbatim into
# WORK_DIR/snippets/ and becomes one consumer executable (kfac::eigen for a block that includes
# the Eigen adapter). A page whose programs include an MPI header is left out when WITH_MPI is
# off; with MPI they run as one process (an MPI singleton). The consumer's configure output must
# not mention Torch or Caffe2: the package config looks for LibTorch only when the torch
# component is asked for.
cmake_minimum_required(VERSION 3.16)  # script mode: policies for if/while
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/snippets")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: command failed (${rc}): ${ARGN}")
  endif()
endfunction()

# extract_cpp_blocks(<markdown file> <section heading line> <name prefix>): the ```cpp blocks
# between the heading and the next "## " heading, one file each; at least one must be there.
function(extract_cpp_blocks markdown heading prefix)
  file(READ "${SOURCE_DIR}/${markdown}" text)
  string(FIND "${text}" "\n${heading}\n" at)
  if(at LESS 0)
    message(FATAL_ERROR "install test: ${markdown} has no line '${heading}'")
  endif()
  string(SUBSTRING "${text}" ${at} -1 text)
  string(LENGTH "${heading}" skip)
  math(EXPR skip "${skip} + 2")
  string(SUBSTRING "${text}" ${skip} -1 text)
  string(FIND "${text}" "\n## " next)
  if(next GREATER_EQUAL 0)
    string(SUBSTRING "${text}" 0 ${next} text)
  endif()
  set(count 0)
  while(TRUE)
    string(FIND "${text}" "```cpp\n" open)
    if(open LESS 0)
      break()
    endif()
    math(EXPR open "${open} + 7")
    string(SUBSTRING "${text}" ${open} -1 text)
    string(FIND "${text}" "\n```" close)
    if(close LESS 0)
      message(FATAL_ERROR "install test: an unclosed ```cpp block in ${markdown}")
    endif()
    math(EXPR count "${count} + 1")
    string(SUBSTRING "${text}" 0 ${close} block)
    file(WRITE "${WORK_DIR}/snippets/${prefix}_${count}.cpp" "${block}\n")
    math(EXPR close "${close} + 4")
    string(SUBSTRING "${text}" ${close} -1 text)
  endwhile()
  if(count EQUAL 0)
    message(FATAL_ERROR "install test: no ```cpp block under '${heading}' in ${markdown}")
  endif()
  message(STATUS "install test: ${count} program(s) from ${markdown} '${heading}'")
endfunction()
extract_cpp_blocks(README.md "## Using it" readme_using_it)
extract_cpp_blocks(docs/usage.md "## Registering layers: layer type + method" usage_registering)
extract_cpp_blocks(docs/transformers.md "## C++" transformers)
extract_cpp_blocks(docs/self_tuning.md "## Example" self_tuning)
file(GLOB method_pages RELATIVE "${SOURCE_DIR}" "${SOURCE_DIR}/docs/methods/*.md")
foreach(page IN LISTS method_pages)
  get_filename_component(stem "${page}" NAME_WE)
  file(READ "${SOURCE_DIR}/${page}" page_text)
  if(NOT WITH_MPI AND page_text MATCHES "#include <kfac/(distributed/mpi_comm|pipeline/pipeline)\\.hpp>")
    message(STATUS "install test: ${page}'s programs need MPI, which this build has not: left out")
    continue()
  endif()
  extract_cpp_blocks(${page} "## Examples" methods_${stem})
endforeach()

run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
if(WITH_EIGEN)
  set(eigen_flag -DKFAC_CONSUMER_EIGEN=ON)
else()
  set(eigen_flag -DKFAC_CONSUMER_EIGEN=OFF)
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/install_consumer" -B "${WORK_DIR}/build"
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release ${eigen_flag}
    -DKFAC_CONSUMER_SNIPPETS=${WORK_DIR}/snippets
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE configure_out ERROR_VARIABLE configure_out)
message("${configure_out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install test: configuring the consumer failed (${rc})")
endif()
string(REGEX MATCH "[^\n]*(Caffe2|Torch)[^\n]*" torch_line "${configure_out}")
if(torch_line)
  message(FATAL_ERROR "install test: the consumer asked for no torch component, yet configuring it "
                      "mentions LibTorch: '${torch_line}'")
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --parallel 2)
run("${WORK_DIR}/build/consumer")
if(WITH_EIGEN)
  run("${WORK_DIR}/build/consumer_eigen")
endif()
file(GLOB snippets "${WORK_DIR}/snippets/*.cpp")
foreach(snippet IN LISTS snippets)
  get_filename_component(name "${snippet}" NAME_WE)
  if(EXISTS "${WORK_DIR}/build/${name}")
    message(STATUS "install test: running ${name} (from the documentation)")
    run("${WORK_DIR}/build/${name}")
  elseif(WITH_EIGEN)
    message(FATAL_ERROR "install test: ${name} was not built")
  endif()
endforeach()
