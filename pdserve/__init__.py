"""pdserve: prefill/decode-disaggregated LLM inference server."""
