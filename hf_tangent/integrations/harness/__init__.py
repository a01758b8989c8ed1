"""lm-eval integration: offline Austen tasks (tasks.py) and the in-memory evaluation of patched models (run.py)."""
