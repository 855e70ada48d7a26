"""Benchmarks: each a `treepo-ray bench <name>` command measuring a ratio side by side in one process and writing JSON."""
