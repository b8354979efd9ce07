# Picks -march for the CPU engine: x86-64-v3 (AVX2, FMA) if this machine runs it, else x86-64-v2.
if(NOT DEFINED MAGI_ATTN_CPU_ARCH)
  set(_arch x86-64-v2)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
    try_run(_run_result _compile_result
      SOURCE_FROM_CONTENT avx2_probe.cpp
      "int main() { return __builtin_cpu_supports(\"avx2\") && __builtin_cpu_supports(\"fma\") ? 0 : 1; }")
    if(_compile_result AND _run_result EQUAL 0)
      set(_arch x86-64-v3)
    endif()
  else()
    set(_arch native)
  endif()
  set(MAGI_ATTN_CPU_ARCH ${_arch} CACHE STRING "-march value for the CPU engine")
endif()
message(STATUS "magi-attn: CPU engine built with -march=${MAGI_ATTN_CPU_ARCH}")
