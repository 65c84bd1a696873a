"""How a training stage (teacher, pretrain, finetune) trains: the one loop and what it is given.

- stage: a training stage assembled from its params (loaders, seed, model, the students' token-label store and
  objective, the strategy), then trained by the Trainer or, with `<stage>.mode: import`, taken from a weights file;
- train: the Trainer (optimizer, schedule, AMP, accumulation, clipping, EMA, checkpoints and resuming) and
  StagePaths, where a stage's files go;
- weights: a stage's model imported from, or started from, local weights files;
- losses: the objectives, ground truth (with timm's Mixup/CutMix) and token labeling (MixToken, the label mixed in).

Parallelism (coarse2fine.parallel) is a component the Trainer is given, not part of this package.
"""
