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
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str



def main(vocab, merges, inp, out):
    # tiktoken_ext/openai_public.py's gpt2 encoding, less its download: its loader, pattern and
    # special token (the files are OpenAI's: scripts/data.sh checks their SHA-256).
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=merges, encoder_json_file=vocab)
    enc = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: 50256})
    texts = json.load(open(inp, encoding="utf-8"))
    # The texts are bytes that need not be valid UTF-8 only in the C++ test's random strings,
    # which it does not send here; <|endoftext|> in a text is plain text, as in flowrun.
    ids = [enc.encode(t, disallowed_special=()) for t in texts]
    json.dump(ids, open(out, "w"))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
