# Read by llama.cpp's own project() when `make test` builds llama-cpp-python's wheel
# (CMAKE_PROJECT_llama.cpp_INCLUDE in the Makefile's wheels step). llama-cpp-python forces
# llama.cpp's common library on; its Python code loads libllama and libggml through ctypes only
# (as llama-cpp-python's own Emscripten build, which turns common off too), and the tests use
# nothing else: off here, the build skips common and cpp-httplib.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp common library (not loaded from Python)" FORCE)
