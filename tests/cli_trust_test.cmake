# The CLI never reports success for work that did not happen: a failed write to stdout or an
# unwritable profile is a non-zero exit with a message, and `demo` says where its cached compile
# really came from. -DCLI=<tinydev> -DCACHE=<a cache folder>
execute_process(COMMAND /bin/sh -c "'${CLI}' devices > /dev/full" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "cannot write to standard output")
  message(FATAL_ERROR "tinydev devices >/dev/full: exit ${rc}, expected a failure\n${err}")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env TINYDEV_CACHE_DIR=${CACHE} TINYDEV_PROFILE=/nonexistent/x.json
                ${CLI} demo LLVM RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1 OR NOT err MATCHES "cannot write the profile to '/nonexistent/x.json'")
  message(FATAL_ERROR "demo with an unwritable profile: exit ${rc}, expected 1\n${out}${err}")
endif()
string(REGEX MATCHALL "cannot write the profile" said "${err}")
list(LENGTH said times)
if(NOT times EQUAL 1)
  message(FATAL_ERROR "the profile failure was reported ${times} times, expected once\n${err}")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env TINYDEV_CACHE_DIR=${CACHE} TINYDEV_DISABLE_COMPILER_CACHE=1
                ${CLI} demo LLVM RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "not cached: TINYDEV_DISABLE_COMPILER_CACHE=1" OR out MATCHES "from the disk cache")
  message(FATAL_ERROR "demo with the cache disabled must say it compiled again: exit ${rc}\n${out}${err}")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env TINYDEV_CACHE_DIR=${CACHE} ${CLI} demo LLVM
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "from the disk cache in ${CACHE}")
  message(FATAL_ERROR "demo with a usable cache must say it read the disk cache: exit ${rc}\n${out}${err}")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env TINYDEV_CACHE_DIR=${CACHE} TINYDEV_DEBGU=1 ${CLI} devices
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT err MATCHES "TINYDEV_DEBGU is not a tinydev variable and is ignored; did you mean TINYDEV_DEBUG")
  message(FATAL_ERROR "a misspelt variable must be named with the closest known one: exit ${rc}\n${err}")
endif()
