#!/usr/bin/env python3
"""gen_unicode.py -- writes unicode_data.h: the Unicode tables cm384's tokenizer needs.

    python3 ggml_like/gen_unicode.py > ggml_like/unicode_data.h

What it writes
  - unicode_cat_runs[]: the General_Category of every code point as sorted
    runs.  Entry = (first_code_point << 5) | category; a run lasts until the
    next entry's first code point, so a binary search for the last start <= cp
    gives cp's category.  Unassigned code points are runs of UCAT_Cn.
  - unicode_latin1[]: the same for U+0000..U+00FF with the White_Space bit
    (0x20) folded in, a shortcut for the common case.
  - unicode_white_space[]: the White_Space property as [lo, hi] ranges, which
    is what Oniguruma's \s matches (it includes U+0085, excludes U+FEFF).

Which Unicode version
  The reference for token ids is Hugging Face tokenizers (Rust), whose regexes
  run on Oniguruma through the onig crate.  The Oniguruma bundled with
  tokenizers 0.23 (the engine that produced tests/fixtures) implements
  Unicode 16.0.  Python's unicodedata has its own version (3.11: 14.0), so
  this script takes Python's table and then applies ONIG_16_PATCH: every code
  point whose category differs between Python's unicodedata 14.0 and that
  Oniguruma.  The patch was measured, not typed from the standard: for each
  code point where Python 14.0 and Node's ICU (Unicode 17.0) disagree, the
  category Oniguruma gives was found by running tokenizers@0.23.2 (npm) with a
  pre-tokenizer Split(Regex "\p{Xx}", behavior Removed) for each of the 30
  categories.  None of Oniguruma's answers differs from ICU 17 on those code
  points except the 17.0 additions (which it leaves unassigned), so the
  result is exactly Unicode 16.0.  With a Python whose unicodedata is already
  16.0 the patch is a no-op (the script checks that each patched entry is
  either already right or was unassigned / U+1171E's old category).
  White_Space has not changed since Unicode 6.
"""
import sys
import unicodedata

CATS = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
        "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So",
        "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"]

