"""Data preparation: read documents, clean, split by document, tokenize, write verified token shards."""
