# `tinydev load`, end to end: a good file loads and verifies with plain progress lines (stdout is
# not a terminal here), bad files exit 1 saying why, bad arguments exit 2 with the usage text.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${FIXTURE} ${WORK} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the safetensors fixture failed: ${rc}")
endif()

execute_process(COMMAND ${CLI} load ${WORK}/good.safetensors LLVM --verify
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "loaded 3 tensors, 3145856 bytes onto LLVM in [0-9.]+ s \\([0-9.]+ GB/s\\)"
   OR NOT out MATCHES "verified: all 3 tensors match the file" OR NOT out MATCHES "progress 100%")
  message(FATAL_ERROR "tinydev load good --verify: exit ${rc}\n${out}${err}")
endif()
if(out MATCHES "\r")
  message(FATAL_ERROR "tinydev load drew a progress bar although stdout is not a terminal\n${out}")
endif()

foreach(bad "truncated;not a range inside"
            "hostile;claims"
            "missing;cannot open")
  list(GET bad 0 name)
  list(GET bad 1 expect)
  execute_process(COMMAND ${CLI} load ${WORK}/${name}.safetensors LLVM RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 1 OR NOT err MATCHES "tinydev load: " OR NOT err MATCHES "${expect}")
    message(FATAL_ERROR "tinydev load ${name}: exit ${rc}, expected 1 saying '${expect}'\n${out}${err}")
  endif()
endforeach()

foreach(args "load" "load;a;b;c" "load;${WORK}/good.safetensors;nosuchdevice" "load;${WORK}/good.safetensors;--bogus")
  execute_process(COMMAND ${CLI} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "usage: tinydev")
    message(FATAL_ERROR "tinydev ${args}: exit ${rc}, expected 2 with the usage text\n${out}${err}")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
