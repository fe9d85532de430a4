// Computes cases.json for every tokenizer folder made by make_tokenizers.py, using the
// Hugging Face `tokenizers` library (its Node.js binding: the same Rust core as the Python
// package). Usage:
//   npm install --prefix /tmp/hftok tokenizers@0.23.2
//   NODE_PATH=/tmp/hftok/node_modules node tools/tokenizer_oracle/oracle.js DIR...
// Each DIR holds tokenizer.json and strings.json; cases.json is written next to them and
// strings.json is removed.
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

// Deterministic generator (LCG) so the fixtures are reproducible.
function rng(seed) {
  let s = BigInt(seed);
  return (n) => {
    s = (s * 6364136223846793005n + 1442695040888963407n) & ((1n << 64n) - 1n);
    return Number((s >> 33n) % BigInt(n));
  };
}

async function run(dir) {
  const tok = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  const strings = JSON.parse(fs.readFileSync(path.join(dir, 'strings.json'), 'utf8'));
  const vocabSize = tok.getVocabSize(true);
  const rand = rng(strings.length * 7919 + vocabSize);
  const cases = { encode: [], decode: [], encode_special: [], decode_skip_special: [] };
  const encodings = [];
  for (const text of strings) {
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    cases.encode.push({ text, ids });
    encodings.push(ids);
  }
  for (const text of strings.slice(0, 60)) {
    const ids = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    cases.encode_special.push({ text, ids });
  }
  const idLists = [];
  for (const ids of encodings) {
    if (ids.length > 0) idLists.push(ids);
    // Truncations cut multi-byte characters and byte-fallback runs at random places.
    if (ids.length > 1) idLists.push(ids.slice(0, 1 + rand(ids.length - 1)));
    if (ids.length > 2) idLists.push(ids.slice(rand(ids.length - 1)));
  }
  for (let i = 0; i < 150; ++i) {
    const n = 1 + rand(12);
    const ids = [];
    for (let k = 0; k < n; ++k) ids.push(rand(10) === 0 ? vocabSize + rand(5) : rand(vocabSize));
    idLists.push(ids);
  }
  for (const ids of idLists) {
    cases.decode.push({ ids, text: await tok.decode(ids, false) });
  }
  for (const ids of idLists.slice(0, 120)) {
    cases.decode_skip_special.push({ ids, text: await tok.decode(ids, true) });
  }
  fs.writeFileSync(path.join(dir, 'cases.json'), JSON.stringify(cases));
  fs.unlinkSync(path.join(dir, 'strings.json'));
  console.log(`${dir}: ${cases.encode.length} encode, ${cases.decode.length} decode cases`);
}

(async () => {
  for (const dir of process.argv.slice(2)) await run(dir);
})().catch((e) => { console.error(e); process.exit(1); });
