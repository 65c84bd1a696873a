"""Token labels: the teacher's per-image score maps and the per-batch targets made from them.

- generate: the token_labels stage's generation, the teacher's dense class scores for every train record;
- imported: the reference's published label files taken into the same store (`token_labels.mode: import`);
- store: the store both write, the top-k class log-probabilities per cell, memory-mapped for the students;
- targets: a batch's class and token targets, cut from the store by each crop's window and flip on its device.
"""
