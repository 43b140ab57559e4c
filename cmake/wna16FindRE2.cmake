# Finds RE2 (the regular-expression engine of src/io/module_pattern.cpp) and defines the imported
# target re2::re2, for the build and for the installed package (wna16Config.cmake includes this
# file: the static wna16_io archive needs RE2 when a consumer links). RE2's own CMake package
# (upstream builds) is used when there is one; Debian's libre2-dev ships only re2.pc, whose paths
# are absolute, so the header and library are looked up with find_path/find_library instead, which
# honour CMAKE_PREFIX_PATH (scripts/gpu-check points it at build-deps/usr).
if(NOT TARGET re2::re2)
  find_package(re2 CONFIG QUIET)
endif()
if(NOT TARGET re2::re2)
  find_path(WNA16_RE2_INCLUDE_DIR re2/re2.h)
  find_library(WNA16_RE2_LIBRARY re2)
  if(WNA16_RE2_INCLUDE_DIR AND WNA16_RE2_LIBRARY)
    find_package(Threads REQUIRED)
    add_library(re2::re2 UNKNOWN IMPORTED)
    set_target_properties(re2::re2 PROPERTIES
      IMPORTED_LOCATION "${WNA16_RE2_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${WNA16_RE2_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES Threads::Threads)
  endif()
endif()
