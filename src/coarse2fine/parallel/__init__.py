"""How a training stage spreads its model over the ranks (params `parallel`), as components the Trainer is given:

- strategies: the protocol the Trainer calls and `build`, its data parallel (DDP), sharded (FSDP2, with tensor
  parallel inside) and pipelined layouts, and their DCP checkpoint files;
- tensor_parallel, pipeline_parallel: splitting timm's transformer blocks over ranks, and a model into pipeline stages;
- model_blocks: a model's blocks, the units FSDP shards and a pipeline deals out.

The mesh's dimensions (coarse2fine.mesh) stay outside, torch-free, for the params' checks to import.
"""
