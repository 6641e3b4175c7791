# Runs one example command and checks how it ended, for the examples_*_help and
# examples_*_fresh_dir tests (examples/CMakeLists.txt).
#   -DRUN="prog|arg|..."  the command, arguments separated by '|'
#   -DWORKDIR=dir         run there; when FRESH is set, the folder is first removed and made empty
#   -DEXPECT_OUTPUT=re    a regular expression the standard output must match
#   -DEXPECT_FILE=path    a file (relative to WORKDIR) the run must have written
#   -DEXPECT_EXIT=n       the exit code expected instead of 0 (a refused flag: 2)
#   -DEXPECT_ERROR=re     a regular expression the standard error must match
#   -DREJECT_OUTPUT=re    a regular expression the standard output must not match
# Fails unless the command exits 0 (or EXPECT_EXIT) and every expectation holds.
string(REPLACE "|" ";" command "${RUN}")
if(FRESH)
  file(REMOVE_RECURSE "${WORKDIR}")
  file(MAKE_DIRECTORY "${WORKDIR}")
endif()
execute_process(COMMAND ${command} WORKING_DIRECTORY "${WORKDIR}" RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT DEFINED EXPECT_EXIT)
  set(EXPECT_EXIT 0)
endif()
if(NOT rc EQUAL EXPECT_EXIT)
  message(FATAL_ERROR "'${command}' in ${WORKDIR} exited with ${rc}, not ${EXPECT_EXIT}")
endif()
if(DEFINED REJECT_OUTPUT AND out MATCHES "${REJECT_OUTPUT}")
  message(FATAL_ERROR "the output of '${command}' matches '${REJECT_OUTPUT}'")
endif()
if(DEFINED EXPECT_ERROR AND NOT err MATCHES "${EXPECT_ERROR}")
  message(FATAL_ERROR "the standard error of '${command}' does not match '${EXPECT_ERROR}'")
endif()
if(DEFINED EXPECT_OUTPUT AND NOT out MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "the output of '${command}' does not match '${EXPECT_OUTPUT}'")
endif()
if(DEFINED EXPECT_FILE AND NOT EXISTS "${WORKDIR}/${EXPECT_FILE}")
  message(FATAL_ERROR "'${command}' did not write ${WORKDIR}/${EXPECT_FILE}")
endif()
