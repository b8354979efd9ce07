# The build's reading of the registry's build variables (cmake/build_env.cmake), in CMake script mode:
#   cmake -DSOURCE_DIR=<repo> -P tests/env/build_env_test.cmake
# Each bad value must stop a configure; those cases run in child cmake processes whose failure is expected.

function(expect actual expected what)
  if(NOT "${actual}" STREQUAL "${expected}")
    message(FATAL_ERROR "${what}: got '${actual}', expected '${expected}'")
  endif()
endfunction()

# A child configure-time run of build_env.cmake with one variable set; returns its exit code and output.
function(run_child variable value out_code out_text)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/build_env_child.cmake
       "include(${SOURCE_DIR}/cmake/build_env.cmake)\nmagi_parse_cuda_archs(\"\$ENV{MAGI_TEST_ARCHS}\" archs)\n")
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${variable}=${value} MAGI_TEST_ARCHS=80
                          ${CMAKE_COMMAND} -P ${CMAKE_CURRENT_BINARY_DIR}/build_env_child.cmake
                  RESULT_VARIABLE code OUTPUT_VARIABLE text ERROR_VARIABLE text)
  set(${out_code} ${code} PARENT_SCOPE)
  set(${out_text} "${text}" PARENT_SCOPE)
endfunction()

set(ENV{MAGI_ATTENTION_PREBUILD_FFA} "")
set(ENV{MAX_JOBS} "")
include(${SOURCE_DIR}/cmake/build_env.cmake)

magi_parse_cuda_archs("80,8.6 hopper;sm_90  blackwell ampere" archs)
expect("${archs}" "80;86;90a;90;100a" "architecture list")
magi_parse_cuda_archs("compute_89" archs)
expect("${archs}" "89" "compute_ prefix")
expect("${MAGI_ATTN_PREBUILD_KERNELS}" "ON" "PREBUILD_FFA default")
expect("${MAGI_ATTN_SKIP_COMM}" "OFF" "SKIP_MAGI_ATTN_COMM_BUILD default")

set(ENV{MAGI_ATTENTION_PREBUILD_FFA} "off")
magi_env_bool(MAGI_ATTENTION_PREBUILD_FFA ON value)
expect("${value}" "OFF" "PREBUILD_FFA=off")
set(ENV{MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD} "TRUE")
magi_env_bool(MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD OFF value)
expect("${value}" "ON" "SKIP_MAGI_ATTN_COMM_BUILD=TRUE")

foreach(bad IN ITEMS "MAGI_ATTENTION_PREBUILD_FFA;maybe;allowed: 0, 1" "MAX_JOBS;0;integers >= 1"
                     "MAX_JOBS;many;integers >= 1")
  list(GET bad 0 variable)
  list(GET bad 1 value)
  list(GET bad 2 message)
  run_child(${variable} ${value} code text)
  if(code EQUAL 0 OR NOT text MATCHES "${variable}=${value}" OR NOT text MATCHES "${message}")
    message(FATAL_ERROR "${variable}=${value} must stop the build naming the allowed values; got ${code}: ${text}")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -E env MAGI_TEST_ARCHS=volta9
                        ${CMAKE_COMMAND} -P ${CMAKE_CURRENT_BINARY_DIR}/build_env_child.cmake
                RESULT_VARIABLE code OUTPUT_VARIABLE text ERROR_VARIABLE text)
if(code EQUAL 0 OR NOT text MATCHES "'volta9' is not a GPU architecture")
  message(FATAL_ERROR "a bad architecture must stop the build: ${code}: ${text}")
endif()
message(STATUS "build_env: all checks passed")
