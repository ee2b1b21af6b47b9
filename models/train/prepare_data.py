#!/usr/bin/python3
"""Split tinyshakespeare into train/validation text and tokenize both.

    /usr/bin/python3 models/train/prepare_data.py

* input: models/train/tinyshakespeare.txt (Karpathy's char-rnn tinyshakespeare,
  1,115,394 bytes of ASCII; a copy of /work/shared/data/tinyshakespeare.txt).
* split by characters, like nanoGPT's shakespeare_char: train = text[:n],
  validation = text[n:], n = int(0.9 * len(text)) = 1,003,854.
* models/shakespeare/val.txt = the part of the validation split from the
  start of its first full speech (just after its first blank line) up to and
  including the last newline of a blank line within 24,576 characters of that.
* ids: node tokenize.js (npm tokenizers@0.23.2, the tiny DeepSeek tokenizer,
  whole text encoded as one string, add_special_tokens=false: no BOS/EOS),
  written as little-endian uint16 to data/{train,val,valtxt}.bin.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOKENIZER = os.path.join(ROOT, "models", "shakespeare", "tokenizer.json")
if not os.path.exists(TOKENIZER):
    TOKENIZER = "/work/shared/fixtures/tiny-tokenizer/tokenizer.json"
VAL_TXT_CHARS = 24576


def node_path():
    for p in [os.environ.get("NODE_PATH"), os.path.join(HERE, "node_modules"), "/tmp/npmtest/node_modules"]:
        if p and os.path.isdir(os.path.join(p, "tokenizers")):
            return p
    sys.exit("npm package tokenizers@0.23.2 not found: run `npm install tokenizers@0.23.2` in models/train "
             "(or set NODE_PATH)")


def tokenize(txt_path, bin_path):
    env = dict(os.environ, NODE_PATH=node_path())
    subprocess.run(["node", os.path.join(HERE, "tokenize.js"), TOKENIZER, txt_path, bin_path], check=True, env=env)


def main():
    text = open(os.path.join(HERE, "tinyshakespeare.txt"), encoding="utf-8").read()
    n = int(0.9 * len(text))
    train, val = text[:n], text[n:]
    a = val.index("\n\n") + 2
    b = val.rindex("\n\n", a, a + VAL_TXT_CHARS) + 1
    valtxt = val[a:b]
    d = os.path.join(HERE, "data")
    os.makedirs(d, exist_ok=True)
    for name, t in [("train", train), ("val", val)]:
        with open(os.path.join(d, name + ".txt"), "w", encoding="utf-8") as f:
            f.write(t)
    out_val = os.path.join(ROOT, "models", "shakespeare", "val.txt")
    os.makedirs(os.path.dirname(out_val), exist_ok=True)
    with open(out_val, "w", encoding="utf-8") as f:
        f.write(valtxt)
    print(f"text {len(text)} chars; train {len(train)}; validation {len(val)}; val.txt = validation[{a}:{b}] "
          f"({len(valtxt)} chars)")
    tokenize(os.path.join(d, "train.txt"), os.path.join(d, "train.bin"))
    tokenize(os.path.join(d, "val.txt"), os.path.join(d, "val.bin"))
    tokenize(out_val, os.path.join(d, "valtxt.bin"))


if __name__ == "__main__":
    main()
