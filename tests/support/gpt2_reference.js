// The reference GPT-2 encoder for tests/nodes/tokenizer_test.cpp: the npm package
// gpt-3-encoder (installed by scripts/data.sh into data/npm/).
//   node gpt2_reference.js NPM_PREFIX IN.json OUT.json
// IN.json: a JSON array of strings; OUT.json: a JSON array of their token id arrays.
const fs = require('fs');
const path = require('path');
const [npmPrefix, inFile, outFile] = process.argv.slice(2);
const { encode } = require(path.resolve(npmPrefix, 'node_modules', 'gpt-3-encoder'));
const texts = JSON.parse(fs.readFileSync(inFile, 'utf8'));
fs.writeFileSync(outFile, JSON.stringify(texts.map((t) => encode(t))));
