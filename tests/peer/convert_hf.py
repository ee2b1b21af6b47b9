#!/usr/bin/env python3
"""Runs llama.cpp's own convert_hf_to_gguf.py (from the peer's source tree)
on a Hugging Face directory, on a machine without `transformers`:

    python3 tests/peer/convert_hf.py LLAMA_CPP_SRC HF_DIR OUT.gguf f32|f16|bf16|q8_0 [--vocab-only]

Three things are supplied here, and nothing else is changed:
  1. tests/peer/hf_shim/transformers: AutoConfig (absent: the converter
     reads config.json) and AutoTokenizer (tokenizer.json read directly,
     encode() by cm384's tokenizer); see its docstring.
  2. The pre-tokenizer name.  The converter recognises a tokenizer by
     hashing the ids it gives for a test string; that hash is only known
     for the released vocabularies, so a small vocabulary with DeepSeek-V3's
     pre-tokenizer (the fixtures' tokenizers) is refused.  When the
     converter's own recognition fails, this names the pre-tokenizer from
     tokenizer.json's pre_tokenizer section if it is exactly DeepSeek-V3's
     or DeepSeek-LLM/V2's (compared with tests/fixtures/tokenizer and the
     deepseek_v2 variant in tests/fixtures/tokenizer-variants), and fails
     as before otherwise.  For the real DeepSeek tokenizers the converter's
     hash is used unchanged.
  3. Debian's torch (1.13) predates the float8 and unsigned dtypes the
     converter names in its dtype tables; missing ones get placeholder
     objects that no tensor has (the checkpoints converted here are BF16
     and F32, so no conversion takes those paths)."""
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
src, hf_dir, out, outtype = sys.argv[1:5]
extra = sys.argv[5:]
sys.path.insert(0, os.path.join(here, "hf_shim"))
sys.path.insert(0, src)
sys.path.insert(1, os.path.join(src, "gguf-py"))
os.environ.setdefault("CM384_BIN", os.path.join(root, "build", "cm384"))

import torch  # noqa: E402
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if not hasattr(torch, _name):
        setattr(torch, _name, type("missing_dtype_" + _name, (), {})())

import conversion.base as base  # noqa: E402


def known_pre_tokenizers():
    with open(os.path.join(root, "tests/fixtures/tokenizer/tokenizer.json"), encoding="utf-8") as f:
        v3 = json.load(f)["pre_tokenizer"]
    v2 = None
    with open(os.path.join(root, "tests/fixtures/tokenizer-variants/cases.jsonl"), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["variant"] == "deepseek_v2":
                v2 = json.loads(d["pre_tokenizer"])
    return {"deepseek-v3": v3, "deepseek-llm": v2}


upstream = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return upstream(self, tokenizer)
    except NotImplementedError:
        with open(os.path.join(str(self.dir_model), "tokenizer.json"), encoding="utf-8") as f:
            pre = json.load(f).get("pre_tokenizer")
        for name, known in known_pre_tokenizers().items():
            if pre == known:
                base.logger.warning(f"pre-tokenizer hash unknown; tokenizer.json's pre_tokenizer is exactly {name}'s")
                return name
        raise


base.TextModel.get_vocab_base_pre = get_vocab_base_pre

sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype] + extra
import runpy  # noqa: E402
runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")
