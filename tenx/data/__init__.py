"""Data, in two rooms: offline preparation (tenx.data.prepare: read a source, clean, deduplicate, split by
document, tokenize, decontaminate, write verified token shards) and what training and evaluation read
(manifest.py: a prepared directory verified; loader.py: the seeded, resumable token loader; tokenizer.py;
ngrams.py: the n-gram index that measures how much of a text training has seen); cli.py: `tenx data`."""
