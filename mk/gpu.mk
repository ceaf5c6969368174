# `make gpu-bundle`: a self-contained folder for a GPU machine that has none
# of our Debian libraries: the CLI, the
# real-GPU tests, the GPU benchmark, every shared library ldd lists outside
# glibc/libstdc++/libgcc, UCX's transport modules, and
# bench/gpu_check.sh to run there. Binaries find ../lib through their rpath.
GPU_BUNDLE ?= $(BUILD)/ferry-gpu-bundle
GPU_BUNDLE_MAX_MIB ?= 60

.PHONY: gpu-bundle

gpu-bundle: configure
	cmake --build $(BUILD) -j $(JOBS) --target ferry_cli ferry_gpu_tests ferry_bench_gpu
	bash mk/gpu_bundle.sh $(BUILD) $(GPU_BUNDLE) $(GPU_BUNDLE_MAX_MIB)
