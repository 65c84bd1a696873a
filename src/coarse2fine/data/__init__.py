"""The data path: sources -> conversion to TFRecord shards -> loaders (DALI or torch)."""
