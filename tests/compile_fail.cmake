# A compile-time diagnostic test: builds TARGET (an EXCLUDE_FROM_ALL executable) in BUILD_DIR and
# passes when the build fails, the compiler printed MESSAGE, and it printed at most MAX_ERRORS
# "error:" lines (the readable static_assert, not a page of template errors after it).
execute_process(COMMAND ${CMAKE_COMMAND} --build "${BUILD_DIR}" --target "${TARGET}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REGEX MATCHALL "error:" errors "${out}")
list(LENGTH errors n_errors)
string(REGEX MATCHALL "\n" lines "${out}")
list(LENGTH lines n_lines)
message("${TARGET}: build exit ${rc}, ${n_lines} lines of output, ${n_errors} error lines")
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled; it must be refused at compile time")
endif()
string(FIND "${out}" "${MESSAGE}" at)
if(at LESS 0)
  message(FATAL_ERROR "${TARGET}: the compiler did not print '${MESSAGE}':\n${out}")
endif()
if(n_errors GREATER MAX_ERRORS)
  message(FATAL_ERROR "${TARGET}: ${n_errors} error lines (at most ${MAX_ERRORS}):\n${out}")
endif()
