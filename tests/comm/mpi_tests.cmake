# magi_add_mpi_test(NAME SOURCE): a GoogleTest program run under mpirun, one CTest per cp in 1..4 and 8.
# The program initialises MPI itself (tests/comm/mpi_test_main.hpp) and fails on every rank if any fails.
# Without MPI (or with -DMAGI_ATTN_MPI=OFF) there is no MPI engine: the programs are not built.
function(magi_add_mpi_test name)
  if(NOT MPI_CXX_FOUND)
    return()
  endif()
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE magi::attn magi_test_support GTest::gtest)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  foreach(_cp 1 2 3 4 8)
    add_test(NAME ${name}_cp${_cp}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${_cp} --allow-run-as-root --oversubscribe
                     ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS})
    # Ranks share the machine: one compute thread each.
    set_tests_properties(${name}_cp${_cp} PROPERTIES TIMEOUT 900 ENVIRONMENT "OMP_NUM_THREADS=1"
                         PROCESSORS ${_cp} LABELS mpi)
  endforeach()
endfunction()
