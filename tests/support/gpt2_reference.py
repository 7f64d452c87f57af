"""The reference GPT-2 encoder for tests/formats/tokenizer_test.cpp: OpenAI's tiktoken, its
"gpt2" encoding built from the same vocab.json and merges.txt as flowrun's (tiktoken's own
converter, which checks that the two files agree), so no download happens.

    python gpt2_reference.py VOCAB.json MERGES.txt IN.json OUT.json

IN.json: a JSON array of strings; OUT.json: a JSON array of their token id arrays.
"""
import json
import sys

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# tiktoken_ext/openai_public.py's gpt2 encoding, less its download: the same pattern, the same
# special token, and the SHA-256 of OpenAI's files, which the ranks loader checks.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


def main(vocab, merges, inp, out):
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=merges, encoder_json_file=vocab,
                                            vocab_bpe_hash=MERGES_SHA256, encoder_json_hash=VOCAB_SHA256)
    enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    texts = json.load(open(inp, encoding="utf-8"))
    # The texts are bytes that need not be valid UTF-8 only in the C++ test's random strings,
    # which it does not send here; <|endoftext|> in a text is plain text, as in flowrun.
    ids = [enc.encode(t, disallowed_special=()) for t in texts]
    json.dump(ids, open(out, "w"))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
