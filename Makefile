# The two entry points of the README. Everything else is CMake.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
BUILD_TYPE ?= RelWithDebInfo
CMAKE_FLAGS ?=
DEMO_ARGS ?=

.PHONY: deps deps-test configure build demo test bench crashtest wheel clean

deps:
	bash scripts/install-deps.sh

# What only the tests need (the S3 server), on top of the build's packages.
deps-test:
	bash scripts/install-deps.sh --tests

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The demo needs only the CLI; the tests, benches and Python package build on `make test`.
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target ferry_cli
	$(BUILD)/ferry demo $(DEMO_ARGS)

test: deps-test build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The Python wheel (docs/python.md): dist/ferry-<version>-py3-none-<platform>.whl
wheel: build
	python3 python/make_wheel.py $(BUILD)/lib/libferry_c.so dist

bench: build
	$(BUILD)/bench/ferry_bench_save
	$(BUILD)/bench/ferry_bench_load
	$(BUILD)/bench/ferry_bench_plan

# Kills every role of every kill point RUNS times, each run in the scenario
# that reaches the point (tests/multiproc/kill_points_test.cpp), on a
# directory and on an s3:// root (tests/s3/kill_points_s3_test.cpp, with the
# suite's S3 server). ctest runs each once. Catch's discovery may drop the
# space after the "s3: " prefix, hence " ?"; a pattern that matches no test
# fails instead of passing.
RUNS ?= 100
crashtest: build
	FERRY_CRASH_RUNS=$(RUNS) $(BUILD)/tests/multiproc/ferry_multiproc_tests "[killpoints]"
	cd $(BUILD) && FERRY_CRASH_RUNS=$(RUNS) ctest -R 's3: ?on an s3:// root, a crash' \
	  --no-tests=error --output-on-failure

clean:
	rm -rf $(BUILD)

# Fuzzing (clang, libFuzzer) and sanitizer builds: see mk/.
include mk/fuzz.mk mk/sanitize.mk
include mk/gpu.mk
