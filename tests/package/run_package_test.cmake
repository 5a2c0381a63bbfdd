# Installs the build tree into a fresh prefix, then configures, builds and runs the consumer project
# in tests/package against it with find_package(flashback). Offline: nothing is downloaded.
#   cmake -DBUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... [-DBUILD_TYPE= -DC_COMPILER= -DCXX_COMPILER=
#         -DCXX_FLAGS= -DEXE_LINKER_FLAGS= -DGENERATOR=] -P run_package_test.cmake
cmake_minimum_required(VERSION 3.20)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")

run_step("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")

set(configure "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${build}"
    "-DCMAKE_PREFIX_PATH=${prefix}"
    # Only the installed package may satisfy find_package: no package registries, no system copies.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF
    -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
foreach(var BUILD_TYPE C_COMPILER CXX_COMPILER CXX_FLAGS EXE_LINKER_FLAGS)
  if(DEFINED ${var} AND NOT "${${var}}" STREQUAL "")
    list(APPEND configure "-DCMAKE_${var}=${${var}}")
  endif()
endforeach()
if(DEFINED GENERATOR AND NOT "${GENERATOR}" STREQUAL "")
  list(APPEND configure -G "${GENERATOR}")
endif()
run_step("configuring the consumer" ${configure})

file(STRINGS "${build}/CMakeCache.txt" found REGEX "^flashback_DIR:")
if(NOT found MATCHES "=${prefix}/")
  message(FATAL_ERROR "find_package(flashback) did not use the installed package in ${prefix}: ${found}")
endif()

run_step("building the consumer" "${CMAKE_COMMAND}" --build "${build}")
foreach(exe consumer_shared consumer_static)
  run_step("running ${exe}" "${build}/${exe}")
  message(STATUS "${exe}: ${step_output}")
endforeach()
