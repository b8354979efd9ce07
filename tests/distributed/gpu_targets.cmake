# GPU context parallelism (NCCL engine), label gpu so that CI without GPUs skips them (ctest -LE gpu):
#   nccl_engine_gpu       tests/comm/nccl_engine_gpu.cpp      the NCCL communicator
#   dist_attn_gpu         tests/distributed/dist_attn_gpu.cpp        distributed attention on device tensors
#   dist_attn_gpu_bench   bench/distributed/gpu_dist_attn_throughput.cpp  TFLOP/s per GPU vs the single-GPU kernel
# Each program runs one process per GPU: under mpirun (one rank per GPU), or it forks one child per GPU
# itself (so ctest and machines without mpirun need nothing else). Built only with NCCL and the CUDA
# backend. Included from tests/distributed/CMakeLists.txt.
if(NOT MAGI_ATTN_WITH_NCCL)
  message(STATUS "magi-attn: GPU context-parallel tests and benchmark skipped (no NCCL engine)")
  return()
endif()

if(MAGI_ATTN_BUILD_TESTS)
  if(NOT TARGET GTest::gtest)
    find_package(GTest REQUIRED)
  endif()
  foreach(_src tests/comm/nccl_engine_gpu.cpp tests/distributed/dist_attn_gpu.cpp)
    get_filename_component(_name ${_src} NAME_WE)
    add_executable(${_name} ${PROJECT_SOURCE_DIR}/${_src})
    target_link_libraries(${_name} PRIVATE magi::attn magi_test_support GTest::gtest)
    target_include_directories(${_name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
    if(TARGET magi-attn)  # dist_attn_gpu runs `magi-attn trace` on the timelines it wrote
      target_compile_definitions(${_name} PRIVATE MAGI_CLI_PATH="$<TARGET_FILE:magi-attn>")
      add_dependencies(${_name} magi-attn)
    endif()
    add_test(NAME ${_name} COMMAND ${_name})
    # NVLink multicast (NVLS) stays off: on shared hosts it can take the GPUs out of service.
    set_tests_properties(${_name} PROPERTIES LABELS gpu TIMEOUT 900 ENVIRONMENT "NCCL_NVLS_ENABLE=0")
  endforeach()
endif()
if(MAGI_ATTN_BUILD_BENCHMARKS)
  add_executable(dist_attn_gpu_bench ${PROJECT_SOURCE_DIR}/bench/distributed/gpu_dist_attn_throughput.cpp)
  target_link_libraries(dist_attn_gpu_bench PRIVATE magi::attn)
  target_include_directories(dist_attn_gpu_bench PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/bench)
endif()
