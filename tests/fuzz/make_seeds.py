#!/usr/bin/env python3
"""make_seeds.py -- writes the fuzz seed corpora (tests/fuzz/corpus/NAME/)
from the test fixtures.  Run from the repository root; the output is
committed, so this only needs re-running when a fixture or a harness's input
layout changes.  Each seed is small: libFuzzer's inputs stay short and fast.
"""
import json, os, struct

FIX = "tests/fixtures"
OUT = "tests/fuzz/corpus"


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(rel, mode="r"):
    with open(os.path.join(FIX, rel), mode) as f:
        return f.read()


def compact(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---- json: real config files and the corners of the grammar ----
put("json", "config_v3.json", read("tiny-dsv3/config.json"))
put("json", "tokenizer_config.json", read("tiny-tokenizer/tokenizer_config.json"))
put("json", "escapes.json", r'{"a":"\u00e9\ud83d\ude00\ud800x\\\/\b\f\n\r\t\"","b":[1,-0,2.5e-3,1E+2,NaN,Infinity,-1e999],"c":{"":null,"t":true,"f":false}}')
put("json", "nested.json", "[" * 40 + "{}" + "]" * 40)
put("json", "bom.json", "\ufeff {\"k\" : [ ] }\n")
put("json", "raw_utf8.json", '["caf\u00e9 \u4f60\u597d", "\\u0000 NUL"]')

# ---- config: every fixture's config.json, compact ----
for fx in ("tiny-dsv3", "tiny-dsv2-group", "tiny-dsv2-lite", "tiny-dsv2-norm"):
    put("config", fx + ".json", compact(json.loads(read(fx + "/config.json"))))

# ---- safetensors: small shards made of the fixture's small tensors ----
def shard(tensors, meta=True):
    """tensors: list of (name, dtype, shape, bytes)"""
    hdr, data = {}, b""
    if meta:
        hdr["__metadata__"] = {"format": "pt"}
    for name, dt, shape, raw in tensors:
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = compact(hdr).encode()
    return struct.pack("<Q", len(h)) + h + data


raw = read("tiny-dsv3/model-00001-of-00002.safetensors", "rb")
hlen = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + hlen])
small = []
for k, v in hdr.items():
    if k == "__metadata__":
        continue
    b, e = v["data_offsets"]
    if e - b <= 256 and len(small) < 6:
        small.append((k, v["dtype"], v["shape"], raw[8 + hlen + b:8 + hlen + e]))
put("safetensors", "fixture_small.safetensors", shard(small))
f32 = struct.pack("<6f", 1, -2, 3.5, 0, 1e-3, -7)
f16 = struct.pack("<6e", 1, -2, 3.5, 0, 1e-3, -7)
put("safetensors", "f32_f16.safetensors", shard([("w.weight", "F32", [2, 3], f32), ("h.weight", "F16", [3, 2], f16)], meta=False))
fp8 = bytes([0x38, 0xb8, 0x40, 0x00, 0x30, 0xc8])           # e4m3 codes
scale = struct.pack("<f", 0.5)
put("safetensors", "f8_block_scale.safetensors",
    shard([("x.weight", "F8_E4M3", [2, 3], fp8), ("x.weight_scale_inv", "F32", [1, 1], scale)]))
put("safetensors", "other_dtypes.safetensors",
    shard([("i", "I64", [2], struct.pack("<2q", 1, -1)), ("b", "BOOL", [3], b"\1\0\1"), ("s", "F32", [], f32[:4])]))
put("safetensors", "empty.safetensors", shard([], meta=True))

# ---- shard_index: the fixture's index, and a minimal one that still loads ----
idx = json.loads(read("tiny-dsv3/model.safetensors.index.json"))
put("shard_index", "fixture.json", compact(idx))
wm = idx["weight_map"]
first = {}
for k, v in wm.items():
    first.setdefault(v, k)
put("shard_index", "one_per_shard.json", compact({"metadata": {}, "weight_map": {k: v for v, k in first.items()}}))

# ---- tokenizer: a shrunken tiny tokenizer, and the pre-tokenizer variants ----
tok = json.loads(read("tiny-tokenizer/tokenizer.json"))
vocab = {k: v for k, v in tok["model"]["vocab"].items() if v < 300}
merges = []
for mg in tok["model"]["merges"]:
    a, b = mg.split(" ") if isinstance(mg, str) else mg
    if a in vocab and b in vocab and a + b in vocab:
        merges.append(mg)
tok["model"]["vocab"] = vocab
tok["model"]["merges"] = merges
put("tokenizer", "tiny_small.json", compact(tok))
for line in filter(None, read("tokenizer-variants/cases.jsonl").split("\n")):
    case = json.loads(line)
    t = json.loads(compact(tok))
    t["pre_tokenizer"] = json.loads(case["pre_tokenizer"])
    if case.get("added_tokens"):
        t["added_tokens"] += json.loads(case["added_tokens"])
    if case.get("model"):
        t["model"].update(json.loads(case["model"]))
    put("tokenizer", "variant_" + case["variant"] + ".json", compact(t))

