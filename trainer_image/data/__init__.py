"""Training data: from ``spec.data`` to the batches a step trains on.

One pass per module::

    spec.data.train ──sources──► files (paths, globs, fsspec URLs; {stdlib})
                  ──tokenizer──► token ids (bytes, or a tokenizer.json)
                  ──corpus─────► one token array per split: documents joined by the
                                 end-of-text id (or token files, as they are)
                  ──loader─────► windows of seqLen + 1 tokens, shuffled by seed each
                                 epoch, this rank's shard, batched, prefetched on a thread;
                                 its position is part of every checkpoint

``alpajob data prepare`` (:mod:`.prepare`) tokenizes a text or jsonl corpus once into
token files, so a large corpus is not tokenized at every start. Without ``spec.data``
a job trains on synthetic tokens, and says so.
"""
