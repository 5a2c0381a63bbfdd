# Installs the build tree into a fresh prefix, then configures, builds and runs the consumer project
# in tests/package against it with find_package(flashback); then, where pkg-config is installed,
# builds and runs the C example with the flags `pkg-config flashback` gives, against the shared and
# the static library. Offline: nothing is downloaded.
#   cmake -DBUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... [-DC_EXAMPLE= -DBUILD_TYPE= -DC_COMPILER=
#         -DCXX_COMPILER= -DCXX_FLAGS= -DEXE_LINKER_FLAGS= -DGENERATOR=] -P run_package_test.cmake
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

# --- pkg-config ---------------------------------------------------------------------------------------
find_program(PKG_CONFIG NAMES pkg-config pkgconf)
if(NOT PKG_CONFIG OR NOT DEFINED C_EXAMPLE OR NOT DEFINED C_COMPILER OR "${C_COMPILER}" STREQUAL "")
  message(STATUS "pkg-config consumer: skipped (needs pkg-config, C_EXAMPLE and C_COMPILER)")
  return()
endif()
file(GLOB_RECURSE pc_files "${prefix}/flashback.pc")
list(LENGTH pc_files n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "the install should hold one flashback.pc, found ${n}: ${pc_files}")
endif()
get_filename_component(pc_dir "${pc_files}" DIRECTORY)
# Only the installed file may answer, as a user's PKG_CONFIG_PATH would point at it.
set(ENV{PKG_CONFIG_PATH} "${pc_dir}")
set(ENV{PKG_CONFIG_LIBDIR} "${pc_dir}")
function(pkg_config out)
  run_step("pkg-config ${ARGN}" "${PKG_CONFIG}" ${ARGN} flashback)
  string(STRIP "${step_output}" flags)
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(${out} ${flags} PARENT_SCOPE)
endfunction()
pkg_config(cflags --cflags)
pkg_config(libs --libs)
pkg_config(static_libs --static --libs)
# The static archive: -lflashback between -Bstatic and -Bdynamic, the private libraries after it.
list(TRANSFORM static_libs REPLACE "^-lflashback$" "-Wl,-Bstatic;-lflashback;-Wl,-Bdynamic")
separate_arguments(link_flags UNIX_COMMAND "${EXE_LINKER_FLAGS}")
pkg_config(libdir --variable=libdir)
run_step("compiling the C example with pkg-config's flags (shared)"
  "${C_COMPILER}" ${cflags} "${C_EXAMPLE}" -o "${WORK_DIR}/c_example_shared" ${libs} ${link_flags}
  "-Wl,-rpath,${libdir}")
run_step("compiling the C example with pkg-config's flags (static)"
  "${C_COMPILER}" ${cflags} "${C_EXAMPLE}" -o "${WORK_DIR}/c_example_static" ${static_libs} ${link_flags})
foreach(exe c_example_shared c_example_static)
  run_step("running ${exe}" "${WORK_DIR}/${exe}")
  message(STATUS "${exe}: ${step_output}")
endforeach()