# (first, last, category) of code points whose Unicode 16.0 category (as
# Oniguruma has it) differs from Python 3.11's unicodedata 14.0.
ONIG_16_PATCH = [
    (0x00897, 0x00897, "Mn"), (0x00CF3, 0x00CF3, "Mc"), (0x00ECE, 0x00ECE, "Mn"),
    (0x01B4E, 0x01B4F, "Po"), (0x01B7F, 0x01B7F, "Po"), (0x01C89, 0x01C89, "Lu"),
    (0x01C8A, 0x01C8A, "Ll"), (0x02427, 0x02429, "So"), (0x02FFC, 0x02FFF, "So"),
    (0x031E4, 0x031E5, "So"), (0x031EF, 0x031EF, "So"), (0x0A7CB, 0x0A7CC, "Lu"),
    (0x0A7CD, 0x0A7CD, "Ll"), (0x0A7DA, 0x0A7DA, "Lu"), (0x0A7DB, 0x0A7DB, "Ll"),
    (0x0A7DC, 0x0A7DC, "Lu"), (0x105C0, 0x105F3, "Lo"), (0x10D40, 0x10D49, "Nd"),
    (0x10D4A, 0x10D4D, "Lo"), (0x10D4E, 0x10D4E, "Lm"), (0x10D4F, 0x10D4F, "Lo"),
    (0x10D50, 0x10D65, "Lu"), (0x10D69, 0x10D6D, "Mn"), (0x10D6E, 0x10D6E, "Pd"),
    (0x10D6F, 0x10D6F, "Lm"), (0x10D70, 0x10D85, "Ll"), (0x10D8E, 0x10D8F, "Sm"),
    (0x10EC2, 0x10EC4, "Lo"), (0x10EFC, 0x10EFF, "Mn"), (0x1123F, 0x11240, "Lo"),
    (0x11241, 0x11241, "Mn"), (0x11380, 0x11389, "Lo"), (0x1138B, 0x1138B, "Lo"),
    (0x1138E, 0x1138E, "Lo"), (0x11390, 0x113B5, "Lo"), (0x113B7, 0x113B7, "Lo"),
    (0x113B8, 0x113BA, "Mc"), (0x113BB, 0x113C0, "Mn"), (0x113C2, 0x113C2, "Mc"),
    (0x113C5, 0x113C5, "Mc"), (0x113C7, 0x113CA, "Mc"), (0x113CC, 0x113CD, "Mc"),
    (0x113CE, 0x113CE, "Mn"), (0x113CF, 0x113CF, "Mc"), (0x113D0, 0x113D0, "Mn"),
    (0x113D1, 0x113D1, "Lo"), (0x113D2, 0x113D2, "Mn"), (0x113D3, 0x113D3, "Lo"),
    (0x113D4, 0x113D5, "Po"), (0x113D7, 0x113D8, "Po"), (0x113E1, 0x113E2, "Mn"),
    (0x116D0, 0x116E3, "Nd"), (0x1171E, 0x1171E, "Mc"), (0x11B00, 0x11B09, "Po"),
    (0x11BC0, 0x11BE0, "Lo"), (0x11BE1, 0x11BE1, "Po"), (0x11BF0, 0x11BF9, "Nd"),
    (0x11F00, 0x11F01, "Mn"), (0x11F02, 0x11F02, "Lo"), (0x11F03, 0x11F03, "Mc"),
    (0x11F04, 0x11F10, "Lo"), (0x11F12, 0x11F33, "Lo"), (0x11F34, 0x11F35, "Mc"),
    (0x11F36, 0x11F3A, "Mn"), (0x11F3E, 0x11F3F, "Mc"), (0x11F40, 0x11F40, "Mn"),
    (0x11F41, 0x11F41, "Mc"), (0x11F42, 0x11F42, "Mn"), (0x11F43, 0x11F4F, "Po"),
    (0x11F50, 0x11F59, "Nd"), (0x11F5A, 0x11F5A, "Mn"), (0x1342F, 0x1342F, "Lo"),
    (0x13439, 0x1343F, "Cf"), (0x13440, 0x13440, "Mn"), (0x13441, 0x13446, "Lo"),
    (0x13447, 0x13455, "Mn"), (0x13460, 0x143FA, "Lo"), (0x16100, 0x1611D, "Lo"),
    (0x1611E, 0x16129, "Mn"), (0x1612A, 0x1612C, "Mc"), (0x1612D, 0x1612F, "Mn"),
    (0x16130, 0x16139, "Nd"), (0x16D40, 0x16D42, "Lm"), (0x16D43, 0x16D6A, "Lo"),
    (0x16D6B, 0x16D6C, "Lm"), (0x16D6D, 0x16D6F, "Po"), (0x16D70, 0x16D79, "Nd"),
    (0x18CFF, 0x18CFF, "Lo"), (0x1B132, 0x1B132, "Lo"), (0x1B155, 0x1B155, "Lo"),
    (0x1CC00, 0x1CCEF, "So"), (0x1CCF0, 0x1CCF9, "Nd"), (0x1CD00, 0x1CEB3, "So"),
    (0x1D2C0, 0x1D2D3, "No"), (0x1DF25, 0x1DF2A, "Ll"), (0x1E030, 0x1E06D, "Lm"),
    (0x1E08F, 0x1E08F, "Mn"), (0x1E4D0, 0x1E4EA, "Lo"), (0x1E4EB, 0x1E4EB, "Lm"),
    (0x1E4EC, 0x1E4EF, "Mn"), (0x1E4F0, 0x1E4F9, "Nd"), (0x1E5D0, 0x1E5ED, "Lo"),
    (0x1E5EE, 0x1E5EF, "Mn"), (0x1E5F0, 0x1E5F0, "Lo"), (0x1E5F1, 0x1E5FA, "Nd"),
    (0x1E5FF, 0x1E5FF, "Po"), (0x1F6DC, 0x1F6DC, "So"), (0x1F774, 0x1F776, "So"),
    (0x1F77B, 0x1F77F, "So"), (0x1F7D9, 0x1F7D9, "So"), (0x1F8B2, 0x1F8BB, "So"),
    (0x1F8C0, 0x1F8C1, "So"), (0x1FA75, 0x1FA77, "So"), (0x1FA87, 0x1FA89, "So"),
    (0x1FA8F, 0x1FA8F, "So"), (0x1FAAD, 0x1FAAF, "So"), (0x1FABB, 0x1FABF, "So"),
    (0x1FAC6, 0x1FAC6, "So"), (0x1FACE, 0x1FACF, "So"), (0x1FADA, 0x1FADC, "So"),
    (0x1FADF, 0x1FADF, "So"), (0x1FAE8, 0x1FAE9, "So"), (0x1FAF7, 0x1FAF8, "So"),
    (0x1FBCB, 0x1FBEF, "So"), (0x2B739, 0x2B739, "Lo"), (0x2EBF0, 0x2EE5D, "Lo"),
    (0x31350, 0x323AF, "Lo"),
]

WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0),
               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
               (0x205F, 0x205F), (0x3000, 0x3000)]


def main():
    cat = [unicodedata.category(chr(c)) for c in range(0x110000)]
    for lo, hi, c in ONIG_16_PATCH:
        for cp in range(lo, hi + 1):
            if cat[cp] not in ("Cn", c) and cp != 0x1171E:
                sys.exit("gen_unicode.py: unexpected category %s at U+%04X" % (cat[cp], cp))
            cat[cp] = c
    runs = []
    for cp, c in enumerate(cat):
        if not runs or runs[-1][1] != c:
            runs.append((cp, c))

    out = []
    out.append("/* unicode_data.h -- Unicode General_Category and White_Space for cm384's")
    out.append(" * tokenizer.  GENERATED by ggml_like/gen_unicode.py (Python %s, unicodedata" % sys.version.split()[0])
    out.append(" * %s, patched to Unicode 16.0 as Oniguruma / HF tokenizers have it; see the" % unicodedata.unidata_version)
    out.append(" * script).  Do not edit: run  python3 ggml_like/gen_unicode.py > ggml_like/unicode_data.h")
    out.append(" */")
    out.append("#ifndef CM384_UNICODE_DATA_H")
    out.append("#define CM384_UNICODE_DATA_H")
    out.append("")
    out.append("#include <stdint.h>")
    out.append("")
    out.append("#define UNICODE_DATA_VERSION \"16.0.0\"")
    out.append("")
    out.append("enum {")
    line = "   "
    for i, c in enumerate(CATS):
        item = " UCAT_%s = %d," % (c, i)
        if len(line) + len(item) > 78:
            out.append(line)
            line = "   "
        line += item
    out.append(line)
    out.append("    UCAT_COUNT = %d" % len(CATS))
    out.append("};")
    out.append("")
    out.append("/* (first code point << 5) | UCAT_xx; each run lasts until the next entry. */")
    out.append("static const uint32_t unicode_cat_runs[%d] = {" % len(runs))
    items = ["0x%07X" % ((cp << 5) | CATS.index(c)) for cp, c in runs]
    for i in range(0, len(items), 8):
        out.append("    " + ", ".join(items[i:i + 8]) + ",")
    out.append("};")
    out.append("")
    out.append("/* Latin-1 shortcut: category of U+0000..U+00FF, | 0x20 when White_Space. */")
    out.append("static const uint8_t unicode_latin1[256] = {")
    lat = []
    for cp in range(256):
        ws = any(lo <= cp <= hi for lo, hi in WHITE_SPACE)
        lat.append("%2d" % (CATS.index(cat[cp]) | (0x20 if ws else 0)))
    for i in range(0, 256, 16):
        out.append("    " + ", ".join(lat[i:i + 16]) + ",")
    out.append("};")
    out.append("")
    out.append("/* White_Space ranges [lo, hi]: Oniguruma's \\s. */")
    out.append("static const uint32_t unicode_white_space[%d][2] = {" % len(WHITE_SPACE))
    for lo, hi in WHITE_SPACE:
        out.append("    {0x%04X, 0x%04X}," % (lo, hi))
    out.append("};")
    out.append("")
    out.append("#endif /* CM384_UNICODE_DATA_H */")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
