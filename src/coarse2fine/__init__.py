"""coarse2fine: the VOLO coarse-to-fine training recipe as a cached DVC pipeline."""

__version__ = "0.1.0"