# ---- tokenizer_config: V3's and the tiny one's, and the other accepted forms ----
put("tokenizer_config", "v3.json", compact(json.loads(read("tokenizer/tokenizer_config.json"))))
put("tokenizer_config", "tiny.json", compact(json.loads(read("tiny-tokenizer/tokenizer_config.json"))))
put("tokenizer_config", "plain_strings.json", compact({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                                       "chat_template": "{{ bos_token }}..."}))
put("tokenizer_config", "template_list_r1.json", compact({"bos_token": {"content": "<｜begin▁of▁sentence｜>"},
    "chat_template": [{"name": "tool_use", "template": "x"},
                      {"name": "default", "template": "{% if '</think>' in content %}{{'<｜Assistant｜><think>\\n'}}"}]}))
put("tokenizer_config", "unknown_bos.json", compact({"bos_token": "<s>", "eos_token": {"content": None}}))

# ---- tokenize: flags byte, then text (cases of the real tokenizer) ----
cases = [json.loads(l) for l in read("tokenizer/cases.jsonl").split("\n")[:400] if l]
texts = sorted({c.get("text", "") for c in cases if isinstance(c.get("text"), str)}, key=lambda t: (len(t), t))
pick = [t for t in texts if 0 < len(t.encode()) <= 200][::max(1, len(texts) // 24)][:24]
for i, t in enumerate(pick):
    put("tokenize", "case%02d" % i, bytes([i & 3]) + t.encode())
put("tokenize", "special_tokens", b"\0<\xef\xbd\x9cUser\xef\xbd\x9c>hi<\xef\xbd\x9cAssistant\xef\xbd\x9c>")
put("tokenize", "invalid_utf8", b"\2\xff\xfe\xc3(\xe2\x82 \xf0\x9f\x98")

# ---- chat: the harness's layout: flags, count, then per message a selector
#      byte (role = sel & 7, bit 3 = NULL content, bits 4-5 = tool calls),
#      content (length byte + bytes), tool calls (NULL mask + fields) ----
def s(b):
    b = b.encode() if isinstance(b, str) else b
    return bytes([len(b)]) + b

def msg(role, content=None, calls=()):
    sel = role | (8 if content is None else 0) | (len(calls) << 4)
    out = bytes([sel]) + (s(content) if content is not None else b"")
    for typ, name, args in calls:
        mask = (typ is None) | (name is None) << 1 | (args is None) << 2
        out += bytes([mask]) + b"".join(s(x) for x in (typ, name, args) if x is not None)
    return out

SYS, USER, ASST, TOOL = 0, 1, 2, 3
put("chat", "system_user", bytes([1, 2]) + msg(SYS, "You are helpful.") + msg(USER, "Hello!"))
put("chat", "multi_turn", bytes([1, 4]) + msg(USER, "Hi") + msg(ASST, "Hello</think>there") + msg(USER, "2+2?") + msg(ASST, "4"))
put("chat", "tools", bytes([1, 4]) + msg(USER, "weather?") +
    msg(ASST, None, [("function", "get_weather", '{"city":"Paris"}'), ("function", "time", "{}")]) +
    msg(TOOL, "sunny") + msg(TOOL, "12:00"))
put("chat", "odd_roles", bytes([0, 3]) + msg(6, "dev") + msg(7, "User") + msg(5, ""))
# the first byte: bit 0 the generation prompt, bits 1-3 the format (the model's,
# V2, V2-0628, V2.5, V3, R1, and two that are none)
for i, name in ((1, "v2"), (2, "v2_0628"), (3, "v25"), (5, "r1"), (6, "not_a_format")):
    put("chat", "format_" + name, bytes([1 | i << 1, 3]) + msg(SYS, "Be brief.") + msg(USER, "Hi") + msg(ASST, "Hello</think>there"))

# ---- request: the harness's layout (mode byte, then the fields it selects) ----
def req(mode, text=None, ids=None, n_ids=None, samp=None, tenant=0):
    out = bytes([mode])
    if mode & 1:
        out += s(text)
    if mode & 4:
        out += bytes([len(ids)]) + b"".join(struct.pack("<I", i) for i in ids) + bytes([n_ids & 0xff])
    if mode & 16:
        out += samp
    return out + struct.pack("<I", tenant)

greedy = bytes([0, 0x45, 0]) + bytes([0]) + struct.pack("<Q", 0) + bytes([4]) + bytes([0])
sampled = bytes([3, 7, 9]) + bytes([5]) + struct.pack("<Q", 42) + bytes([6]) + bytes([0])
put("request", "text_greedy", req(1 | 16, text="Hello world", samp=greedy))
put("request", "ids_sampled", req(4 | 16, ids=[0, 17, 300, 5], n_ids=4, samp=sampled, tenant=3))
put("request", "ids_raw", req(4 | 8 | 16, ids=[0, 0xffffffff, 7], n_ids=3, samp=sampled))
put("request", "defaults", req(1, text="ROMEO:"))
