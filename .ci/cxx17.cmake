# Included after every project() while building Horovod 0.28.1 (see .ci/cmake-cxx17):
# Horovod asks for CMAKE_CXX_STANDARD 14, PyTorch >= 2.1 headers need C++17.
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++17")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++17")
