"""flintc's IR: torch.fx graphs of one model step, with the tools passes share.

See `flintc/graph/README.md` for the invariants every pass keeps.
"""
