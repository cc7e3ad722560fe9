"""The llama.cpp engine: a GGUF file through llama-cpp-python (docs/llama-cpp.md)."""
