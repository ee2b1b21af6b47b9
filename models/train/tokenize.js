// Turn a UTF-8 text file into a binary file of little-endian uint16 token ids,
// using Hugging Face's Rust tokenizers (npm package tokenizers@0.23.2).
//
//   node tokenize.js TOKENIZER_JSON INPUT.txt OUTPUT.bin
//
// The whole file is encoded as ONE text with add_special_tokens = false:
// no BOS, no EOS (the tokenizer.json post-processor is ByteLevel and adds
// nothing anyway). NODE_PATH or a local node_modules must provide 'tokenizers'.
const fs = require('fs');
const { Tokenizer } = require('tokenizers');

async function main() {
  const [tokPath, inPath, outPath] = process.argv.slice(2);
  if (!outPath) {
    console.error('usage: node tokenize.js TOKENIZER_JSON INPUT.txt OUTPUT.bin');
    process.exit(2);
  }
  const tok = Tokenizer.fromFile(tokPath);
  const text = fs.readFileSync(inPath, 'utf8');
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  const ids = enc.getIds();
  const buf = Buffer.alloc(ids.length * 2);
  for (let i = 0; i < ids.length; i++) {
    if (ids[i] < 0 || ids[i] > 65535) throw new Error('id out of uint16 range');
    buf.writeUInt16LE(ids[i], i * 2);
  }
  fs.writeFileSync(outPath, buf);
  console.log(`${inPath}: ${text.length} chars -> ${ids.length} ids -> ${outPath}`);
}
main().catch((e) => { console.error(e); process.exit(1); });
