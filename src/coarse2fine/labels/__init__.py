"""Token labels: the teacher's per-image score maps (store.py) and the per-batch targets made from them
(targets.py)."""
