# The two commands: `make demo` and `make test`. Each sets up .venv with pinned dependencies first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
FBGEMM_VERSION := 1.8.0
GRPC_VERSION := 1.85.1
SERVING_PKGS := grpcio==$(GRPC_VERSION) grpcio-tools==$(GRPC_VERSION) grpcio-health-checking==$(GRPC_VERSION) \
	grpcio-reflection==$(GRPC_VERSION) protobuf==7.36.2 prometheus-client==0.26.0
# Triton's clients test the Open Inference Protocol (tritonclient[grpc,http]). Installed --no-deps, each
# dependency pinned: tritonclient asks for protobuf<7, yet its stubs load with our protobuf 7.36.2
# (tests/server/test_oip_descriptors.py imports them), and grpcio/protobuf must stay as pinned above.
TRITON_PKGS := tritonclient==2.73.0 python-rapidjson==1.25 ml-dtypes==0.5.4 urllib3==2.8.0 \
	gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 \
	brotli==1.2.1 certifi==2026.10.18
# fbgemm-gpu (CUDA build) where an NVIDIA driver is present, fbgemm-gpu-cpu otherwise.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
FBGEMM_PKG := $(if $(HAS_CUDA),fbgemm-gpu==$(FBGEMM_VERSION),fbgemm-gpu-cpu==$(FBGEMM_VERSION))
# embserve[torchrec]: torchrec declares fbgemm-gpu (the CUDA build), so it goes in without deps next to the
# fbgemm package above, with the pure-Python packages its model, quant, distributed and DCP paths import
# (typing-inspect also needs mypy-extensions, which mypy above brings).
TORCHREC_PKGS := torchrec==1.8.0 tensordict==0.15.3 cloudpickle==3.1.2 pyvers==0.2.2 pyre-extensions==0.0.32 \
	typing-inspect==0.9.0 tqdm==4.70.1
# the embserve[onnx] extra (model.onnx export and the onnxruntime backend); --no-deps keeps the pins above,
# their own dependencies (numpy, protobuf, typing_extensions, packaging) are already installed
ONNX_PKGS := onnx==1.23.2 onnxruntime==1.32.0 ml-dtypes==0.5.4 flatbuffers==25.12.19
# the embserve[safetensors] extra: streaming export reads .safetensors tables a slice at a time
SAFETENSORS_PKGS := safetensors==0.8.0
# the embserve[docs] extra: `make docs` builds docs/ with MkDocs Material, the API pages from docstrings
# (mkdocstrings); installed with their dependencies (Markdown, Jinja2, pymdown-extensions, griffe, ...)
DOCS_PKGS := mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
# the embserve[bench] extra: MLPerf LoadGen drives bench/loadgen.py (imported only there)
BENCH_PKGS := mlcommons-loadgen==6.0.17
# perf_analyzer, Triton's load generator (tests/server/test_perf_analyzer.py, bench/perf_analyzer.py). PyPI's
# perf-analyzer 0.1.0 is an empty placeholder (no binary) and its 2.58.0+ wheels are manylinux_2_38 (glibc 2.38;
# Debian 12 has 2.36); the binary tritonclient's manylinux wheels carried until 2.53 needs glibc <= 2.34 up to
# 2.51.0. It goes into a folder of its own (--target, so the tritonclient 2.73.0 above stays) with the CUDA
# runtime it is linked against (libcudart.so.12 only has to load: gRPC load needs no GPU) and Debian's libb64;
# $(BIN)/perf_analyzer is a launcher that points the loader at that folder.
PERF_ANALYZER_PKGS := tritonclient==2.51.0 nvidia-cuda-runtime-cu12==12.9.79
PERF_ANALYZER_DIR := $(VENV)/perf_analyzer
STAMP := $(VENV)/.installed
# torch and fbgemm alone, before the rest: all the C++ build reads from the venv (libtorch's headers, libraries and
# CMake package; fbgemm_gpu's folder for the RUNPATH), so make test compiles while pip installs the rest
TORCH_STAMP := $(VENV)/.torch-installed
# pytest-xdist workers for make test: one per core, at most 4 (each worker imports torch and fbgemm; the
# suite alone keeps one of two cores busy). Test files are the unit of distribution (--dist loadfile), so a
# module's fixtures (an exported or compiled artifact) are built once.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

