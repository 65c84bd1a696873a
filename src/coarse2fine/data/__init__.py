"""The data path: where images come from, their conversion to TFRecord shards, and the loaders that read them.

- sources, listing: the images (an ImageFolder tree, or the photos or digits a package ships written out as one) and
  the cheap listing of what the pipeline reads from outside the repository, checked at every `dvc repro`;
- convert, records: the convert stage (decode check, sharded TFRecords, DALI index files, manifest) and the record
  layout it writes and everything else reads (`ShardReader`);
- loaders: `build_loader`, one interface over the two backends, dali_backend and torch_backend (the fallback without
  DALI), which share sampling (which records a rank reads, in what order, with which seeds) and transforms (what is
  done to an image and its geometry, defined once so that the backends cannot drift apart).
"""
