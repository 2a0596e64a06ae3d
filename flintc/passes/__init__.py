"""Graph passes: one pass per file, one class per pass; `manager.py` orders them."""