.PHONY: demo test setup setup-torch lint typecheck pytest bench clean cpp cpp-deps perf-analyzer server server-asan docs

$(TORCH_STAMP): Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION) $(FBGEMM_PKG)
	touch $(TORCH_STAMP)

# order-only on torch's stamp: a venv that has both stamps reinstalls only when the Makefile or pyproject.toml changes
$(STAMP): pyproject.toml Makefile | $(TORCH_STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(FBGEMM_PKG) $(SERVING_PKGS) \
		pytest pytest-xdist==3.8.0 execnet==2.1.2 ruff mypy numpy scipy matplotlib "hypothesis==6.140.0" \
		"setuptools>=64" $(DOCS_PKGS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		$(sort $(TRITON_PKGS) $(TORCHREC_PKGS) $(ONNX_PKGS) $(SAFETENSORS_PKGS) $(BENCH_PKGS))
	$(BIN)/python -c "import torchrec.distributed, torchrec.models.dlrm, torchrec.quant"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/embserve demo

lint: $(STAMP)
	$(BIN)/ruff check infer server tests bench examples docs/generate.py docs/hooks.py
	$(BIN)/ruff format --check infer server tests bench examples docs/generate.py docs/hooks.py

# the docs site (docs/, mkdocs.yml) into build/site, warnings as errors; the reference pages are generated from
# the code as it builds (docs/generate.py)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site

typecheck: $(STAMP)
	$(BIN)/mypy infer server

# the native servers of the sanitized modules (tests/conftest.py SANITIZED_MODULES) run under embserve-server-asan
pytest: $(STAMP) cpp perf-analyzer
	cmake --build $(CPP_BUILD) -j2 --target embserve-server-asan
	EMBSERVE_SANITIZED_SERVER_BIN=$(abspath $(ASAN_BIN)) \
		$(BIN)/python -m pytest -q --durations=20 -n $(PYTEST_WORKERS) --dist loadfile

# The phases before the tests run side by side, each waiting on its own inputs only (the timed-X rules below):
# setup-torch (the venv with torch and fbgemm) and cpp-deps (apt) first; then the C++ build beside the rest of
# the venv (setup: pip, perf_analyzer), and ruff, mypy and the docs build once that is in. At the end the wall time
# of each phase (pytest's own --durations lists the 20 slowest tests above it).
PHASE_TIMES := build/make-test-phases.txt
test:
	@mkdir -p $(dir $(PHASE_TIMES)) && rm -f $(PHASE_TIMES)
	@$(MAKE) --no-print-directory -j6 timed-setup-torch timed-cpp-deps timed-setup timed-cpp timed-lint timed-typecheck \
		timed-docs CPP_TARGETS="all embserve-server-asan"
	@$(MAKE) --no-print-directory timed-pytest; status=$$?; \
		echo "make test: wall time per phase (those before pytest side by side):"; cat $(PHASE_TIMES); exit $$status

setup: $(STAMP) perf-analyzer

setup-torch: $(TORCH_STAMP)

# make test's order (one make -j, so each $(MAKE) X below starts only when what it reads is in)
timed-setup timed-cpp: timed-setup-torch
timed-cpp: timed-cpp-deps
timed-lint timed-typecheck timed-docs: timed-setup

# timed-X: make X, then append its wall time to $(PHASE_TIMES)
timed-%:
	@start=$$(date +%s); $(MAKE) --no-print-directory $*; status=$$?; \
		printf '  %-10s %5d s%s\n' $* $$(( $$(date +%s) - start )) "$$([ $$status = 0 ] || echo ' (failed)')" \
		>> $(PHASE_TIMES); exit $$status

bench: $(STAMP)
	$(BIN)/python bench/lookup.py

perf-analyzer: $(BIN)/perf_analyzer

$(BIN)/perf_analyzer: $(STAMP)
	@dpkg -s libb64-0d >/dev/null 2>&1 || ($(APT) update && $(APT) install -y libb64-0d)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
		--target $(PERF_ANALYZER_DIR) $(PERF_ANALYZER_PKGS)
	test -x $(PERF_ANALYZER_DIR)/bin/perf_analyzer
	printf '%s\n' '#!/bin/sh' 'here="$$(dirname "$$(readlink -f "$$0")")/../perf_analyzer"' \
		'LD_LIBRARY_PATH="$$here/nvidia/cuda_runtime/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" exec "$$here/bin/perf_analyzer" "$$@"' > $@
	chmod +x $@

# The C++ loader (cpp_loader/): libtorch from the torch wheel in .venv; needs cmake, a C++17 compiler,
# nlohmann-json3-dev and libssl-dev (installed with apt-get where missing, e.g. on a fresh CI machine).
# The native server (cpp_loader/server/, embserve-server) also needs Debian's gRPC C++, protobuf,
# prometheus-cpp and cpp-httplib (OIP REST, with OpenSSL) packages, installed the same way.
SERVER_DEBS := libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev prometheus-cpp-dev libcpp-httplib-dev
CPP_BUILD := cpp_loader/build
# configured once (the tests and `make server` reuse it); Ninja where installed (cpp-deps installs ninja-build): it
# builds the release and sanitizer targets of make test in one graph, compiling a program while its libraries link
CPP_CONFIGURE = test -f $(CPP_BUILD)/CMakeCache.txt || cmake -S cpp_loader -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release \
	-G "$$(command -v ninja >/dev/null 2>&1 && echo Ninja || echo 'Unix Makefiles')" \
	-DEMBSERVE_PYTHON=$(abspath $(BIN)/python) \
	-DCMAKE_PREFIX_PATH="$$($(BIN)/python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
# what `make cpp` builds; make test adds the sanitizer build of the server, so both compile side by side
CPP_TARGETS ?= all
# apt-get waits for the package lock: make test runs cpp-deps beside the venv's setup, perf-analyzer after it
APT = $(SUDO) apt-get -o DPkg::Lock::Timeout=300
SUDO := $(shell [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && echo sudo)

cpp-deps:
	@dpkg -s nlohmann-json3-dev libssl-dev $(SERVER_DEBS) >/dev/null 2>&1 || \
		($(APT) update && $(APT) install -y nlohmann-json3-dev libssl-dev $(SERVER_DEBS))
	@command -v cmake >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 || \
		($(APT) update && $(APT) install -y cmake g++ ninja-build)

cpp: $(TORCH_STAMP) cpp-deps
	$(CPP_CONFIGURE)
	cmake --build $(CPP_BUILD) -j2 --target $(CPP_TARGETS)
	cmake --install $(CPP_BUILD) --prefix $(CPP_BUILD)/install

# embserve-server alone (`embserve serve DIR --native` runs it from cpp_loader/build/server/)
server: $(TORCH_STAMP) cpp-deps
	$(CPP_CONFIGURE)
	cmake --build $(CPP_BUILD) -j2 --target embserve-server

# embserve-server-asan: embserve-server under AddressSanitizer + UndefinedBehaviorSanitizer, built beside the release
# binary (cpp_loader/server/CMakeLists.txt: only the server's own sources are compiled again). `make server-asan`
# builds it and runs the native tests of the sanitized modules against it (tests/conftest.py SANITIZED_MODULES: the
# bad-request corpus, v1 and OIP over gRPC and REST, malformed HTTP, REST token and TLS, contract, service,
# hardening, native, repository, pt2, the stop race); `make test` runs those same modules against it within its one
# pytest run. NativeServed and the stop race fail a test on any sanitizer line in the server's log.
ASAN_BIN := $(CPP_BUILD)/server/embserve-server-asan
server-asan: cpp $(STAMP)
	cmake --build $(CPP_BUILD) -j2 --target embserve-server-asan
	EMBSERVE_SANITIZED_SERVER_BIN=$(abspath $(ASAN_BIN)) $(BIN)/python -m pytest -q -p no:cacheprovider \
		-n $(PYTEST_WORKERS) --dist loadfile -m sanitized -k native

clean:
	rm -rf $(VENV) artifacts build $(CPP_BUILD)
