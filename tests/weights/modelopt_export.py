"""Quantize a Hugging Face model directory to NVFP4 with NVIDIA ModelOpt, on the CPU.

Run as a separate process (ModelOpt patches modules it quantizes; the tests never import it):
    python modelopt_export.py SRC OUT CALIB_JSON
CALIB_JSON: a list of token-id lists, each run as one calibration sequence.
"""
from __future__ import annotations

import json
import sys

import torch
import transformers


def main(src: str, out: str, calib: str) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    sequences = json.loads(open(calib).read())

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in sequences:
                m(torch.tensor([ids]))

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    # dtype given explicitly: ModelOpt 0.47 reads config.torch_dtype, a string in transformers 5
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
