# The PyTorch extension: python/wna16/csrc/*.cpp -> <build>/python/wna16/_C.so, a plain shared
# object that torch.ops.load_library loads (it registers torch.ops.wna16 and
# torch.classes.wna16.MoeWeights; no Python C API, so no libpython link). The package's .py files
# are symlinked beside it, so `PYTHONPATH=<build>/python python3 -c "import wna16"` works from the
# build tree and edits to the .py sources need no rebuild (scripts/test-python does this).
set_target_properties(wna16_formats wna16_reference wna16_io wna16_cpu wna16 PROPERTIES POSITION_INDEPENDENT_CODE ON)
if(TARGET wna16_cuda)
  set_target_properties(wna16_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON)
endif()

set(WNA16_PY_DIR ${CMAKE_BINARY_DIR}/python/wna16)
file(GLOB WNA16_TORCH_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/python/wna16/csrc/*.cpp)
# The CUDA kernels of the ops where both the library and Torch have CUDA (a pip/conda CUDA
# Torch: CMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'));
# otherwise ops_cuda_pending.cpp, which refuses CUDA tensors naming the build.
if(TARGET wna16_cuda AND TORCH_CUDA_LIBRARIES)
  set(WNA16_TORCH_CUDA ON)
  list(REMOVE_ITEM WNA16_TORCH_SOURCES ${CMAKE_SOURCE_DIR}/python/wna16/csrc/ops_cuda_pending.cpp)
else()
  set(WNA16_TORCH_CUDA OFF)
  list(REMOVE_ITEM WNA16_TORCH_SOURCES ${CMAKE_SOURCE_DIR}/python/wna16/csrc/ops_cuda.cpp)
endif()
message(STATUS "wna16: PyTorch extension, CUDA kernels: ${WNA16_TORCH_CUDA}")
add_library(wna16_torch MODULE ${WNA16_TORCH_SOURCES})
if(WNA16_TORCH_CUDA)
  target_compile_definitions(wna16_torch PRIVATE WNA16_TORCH_CUDA=1)
endif()
set_target_properties(wna16_torch PROPERTIES OUTPUT_NAME _C PREFIX "" SUFFIX ".so"
                                             LIBRARY_OUTPUT_DIRECTORY ${WNA16_PY_DIR})
target_include_directories(wna16_torch PRIVATE ${CMAKE_SOURCE_DIR}/python/wna16/csrc)
# Torch's headers come in as an imported target's includes (treated as system headers), so our
# warning flags, -Werror included, apply to our code only.
target_link_libraries(wna16_torch PRIVATE wna16 ${TORCH_LIBRARIES})
# Nothing from a static archive is exported: with a pip CUDA Torch (2.11, CUDA 13) the module
# otherwise exported a static copy of the C++ runtime's exception functions (__cxa_*), which took
# over Torch's, and an exception raised in an op crashed the process.
target_link_options(wna16_torch PRIVATE -Wl,--exclude-libs,ALL)
target_compile_options(wna16_torch PRIVATE ${WNA16_WARNINGS})

file(GLOB WNA16_PY_FILES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/python/wna16/*.py)
file(MAKE_DIRECTORY ${WNA16_PY_DIR})
foreach(f ${WNA16_PY_FILES})
  get_filename_component(name ${f} NAME)
  file(CREATE_LINK ${f} ${WNA16_PY_DIR}/${name} SYMBOLIC)
endforeach()

# Install: the package (its .py files and _C.so) into WNA16_PYTHON_INSTALL_DIR under the prefix, by
# default lib/pythonX.Y/site-packages of the python3 on PATH, so that
#   cmake --install build --component python --prefix ~/.local
# puts it on that interpreter's user site (no network, no pip). _C.so keeps the directories of
# the Torch libraries it links (Torch's own lib directory) as its run path.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_FOUND)
  set(WNA16_PY_SITE "lib/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/site-packages")
else()
  set(WNA16_PY_SITE "lib/python3/site-packages")
endif()
set(WNA16_PYTHON_INSTALL_DIR "${WNA16_PY_SITE}" CACHE PATH
    "Where `cmake --install` puts the wna16 Python package (relative: under the prefix)")
set_target_properties(wna16_torch PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
install(TARGETS wna16_torch LIBRARY DESTINATION ${WNA16_PYTHON_INSTALL_DIR}/wna16 COMPONENT python)
install(FILES ${WNA16_PY_FILES} DESTINATION ${WNA16_PYTHON_INSTALL_DIR}/wna16 COMPONENT python)
