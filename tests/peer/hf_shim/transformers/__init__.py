"""A stand-in for the few pieces of Hugging Face `transformers` that
llama.cpp's convert_hf_to_gguf.py uses on a DeepSeek checkpoint, for a
machine where `transformers` cannot be installed (it is not packaged by
Debian, and PyPI is not reachable here).

What it provides, and how:
  - AutoConfig.from_pretrained: always raises, so the converter takes its
    own documented fallback and reads config.json directly.
  - AutoTokenizer.from_pretrained: a tokenizer read from tokenizer.json and
    tokenizer_config.json: the vocab and added tokens as HF reports them
    (vocab, get_added_vocab, added_tokens_decoder), encode() through cm384's
    byte-level BPE (`cm384 tokenize`, which tests/test_tokenizer.c checks
    against HF tokenizers on DeepSeek-V3's tokenizer and 25 variants), with
    BOS prepended when tokenizer_config.json says add_bos_token as HF's
    encode() does, and decode() by the GPT-2 byte map.
Nothing else of transformers is here; anything else the converter asks for
fails loudly (AttributeError / ImportError)."""
import json
import os
import subprocess

CM384 = os.environ.get("CM384_BIN", "cm384")


class AutoConfig:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise RuntimeError("transformers shim: no AutoConfig (the converter falls back to config.json)")


def _byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class AddedToken:
    def __init__(self, d):
        self.content = d["content"]
        self.special = bool(d.get("special", False))
        self.normalized = bool(d.get("normalized", not self.special))
        self.lstrip = bool(d.get("lstrip", False))
        self.rstrip = bool(d.get("rstrip", False))
        self.single_word = bool(d.get("single_word", False))

    def __str__(self):
        return self.content


class _Tokenizer:
    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
        cfg = {}
        cp = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cp):
            with open(cp, encoding="utf-8") as f:
                cfg = json.load(f)
        self._model_vocab = dict(tj["model"]["vocab"])
        self.added_tokens_decoder = {a["id"]: AddedToken(a) for a in tj.get("added_tokens", [])}
        self._added = {a.content: i for i, a in self.added_tokens_decoder.items()}
        self.vocab = dict(self._model_vocab)
        self.vocab.update(self._added)
        self._id_to_token = {i: t for t, i in self.vocab.items()}
        self._add_bos = bool(cfg.get("add_bos_token", False))
        bos = cfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self._bos_id = self.vocab.get(bos) if bos else None
        self._bytes = _byte_decoder()

    def get_vocab(self):
        return dict(self.vocab)

    def get_added_vocab(self):
        return dict(self._added)

    def encode(self, text, add_special_tokens=True):
        if text in self._added:   # an added token alone is its id (HF matches added tokens first)
            ids = [self._added[text]]
            if add_special_tokens and self._add_bos and self._bos_id is not None:
                ids = [self._bos_id] + ids
            return ids
        out = subprocess.run([CM384, "tokenize", "-m", os.path.join(self.path, "tokenizer.json"), "--quiet", text],
                             check=True, capture_output=True, text=True).stdout
        ids = json.loads(out.splitlines()[0])
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            ids = [self._bos_id] + ids
        return ids

    def decode(self, ids, **kwargs):
        out = bytearray()
        for i in ids:
            t = self._id_to_token[i]
            if i in self.added_tokens_decoder:
                out += t.encode("utf-8")
            else:
                out += bytes(self._bytes[c] for c in t)
        return out.decode("utf-8", errors="replace")


class AutoTokenizer:
    @staticmethod
    def from_pretrained(path, *args, **kwargs):
        return _Tokenizer(str(path))
