# `make fuzz`: builds the libFuzzer harnesses of tests/fuzz with clang (a
# separate build tree, build-fuzz) and runs each for FUZZ_SECONDS on a copy of
# its seed corpus. Needs clang and libFuzzer: Debian packages `clang` and
# `libclang-rt-14-dev`.
#
#   make fuzz                          # every target, 60 s each
#   make fuzz FUZZ_SECONDS=600 FUZZ_TARGETS=manifest
#
# Per target it prints the executions and the findings; a finding (crash,
# leak, timeout, out-of-memory, or a harness invariant) is saved under
# build-fuzz/artifacts/<target>/ and makes `make fuzz` fail once every target
# has run. The corpus grown under build-fuzz/corpus/<target> is kept between
# runs; the seeds in tests/fuzz/<target>/ are copied into it each time.
# Reproduce a finding: build-fuzz/fuzz/fuzz_<target> <artifact file>.

FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= manifest protocol config safetensors plan
FUZZ_JOBS ?= $(or $(JOBS),$(shell nproc 2>/dev/null || echo 2))
# Whole-library instrumentation: every object of ferry_core and ferry_schemas
# gets ASan, UBSan and libFuzzer's coverage counters; the harnesses add
# -fsanitize=fuzzer at link (tests/fuzz/CMakeLists.txt). -O1 without NDEBUG,
# so asserts stay on.
FUZZ_CXX_FLAGS ?= -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link
FUZZ_RUN_FLAGS ?= -timeout=5 -rss_limit_mb=2048 -print_final_stats=1

.PHONY: fuzz fuzz-build

fuzz-build:
	@command -v clang++ >/dev/null || { echo "fuzz: clang++ missing (apt-get install clang libclang-rt-14-dev)"; exit 1; }
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_BUILD_TYPE= -DFERRY_FUZZ=ON -DFERRY_BUILD_BENCH=OFF -DFERRY_CUDA=OFF \
	  -DCMAKE_CXX_FLAGS="$(FUZZ_CXX_FLAGS)"
	cmake --build $(FUZZ_BUILD) --target ferry_fuzzers -j $(FUZZ_JOBS)

fuzz: fuzz-build
	@failed=""; \
	for t in $(FUZZ_TARGETS); do \
	  bin=$(FUZZ_BUILD)/fuzz/fuzz_$$t; corpus=$(FUZZ_BUILD)/corpus/$$t; \
	  art=$(FUZZ_BUILD)/artifacts/$$t; log=$(FUZZ_BUILD)/logs/fuzz_$$t.log; \
	  mkdir -p $$corpus $$art $(FUZZ_BUILD)/logs; \
	  cp tests/fuzz/$$t/* $$corpus/ 2>/dev/null; \
	  echo "fuzz: fuzz_$$t for $(FUZZ_SECONDS) s on $$(ls $$corpus | wc -l) corpus files (log $$log)"; \
	  before=$$(ls $$art | wc -l); \
	  $$bin -max_total_time=$(FUZZ_SECONDS) $(FUZZ_RUN_FLAGS) -artifact_prefix=$$art/ \
	    $$corpus > $$log 2>&1; rc=$$?; \
	  runs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $$log | tail -1); \
	  [ -n "$$runs" ] || runs=$$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' $$log | tail -1); \
	  cov=$$(grep -Eo 'cov: [0-9]+' $$log | tail -1); \
	  found=$$(( $$(ls $$art | wc -l) - before )); \
	  echo "fuzz: fuzz_$$t: $${runs:-?} executions, $${cov:-cov: ?}, corpus $$(ls $$corpus | wc -l), $$found new findings, exit $$rc"; \
	  if [ $$rc -ne 0 ] || [ $$found -ne 0 ]; then \
	    failed="$$failed fuzz_$$t"; \
	    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*INVARIANT VIOLATED|.*runtime error)' $$log | head -5; \
	    ls -t $$art | head -3 | sed "s|^|fuzz:   artifact $$art/|"; \
	  fi; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: FINDINGS in$$failed"; exit 1; fi; \
	echo "fuzz: no findings"
